"""Common subexpression elimination: a statement repeating an earlier one is dropped.

Two statements are the same when they call the same symbol on the same values: the same
proxies and equal constants (compared with their types, so `0`, `0.0` and `False` differ, and
floats by `repr`, so `-0.0` and `nan` are compared as written). Later reads of the repeat's
outputs read the first statement's outputs instead. Examples: the rotary `cos`/`sin` tables HF
models build per layer, the `arange`s of a mask built twice, a backward that reshapes one
value the same way for two matmuls.

A view that gives back its input unchanged (a reshape, view, expand or broadcast to the same
shape, an identity permute, `x[:, 0:]`) is dropped the same way: its readers read the input
(backward traces held dozens of `reshape(t, t.shape)` from rules, each a torch call). Only views
whose output equals the input for every value of its symbolic sizes (`known_same_shape`), of
the same dtype; `contiguous` and copies are not views.

Never merged: statements with side effects or random draws (`has_side_effects`), opaque ops
(whose state PyTorch does not describe), casts to a narrower float dtype of a value requiring
grad (each rounds its own cotangent in eager: `_rounds_a_gradient`), and repeats whose outputs
the trace returns (the caller gets distinct tensors, as eager gives).
"""

from __future__ import annotations

from typing import Any

from fulmen.core import BoundSymbol, Trace
from fulmen.core.proxy import Proxy, iter_proxies, map_proxies
from fulmen.core.symbol import Symbol
from fulmen.proxies.tensor import TensorProxy, known_same_shape, requires_grad_of
from fulmen.transforms.base import transform

# views that return their input's elements in place and order when the shape is unchanged
_SAME_SHAPE_VIEWS = frozenset({"ltorch.reshape", "ltorch.view", "ltorch.expand",
                               "ltorch.expand_as", "ltorch.flatten", "prims.reshape",
                               "prims.broadcast_in_dim"})
# every statement `_identity_view` may answer for (the others return None at once)
_IDENTITY_CANDIDATES = _SAME_SHAPE_VIEWS | {"prims.permute", "ltorch.permute", "ltorch.getitem"}


class _Unhashable(Exception):
    pass


def _key(value: Any) -> Any:
    """A hashable stand-in for an argument: proxies by name, constants with their type."""
    if isinstance(value, Proxy):
        return ("proxy", value.name)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _key(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _key(value.start), _key(value.stop), _key(value.step))
    if isinstance(value, (float, complex)):
        return (type(value).__name__, repr(value))
    if isinstance(value, Symbol):
        return ("symbol", id(value))
    try:
        hash(value)
    except TypeError:
        raise _Unhashable from None
    return (type(value).__name__, value)


def _statement_key(bsym: BoundSymbol) -> tuple | None:
    """What makes `bsym` the same as another statement, or None when it must stay."""
    if bsym.has_side_effects or "opaque" in bsym.sym.tags or not bsym.proxy_outputs \
            or _rounds_a_gradient(bsym):
        return None
    try:
        return id(bsym.sym), _key(bsym.args), _key(bsym.kwargs)
    except _Unhashable:
        return None


def _rounds_a_gradient(bsym: BoundSymbol) -> bool:
    """Whether `bsym` computes a floating result narrower than an input that requires grad
    (`x.to(torch.bfloat16)`, autocast's casts): its VJP rounds the cotangent to the narrow
    dtype, so two such casts merged would sum their cotangents before rounding where eager
    rounds each and sums in the wide dtype (`make fuzz`: a float64 gradient off by bf16's
    rounding). Such statements stay distinct in traces that autodiff will differentiate."""
    narrow = min((p.dtype.itemsize for p in bsym.proxy_outputs if isinstance(p, TensorProxy)
                  and (p.dtype.is_floating_point or p.dtype.is_complex)), default=None)
    if narrow is None:
        return False
    return any(isinstance(p, TensorProxy) and requires_grad_of(p) and p.dtype.itemsize > narrow
               and (p.dtype.is_floating_point or p.dtype.is_complex)
               for p in bsym.read_proxies)


def _reads_any(bsym: BoundSymbol, names) -> bool:
    """Whether `bsym` or a statement of its decomposition reads one of `names`."""
    return not bsym.input_names.isdisjoint(names) or \
        any(_reads_any(sub, names) for sub in bsym.subsymbols)


def _identity_view(bsym: BoundSymbol) -> TensorProxy | None:
    """The input of a view statement that returns it unchanged (module docstring), or None."""
    name = str(bsym.sym.id)
    if name not in _IDENTITY_CANDIDATES:  # asked first: the shape test below costs more
        return None
    if not bsym.args or len(bsym.proxy_outputs) != 1 or bsym.has_side_effects:
        return None
    source, out = bsym.args[0], bsym.proxy_outputs[0]
    if not (isinstance(source, TensorProxy) and isinstance(out, TensorProxy)
            and out.dtype == source.dtype and out.device == source.device
            and known_same_shape(tuple(out.shape), tuple(source.shape))):
        return None
    if name in _SAME_SHAPE_VIEWS:
        return source
    if name in ("prims.permute", "ltorch.permute"):
        dims = bsym.args[1] if len(bsym.args) == 2 and isinstance(bsym.args[1], (tuple, list)) \
            else bsym.args[1:]
        if all(type(d) is int for d in dims) and \
                [d % max(source.ndim, 1) for d in dims] == list(range(source.ndim)):
            return source
    if name == "ltorch.getitem":  # basic slicing only: an index tensor copies
        index = bsym.args[1] if isinstance(bsym.args[1], tuple) else (bsym.args[1],)
        if all(isinstance(item, slice) or item is Ellipsis for item in index):
            return source
    return None


@transform("common subexpression elimination")
def cse(trace: Trace, distinct: frozenset[str] | None = None) -> Trace:
    """Drop statements that repeat an earlier one; their readers read the first one's outputs.

    Example: in `t0 = ltorch.arange(8); t1 = ltorch.arange(8); t2 = ltorch.add(t0, t1)`, the
    second `arange` goes and `t2 = ltorch.add(t0, t0)`.

    A statement whose output the trace returns is kept (eager returns distinct tensors), except
    where `distinct` names the returned values that must stay apart: a split forward's user
    outputs, while its residuals, read by the backward by position, may be one value twice.
    """
    returned = trace.output_names if distinct is None else distinct
    first: dict[tuple, BoundSymbol] = {}
    replaced: dict[str, Proxy] = {}

    def rename(proxy: Proxy) -> Proxy:
        return replaced.get(proxy.name, proxy)

    kept: list[BoundSymbol] = []
    for bsym in trace.bsyms:
        if replaced and _reads_any(bsym, replaced.keys()):  # else nothing to rename: kept
            bsym = bsym.renamed(rename)
        source = _identity_view(bsym)
        if source is not None and not bsym.output_names & returned:
            replaced[bsym.proxy_outputs[0].name] = source
            continue
        key = _statement_key(bsym)
        earlier = first.get(key) if key is not None else None
        if earlier is not None and not bsym.output_names & returned:
            for mine, theirs in zip(iter_proxies(bsym.output), iter_proxies(earlier.output)):
                replaced[mine.name] = theirs
            continue
        if key is not None:
            first.setdefault(key, bsym)
        kept.append(bsym)
    if len(kept) == len(trace.bsyms):
        return trace
    return trace.replace(bsyms=tuple(kept), output=map_proxies(rename, trace.output))


__all__ = ["cse"]
