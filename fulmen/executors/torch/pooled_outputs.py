"""Large products of two matrices of the torch executor into fulmen's output pool (issue 21:
pythia-14m's training step).

A training step of a model with a large vocabulary makes the same large tensors every step;
the lm_head's weight gradient (`t = torch.matmul(t56, t54)`, 50304 x 128 float32 = 25.7 MB for
pythia-14m) is one of fulmen's own. torch takes it from glibc, which maps such a block freshly
and gives it back when it is freed (or trims it off the heap's top), so the next step touches
new pages: one page fault per 4 KiB page, 6,288 for this tensor (counted with `getrusage`
around each call of the backward). Fused kernels already take outputs of `pool.MIN_BYTES`
(1 MiB) and more from the pool (`executors/codegen/cpu/pool.py`), whose blocks stay mapped and
are reused once torch frees the tensor (for a gradient: when `zero_grad` drops `.grad`, which autograd's
accumulation took over without a copy).

So a statement `t = torch.matmul(a, b)` of the torch executor with two matrices (2-D operands:
`torch.mm`) whose output is a CPU tensor of static shape and at least `pool.MIN_BYTES` runs as
`torchex.pooled_mm(a, b)`: `aten.mm.out` into a pool block of the output's shape, the very
kernel `torch.mm` runs (a structured kernel: the functional call allocates and runs the `out=`
one), so the values are eager's bit for bit and the tensor is an ordinary contiguous CPU tensor
(whose storage cannot be resized, as for any pool output).

Where an `out=` call would not be eager's, the call runs as `torch.matmul` itself: grad mode on
and an operand requiring grad (a graph-break segment running in the caller's grad mode: `out=`
has no autograd), an operand that is not a CPU tensor, operands of different dtypes (eager's
error). `embedding_dense_backward`, as large, is left to torch: its `out=` overload is
generated (the functional call, then a copy), which would add a copy and keep the faults.
"""

from __future__ import annotations

import math

import torch

from fulmen.core import BoundSymbol, Trace
from fulmen.executors.codegen.cpu import pool
from fulmen.executors.torch import torch_ex
from fulmen.transforms.base import transform

__all__ = ["POOLED_MM", "pooled_outputs"]

_aten = torch.ops.aten


def _plain(*operands) -> bool:
    """Whether the call must run as the plain op (module docstring)."""
    return any(not t.is_cpu or (t.requires_grad and torch.is_grad_enabled()) for t in operands)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul(a, b)` of two matrices, into a pool block (module docstring)."""
    if _plain(a, b) or a.dtype != b.dtype:
        return torch.matmul(a, b)
    return _aten.mm.out(a, b, out=pool.empty((a.shape[0], b.shape[1]), a.dtype))


POOLED_MM = torch_ex.register_operator("pooled_mm", fn=_mm, like=torch.matmul)

_MATMULS = (torch.matmul, torch.mm)


def _takes_pool(bsym: BoundSymbol) -> bool:
    """Whether `bsym` is a large product of two matrices of the torch executor (module
    docstring)."""
    if bsym.sym.executor is not torch_ex or bsym.sym.impl not in _MATMULS or bsym.kwargs \
            or len(bsym.args) != 2:
        return False
    out = bsym.output
    return (all(isinstance(a, torch.Tensor) and a.dim() == 2 for a in bsym.args)
            and isinstance(out, torch.Tensor) and out.device.type == "cpu"
            and all(isinstance(size, int) for size in out.shape)
            and math.prod(out.shape) * out.dtype.itemsize >= pool.MIN_BYTES)


@transform("pooled outputs")
def pooled_outputs(trace: Trace) -> Trace:
    """Run the torch executor's large products of two matrices into pool blocks (module
    docstring); a trace without one is returned as is."""
    changed = [bsym.replace(sym=POOLED_MM, subsymbols=()) if _takes_pool(bsym) else bsym
               for bsym in trace.bsyms]
    if all(new is old for new, old in zip(changed, trace.bsyms)):
        return trace
    return trace.replace(bsyms=tuple(changed))
