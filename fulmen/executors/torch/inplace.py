"""ReLU in place on a matrix product's output that nothing else reads (issue 21: per-call cost).

In `t1 = F.relu(t0)` after `t0 = F.linear(x, w, b)`, where the relu is the only statement that
reads `t0` (so no view of it exists and `del t0` follows the relu), the relu may overwrite
`t0`: it runs as `t1 = torch.relu_(t0)`, which saves an allocation and a Python frame per layer
(about 0.7 µs on CPU; the 8 x (Linear + ReLU) module of `benchmarks/overhead.py` has 8 of them).
The values are eager's: `relu_` computes the same elementwise maximum. Only producers whose
output owns fresh storage count (matrix products); anything else (an input, a view, a fused
region's output, a value read twice or returned) keeps the out-of-place call.

Under autograd (a graph-break segment running in the caller's grad mode) the in-place relu is
recorded as eager records `relu_` on a non-leaf: the product's backward does not read its
output, and the relu's backward reads the relu's result, so gradients are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fulmen.core import BoundSymbol, Trace
from fulmen.executors.torch import torch_ex
from fulmen.executors.torch.onednn_linear import ONEDNN_LINEAR
from fulmen.executors.torch.pooled_outputs import POOLED_MM
from fulmen.transforms.base import transform

RELU_IN_PLACE = torch_ex.register_operator("relu_in_place", fn=torch.relu_, like=torch.relu)

_RELUS = (F.relu, torch.relu, torch.Tensor.relu)
_FRESH_PRODUCTS = (torch._C._nn.linear, F.linear, torch.addmm, torch.mm, torch.bmm,
                   torch.matmul, ONEDNN_LINEAR.impl, POOLED_MM.impl)


def statement_readers(bsyms) -> dict[str, list[int]]:
    """Name -> indices of the statements (not `del`s) of `bsyms` that read it, in order."""
    readers: dict[str, list[int]] = {}
    for index, bsym in enumerate(bsyms):
        if not bsym.is_del:
            for proxy in bsym.proxy_inputs:
                readers.setdefault(proxy.name, []).append(index)
    return readers


def _relu_input(bsym: BoundSymbol):
    """The proxy a torch executor relu reads (out of place), or None for another statement."""
    if bsym.sym.executor is not torch_ex or bsym.sym.impl not in _RELUS:
        return None
    if len(bsym.args) != 1 or any(value is not False for value in bsym.kwargs.values()):
        return None  # e.g. inplace=True (never traced so: functionalized), or unknown args
    arg = bsym.args[0]
    return arg if isinstance(arg, torch.Tensor) else None


@transform("in-place relu")
def relu_in_place(trace: Trace) -> Trace:
    """Rewrite `t1 = relu(t0)` as `t1 = torch.relu_(t0)` where `t0` is a matrix product's
    output read by that relu alone and deleted right after it (module docstring). Runs after
    `delete_last_used`, whose `del` statements say where each value dies."""
    bsyms = trace.bsyms
    fresh = {p.name for bsym in bsyms
             if bsym.sym.executor is torch_ex and bsym.sym.impl in _FRESH_PRODUCTS
             for p in bsym.proxy_outputs}
    readers = statement_readers(bsyms)
    changed = list(bsyms)
    for i, bsym in enumerate(bsyms):
        source = _relu_input(bsym)
        if source is None or source.name not in fresh or len(readers[source.name]) != 1:
            continue
        following = bsyms[i + 1] if i + 1 < len(bsyms) else None
        if following is None or not following.is_del or source.name not in {
                p.name for p in following.proxy_inputs}:
            continue  # `t0` lives on (an output of the trace)
        changed[i] = bsym.replace(sym=RELU_IN_PLACE, args=(source,), kwargs={}, subsymbols=())
    if changed == list(bsyms):
        return trace
    return trace.replace(bsyms=tuple(changed))
