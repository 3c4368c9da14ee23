"""Cache keys of argument leaves (`fulmen.tracer.guards`): a tensor by its metadata, a number
by value (NaN equal to itself, -0.0 apart from 0.0), a plain object by what it holds
(`objects.object_key`), a tensor with symbolic sizes by the rest (`_masked_key`)."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.tracer.objects import (
    FLOAT_KEY,
    float_key,
    has_argument_grad,
    is_plain_object,
    object_key,
    walk,
)
from fulmen.tracer.sources import (
    NUMPY_ARRAYS,
    NUMPY_SCALARS,
    array_key,
)
from fulmen.tracer.symbolic import STRIDES

Tensor = torch.Tensor


def _tensor_key(t: Tensor) -> tuple:
    # the strides, not only contiguity: code reads `x.stride(0)` and
    # `is_contiguous(memory_format=...)`, and in-place updates of views depend on them
    return (t.shape, t.dtype, t.device, t.requires_grad, t.stride())


class StateRemoved(Exception):
    """A parameter or buffer the compiled calls read was set to None in place (`m.bias = None`
    replaces no dict entry, so `StructureWatch`'s O(1) check cannot see it)."""


def _state_key(t: Tensor) -> tuple:
    if t is None:
        raise StateRemoved
    return _tensor_key(t)


def _argument_tensor_key(t: Tensor) -> tuple:
    key = _tensor_key(t)
    return (*key, _tensor_key(t.grad)) if has_argument_grad(t) else key


def _object_tensor_key(t: Tensor) -> tuple:
    key = (*_tensor_key(t), t.storage_offset())
    return key if type(t) is Tensor else (type(t), *key)  # (as `_leaf_key`'s)


def _float_key(value: float) -> Any:
    """NaN equals itself, and -0.0 differs from 0.0 (`x * math.copysign(1, s)` bakes the sign
    in), though Python's `==` says otherwise for both."""
    if value != value:
        return "nan"
    if value == 0:
        return "-0.0" if math.copysign(1.0, value) < 0 else "0.0"
    return value


# leaves keyed by their type and value (`_leaf_key`'s last case), found by their exact type
_BY_VALUE = frozenset([bool, int, str, type(None), torch.device, torch.dtype])


def _leaf_key(leaf: Any) -> Any:
    if type(leaf) in _BY_VALUE:  # (what the last case below gives them, without the tests)
        return (type(leaf), leaf)
    if isinstance(leaf, Tensor):
        key = _argument_tensor_key(leaf)
        # keyed by its type too: `isinstance(w, nn.Parameter)` answers as eager while tracing,
        # a subclass with its own `__torch_function__` runs eagerly (`trace_program`)
        return key if type(leaf) is Tensor else (type(leaf), *key)
    if isinstance(leaf, float):
        return (type(leaf), _float_key(leaf))
    if isinstance(leaf, NUMPY_SCALARS):  # by value (a NaN too, as floats), and by type
        return (type(leaf), _leaf_key(leaf.item()))
    if isinstance(leaf, NUMPY_ARRAYS):
        return array_key(leaf)
    if isinstance(leaf, complex):
        return (complex, _float_key(leaf.real), _float_key(leaf.imag))
    if is_plain_object(leaf):  # its tensors are inputs, the rest of what it holds is guarded
        return object_key(leaf, _object_leaf_key)
    if isinstance(leaf, Hashable):
        try:
            return (type(leaf), leaf)
        except TypeError:
            pass
    return (type(leaf), id(leaf))


# NOTE [repeated tensor arguments]
# Eager code tells a tensor passed twice from two tensors by identity: `nn.MultiheadAttention`
# takes its fast path (a row-major result) and projects once only when `query is key is value`,
# and user code may branch on `a is b`. `fulmen.jit` traces a tensor passed at several argument
# positions, or held by an object argument as well (`h.t is x`), as one proxy
# (`trace_program(share_repeated=True)`; the object's path stays a trace input, unread), so the
# trace answers `is` as eager does, and the cache key marks each repeat by where it was met
# first: a call passing the same tensor twice and one passing two tensors never share an entry.


REPEATED = "repeats argument"  # the key of a tensor leaf met before: (REPEATED, where)
HELD = "holds tensors met before"  # an object argument's: (its key, HELD, ((path, where), ...))


def mark_repeated(leaves: list, leaf_keys: list, walks: dict[int, list]) -> None:
    """Replace the key of each tensor leaf that is the same object as an earlier leaf by the
    earlier one's position, and add to an object argument's key (`walks`: its walk) the paths
    of the tensors it holds that were met before (among the tensor leaves, then the objects in
    order), with where (NOTE [repeated tensor arguments])."""
    first: dict[int, Any] = {}
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor):
            seen = first.setdefault(id(leaf), index)
            if seen != index:
                leaf_keys[index] = (REPEATED, seen)
    for index, walked in walks.items():
        held = [(id(value), path) for path, value in walked if isinstance(value, Tensor)]
        ids = {key for key, _ in held}
        if len(ids) == len(held) and first.keys().isdisjoint(ids):  # the common case
            first.update((key, (index, path)) for key, path in held)
            continue
        repeats = []
        for key, path in held:
            seen = first.setdefault(key, (index, path))
            if seen != (index, path):
                repeats.append((path, seen))
        leaf_keys[index] = (leaf_keys[index], HELD, tuple(repeats))


