"""`index_copy_` into a mutated input in place (issue 16: static KV-cache decoding).

HF's static cache writes each token's keys and values with `self.keys.index_copy_(2, pos, k)`.
Tracing keeps traces SSA (`tracer/mutation.py`): the call is recorded out of place,
`t1 = torch.Tensor.index_copy(keys, 2, pos, k)`, and the input gets its write-back at the end,
`torch.Tensor.copy_(keys, t1)`: two copies of the whole preallocated cache per layer per token,
where eager writes one token's rows.

Where that is all the trace does with the input, the index_copy runs as
`t1 = torch.Tensor.index_copy_(keys, 2, pos, k)` and the write-back is dropped: the input
holds eager's values when the trace returns, and `t1` is the input, as eager's `index_copy_`
returns `self`. The rewrite applies only when (all read from the trace, so conservative):

- `keys` is a trace input that no statement reads before that index_copy or between it and
  its write-back `copy_(keys, t1)` (so no view of it exists whose values would change earlier
  than in the trace; statements after the write-back read its final values either way, such
  as an output that is a view of it; another input overlapping a mutated input runs eagerly:
  `check_no_input_aliasing`);
- neither `keys` nor the source requires grad, and `t1` is not an output of the trace (not a
  saved-for-backward value that a later call's write would change).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, Trace
from fulmen.executors.torch import _write_back, torch_ex
from fulmen.executors.torch.inplace import statement_readers
from fulmen.ops.functionalized import WRITE_BACK
from fulmen.transforms.base import transform

__all__ = ["INDEX_COPY_IN_PLACE", "index_copy_in_place"]

INDEX_COPY_IN_PLACE = torch_ex.register_operator(
    "index_copy_in_place", fn=torch.Tensor.index_copy_, like=torch.Tensor.index_copy)


def _target(bsym: BoundSymbol, inputs: set[str]):
    """The trace input a torch executor `index_copy` (positional, out of place) reads as its
    destination, or None for another statement."""
    if bsym.sym.executor is not torch_ex or bsym.sym.impl is not torch.Tensor.index_copy:
        return None
    if len(bsym.args) != 4 or bsym.kwargs or len(bsym.proxy_outputs) != 1:
        return None
    dst, source = bsym.args[0], bsym.args[3]
    if not isinstance(dst, torch.Tensor) or dst.name not in inputs or dst.requires_grad:
        return None
    if not isinstance(source, torch.Tensor) or source.requires_grad:
        return None
    return dst


def _is_write_back(bsym: BoundSymbol, dst, result) -> bool:
    """Whether `bsym` is the write-back `copy_(dst, result)` (as traced, or as claimed)."""
    if bsym.sym is not WRITE_BACK and bsym.sym.impl is not _write_back:
        return False
    return len(bsym.args) == 2 and not bsym.kwargs \
        and getattr(bsym.args[0], "name", None) == dst.name \
        and getattr(bsym.args[1], "name", None) == result.name


@transform("in-place index_copy")
def index_copy_in_place(trace: Trace) -> Trace:
    """Run `t1 = index_copy(x, ...)` with `x`'s write-back `copy_(x, t1)` as
    `t1 = x.index_copy_(...)` without the write-back (module docstring)."""
    bsyms = trace.bsyms
    inputs = {arg.name for arg in pytree.tree_leaves(trace.args) if isinstance(arg, torch.Tensor)}
    readers = statement_readers(bsyms)
    outputs = {leaf.name for leaf in pytree.tree_leaves(trace.output)
               if isinstance(leaf, torch.Tensor)}
    changed, dropped = list(bsyms), set()
    for i, bsym in enumerate(bsyms):
        dst = _target(bsym, inputs)
        if dst is None:
            continue
        result = bsym.proxy_outputs[0]
        if result.name in outputs:
            continue
        read = [j for j in readers.get(dst.name, ()) if j != i]
        if not read or read[0] < i or not _is_write_back(bsyms[read[0]], dst, result):
            continue  # read before the update, or between it and the write-back
        changed[i] = bsym.replace(sym=INDEX_COPY_IN_PLACE, subsymbols=())
        dropped.add(read[0])
    if not dropped:
        return trace
    return trace.replace(bsyms=tuple(b for j, b in enumerate(changed) if j not in dropped))
