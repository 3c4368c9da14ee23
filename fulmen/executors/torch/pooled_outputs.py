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
error). A `torch.cat` of tensors of one dtype whose output is at least `pool.MIN_BYTES` and,
as eager lays it out, contiguous (a cat of channels-last tensors is not) runs as
`torchex.pooled_cat`, `aten.cat.out` into a pool block (`cat` is a structured kernel too): the
backward of attention joins the q, k and v gradients in one (1.5 MiB in `make demo`, whose
fresh pages took 0.7 of the join's 1.8 ms a step; 0.85 ms with the pool, `fulmen.profile`).
`embedding_dense_backward`, as large, is left to torch: its `out=` overload is
generated (the functional call, then a copy), which would add a copy and keep the faults.
"""

from __future__ import annotations

import math

import torch

from fulmen.core import BoundSymbol, Trace
from fulmen.executors.codegen.cpu import pool
from fulmen.executors.torch import torch_ex
from fulmen.proxies.tensor import contiguous_strides
from fulmen.transforms.base import transform

__all__ = ["POOLED_CAT", "POOLED_MM", "pooled_outputs"]

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


def _cat(tensors, dim=0) -> torch.Tensor:
    """`torch.cat(tensors, dim)` whose output is contiguous, into a pool block (module
    docstring)."""
    first = tensors[0]
    if _plain(*tensors) or first.dim() == 0 \
            or any(t.dtype != first.dtype or t.dim() != first.dim() for t in tensors):
        return torch.cat(tensors, dim)
    dim %= first.dim()
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    out = pool.empty(tuple(shape), first.dtype)
    if out.untyped_storage().resizable():  # torch's memory (no pool): eager's own call
        return torch.cat(tensors, dim)
    return _aten.cat.out(tensors, dim, out=out)


POOLED_CAT = torch_ex.register_operator("pooled_cat", fn=_cat, like=torch.cat)

_MATMULS = (torch.matmul, torch.mm)


def _large(out) -> bool:
    return (isinstance(out, torch.Tensor) and out.device.type == "cpu"
            and all(isinstance(size, int) for size in out.shape)
            and math.prod(out.shape) * out.dtype.itemsize >= pool.MIN_BYTES)


def _pooled(bsym: BoundSymbol):
    """The pooled operator `bsym` runs as (module docstring), or None."""
    if bsym.sym.executor is not torch_ex or bsym.kwargs or not _large(bsym.output):
        return None
    if bsym.sym.impl in _MATMULS and len(bsym.args) == 2 \
            and all(isinstance(a, torch.Tensor) and a.dim() == 2 for a in bsym.args):
        return POOLED_MM
    if bsym.sym.impl is torch.cat and len(bsym.args) == 2 and type(bsym.args[1]) is int \
            and isinstance(bsym.args[0], (list, tuple)) \
            and all(isinstance(t, torch.Tensor) and t.dtype == bsym.output.dtype
                    for t in bsym.args[0]) \
            and tuple(bsym.output.stride()) == contiguous_strides(bsym.output.shape):
        return POOLED_CAT
    return None


@transform("pooled outputs")
def pooled_outputs(trace: Trace) -> Trace:
    """Run the torch executor's large products of two matrices into pool blocks (module
    docstring); a trace without one is returned as is."""
    changed = []
    for bsym in trace.bsyms:
        pooled = _pooled(bsym)
        changed.append(bsym if pooled is None else bsym.replace(sym=pooled, subsymbols=()))
    if all(new is old for new, old in zip(changed, trace.bsyms)):
        return trace
    return trace.replace(bsyms=tuple(changed))
