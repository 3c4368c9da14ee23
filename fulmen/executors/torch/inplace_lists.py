"""In-place ATen list ops (the optimizers' fused and multi-tensor paths) run in place on the
mutated inputs.

`torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, ...)` is traced as its functional
variant (`tracer/aten_inplace.py`): `((t2,), (t3,), (t4,), (t5,), ()) = aten._fused_adamw(...)`
makes a new copy of every tensor it writes, and each input gets its write-back
`copy_(param, t2)` at the end. A jitted fused AdamW step of 4 x 1M float32 parameters took
39 ms for the functional op and 23 ms for the write-backs where eager's step takes 16 ms.

Where that is all the trace does with the written inputs, the statement runs ATen's in-place op
itself, `torchex.aten_in_place('_fused_adamw_', [param], [grad], ...)`, whose results are the
written inputs, and their write-backs are dropped: the inputs hold eager's values when the trace
returns (the very kernel eager runs, on the same tensors). A chain of such ops on one input
(foreach AdamW's `_foreach_mul_(params, ...)` then `_foreach_addcdiv_(params, ...)`) runs in
place link by link. The rewrite applies to one statement only when every tensor it writes (read
from the trace, so conservative):

- is a distinct trace input that no statement reads before the statement or between it and its
  write-back `copy_(input, ...)` (as `inplace_index.py` asks of `index_copy`; an input
  overlapping a mutated input runs eagerly: `check_no_input_aliasing`), or the result of an
  earlier statement so rewritten that no statement reads after this one;
- has a result that is not an output of the trace, that no statement reads from the input's
  write-back on unless that copies it (then dropped), and, for an input requiring grad (a
  parameter), that only these list ops and the write-back read.

The op runs under `no_grad`, as the optimizers run it (the write-back copies so too).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, Trace
from fulmen.executors.torch import _write_back, torch_ex
from fulmen.executors.torch.inplace import statement_readers
from fulmen.ops.functionalized import WRITE_BACK
from fulmen.tracer.aten_inplace import functional_variant, written_arguments
from fulmen.transforms.base import transform

__all__ = ["ATEN_IN_PLACE", "aten_lists_in_place"]


def _written(name: str, args: tuple, kwargs: dict) -> list:
    """The arguments the ATen in-place op `name` writes, in its schema's order."""
    return [args[position] if position < len(args) else kwargs.get(argument)
            for position, argument in written_arguments(name)]


def _aten_in_place(name: str, *args, **kwargs):
    """Run ATen's in-place op `name` under no_grad; return the tensors it wrote, shaped as its
    functional variant's results (one list per written list argument)."""
    with torch.no_grad():
        getattr(torch.ops.aten, name)(*args, **kwargs)
    values = tuple(list(value) if isinstance(value, (list, tuple)) else value
                   for value in _written(name, args, kwargs))
    return values[0] if len(values) == 1 else values


def _no_meta(*args, **kwargs):
    raise AssertionError("aten_in_place is only put into traces after claiming")


ATEN_IN_PLACE = torch_ex.register_operator("aten_in_place", fn=_aten_in_place, meta=_no_meta)


def _in_place_name(bsym: BoundSymbol) -> str | None:
    """The name of the ATen in-place op whose functional variant the torch executor statement
    `bsym` runs (`_fused_adamw_` for `aten._fused_adamw`), or None."""
    if bsym.sym.executor is not torch_ex:
        return None
    packet = getattr(bsym.sym.impl, "overloadpacket", bsym.sym.impl)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return None
    name = f"{packet.__name__}_"
    if functional_variant(name) is not packet or not written_arguments(name):
        return None
    return name


def _pairs(name: str, bsym: BoundSymbol) -> list | None:
    """(input written, its new value) for every tensor `bsym` writes, or None when the output
    does not pair up with the written arguments."""
    written = _written(name, bsym.args, bsym.kwargs)
    results = bsym.output if len(written) > 1 else (bsym.output,)
    if not isinstance(results, (list, tuple)) or len(results) != len(written):
        return None
    pairs = []
    for targets, values in zip(written, results):
        many = isinstance(targets, (list, tuple))
        if many != isinstance(values, (list, tuple)) or (many and len(targets) != len(values)):
            return None
        pairs += zip(targets, values) if many else [(targets, values)]
    return pairs


@transform("in-place ATen list ops")
def aten_lists_in_place(trace: Trace) -> Trace:
    """Run a functional `aten._fused_adamw(...)` (or `_foreach_*`) whose written inputs are
    then only written back as ATen's in-place op, without the write-backs (module
    docstring)."""
    bsyms = trace.bsyms
    inputs = {arg.name: arg for arg in pytree.tree_leaves(trace.args)
              if isinstance(arg, torch.Tensor)}
    readers = statement_readers(bsyms)
    outputs = {leaf.name for leaf in pytree.tree_leaves(trace.output)
               if isinstance(leaf, torch.Tensor)}
    backs = _write_backs(bsyms)
    bases: dict[str, str] = {}  # a value written in place -> the input holding it
    changed, dropped = list(bsyms), set()
    for i, bsym in enumerate(bsyms):
        name = _in_place_name(bsym)
        pairs = _pairs(name, bsym) if name is not None else None
        if not pairs:
            continue
        found = _bases(i, pairs, bsyms, readers, inputs, outputs, backs, bases)
        if found is None:
            continue
        changed[i] = bsym.replace(sym=ATEN_IN_PLACE, args=(name, *bsym.args), subsymbols=())
        bases.update(found)
        dropped |= {backs[base][0] for result, base in found.items() if backs[base][1] == result}
    if not dropped:
        return trace
    return trace.replace(bsyms=tuple(b for j, b in enumerate(changed) if j not in dropped))


def _write_backs(bsyms) -> dict[str, tuple[int, str]]:
    """Input name -> (index, name of the value copied) of its write-back `copy_(input, value)`
    (as traced, or as claimed)."""
    backs = {}
    for index, bsym in enumerate(bsyms):
        if (bsym.sym is WRITE_BACK or bsym.sym.impl is _write_back) and len(bsym.args) == 2 \
                and not bsym.kwargs and all(isinstance(a, torch.Tensor) for a in bsym.args):
            backs[bsym.args[0].name] = (index, bsym.args[1].name)
    return backs


def _bases(i: int, pairs: list, bsyms, readers: dict, inputs: dict, outputs: set, backs: dict,
           bases: dict) -> dict[str, str] | None:
    """For each value statement `i` writes, the input whose storage holds it once the
    statement runs in place; None when one of them may not be written in place (module
    docstring)."""
    found: dict[str, str] = {}
    for dst, result in pairs:
        if not isinstance(dst, torch.Tensor) or not isinstance(result, torch.Tensor) \
                or result.name in outputs:
            return None
        if dst.name in inputs:  # no reader before, none between it and the write-back
            base = dst.name
            read = [j for j in readers.get(dst.name, ()) if j != i]
            if base not in backs or not read or read[0] != backs[base][0] or read[0] < i:
                return None
        elif dst.name in bases:  # an earlier value written in place, read no more after it
            base = bases[dst.name]
            if any(j > i for j in readers.get(dst.name, ())):
                return None
        else:
            return None
        if base in found.values():
            return None
        back, copied = backs[base]
        later = readers.get(result.name, ())
        if copied != result.name and any(j >= back for j in later):
            return None  # (the write-back of another value overwrites it)
        if inputs[base].requires_grad and any(
                j != back and _in_place_name(bsyms[j]) is None for j in later):
            return None  # a parameter's new value read only by the step's own list ops
        found[result.name] = base
    return found