def _is_object_leaf(leaf: Any) -> bool:
    """Whether `_leaf_key` keys `leaf` as an object argument (`object_key`)."""
    return type(leaf) not in _BY_VALUE and not isinstance(
        leaf, (Tensor, float, complex, *NUMPY_SCALARS)) and is_plain_object(leaf)


def _walked_key(leaf: Any, walks: dict[int, list], position: int) -> tuple:
    """`_leaf_key` of an object argument, keeping its walk in `walks` for the masked key of
    the same call (`CacheKeyBuilder.key`)."""
    walked = walks[position] = walk(leaf)
    return object_key(leaf, _object_leaf_key, walked=walked)


def _masked_key(t: Tensor, dims: tuple) -> tuple:
    """The key of a tensor whose sizes in `dims` are symbolic: those sizes left out (the entry's
    shape guard checks them), contiguity instead of strides (left out too where `dims` ends
    with `STRIDES`: the strides have symbols of their own, checked by the shape guard);
    whether it has a `.grad`, as `_argument_tensor_key` says."""
    shape = list(t.shape)
    free = dims[-1] == STRIDES
    if free:
        dims = dims[:-1]
    if any(d >= len(shape) for d in dims):
        return ("symbolic", "rank", len(shape))
    for dim in dims:
        shape[dim] = None
    key = ("symbolic", tuple(shape), t.dtype, t.device, t.requires_grad,
           None if free else t.is_contiguous(), has_argument_grad(t))
    return key if type(t) is Tensor else (*key, type(t))


def _object_leaf_key(leaf: Any) -> Any:
    return _object_tensor_key(leaf) if isinstance(leaf, Tensor) else _leaf_key(leaf)


# argument types pytree treats as leaves, exactly (subclasses may be registered as nodes)
_FLAT_LEAVES = frozenset([Tensor, torch.nn.Parameter, bool, int, float, str, type(None)])


def _pytree_leaf(value: Any) -> bool:
    """Whether pytree treats `value` as a leaf: its exact type is no registered node, and it is
    no tuple (every namedtuple is a node). An object argument (a KV cache) is one."""
    return type(value) not in pytree.SUPPORTED_NODES and not isinstance(value, tuple)


def _float_masks(positions) -> dict[int, dict]:
    """Object root -> {path: FLOAT_KEY} for the floats read at run time at `positions`."""
    masks: dict[int, dict] = {}
    for position in positions:
        if isinstance(position, tuple):
            masks.setdefault(position[0], {})[position[1]] = FLOAT_KEY
    return masks


def _mask_floats(leaves: list, leaf_keys: list, positions, walks: dict) -> None:
    """Key the floats read at run time (`positions`) among a call's leaves by their type."""
    for root, paths in _float_masks(positions).items():
        if 0 <= root < len(leaves) and is_plain_object(leaves[root]):
            leaf_keys[root] = object_key(leaves[root], _object_leaf_key, paths, walks.get(root))
    for position in positions:
        if type(position) is int and position < len(leaves) and type(leaves[position]) is float:
            leaf_keys[position] = float_key(leaves[position])


__all__ = ["StateRemoved"]
