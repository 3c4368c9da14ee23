"""A memo for the key of a jitted function's own object (`fulmen.jit(opt.step)`'s optimizer:
`guards.CacheKeyBuilder._fn_roots_key`).

`objects.object_key` walks every container the object holds (an AdamW over 18 parameters: about
1,600 visits, a fifth of the call). Between two steps the walk finds the very same containers
holding the very same values; only the tensors' metadata and `.grad`s, and the floats read at
run time (the learning rate: keyed by type only), may change without any container changing.
`ObjectKeyMemo` keeps, beside the last key, every container the walk went through with the
objects it held (identity, compared at C level in one pass: `all(map(operator.is_, ...))`),
and PyTorch's C++ check of the tensors' metadata (and of their grads'). A hit needs:

- the same root, and the same masks (which floats are keyed by type);
- every walked container of the same type, a plain object with the same `__dict__`, each
  holding as many items as before, the very same items (a masked float: any float) of the same
  types under the very same names (so a new parameter group value, a state tensor replaced, a
  parameter added to a group's list, all miss);
- each tensor's `.grad` present where it was, and every tensor and grad with the metadata the
  key was computed from (`key_memo.tensor_check`: sizes, strides, dtype, device,
  requires_grad).

A key that depends on more than that is not remembered: a leaf of a mutable type the walk does
not look into (its key may read values that change in place), a tensor the C++ check is not
made for, a walk cut short by its size limit, or integers keyed as symbols.
"""

from __future__ import annotations

import enum
import itertools
import operator
from typing import Any

import torch

from fulmen.ops.host_float import sign_class
from fulmen.tracer.key_memo import tensor_check
from fulmen.tracer.objects import (
    _MAX_SLOTS,
    _OPAQUE,
    FLOAT_KEY,
    _grad_of,
    _walkable,
    is_plain_object,
    object_key,
    walk,
)

_is = operator.is_
_chain = itertools.chain.from_iterable
_ANY_FLOAT = object()  # stands for a masked float among the compared items
# leaves whose key is a function of their identity: immutable values, and `objects._OPAQUE`'s
# (functions, methods, modules, classes: keyed by identity; an LR scheduler wraps `opt.step`
# in a function the optimizer holds), tensor subclasses excepted
_IMMUTABLE = frozenset([bool, int, float, complex, str, bytes, type(None), torch.dtype,
                        torch.device, torch.Size, slice, range, type(Ellipsis),
                        torch.memory_format, torch.layout])
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _steps(holder: Any) -> tuple[list, Any, Any]:
    """(the steps to each item, a live view of the items, of the names or None) of a walked
    container, in the order `objects._children` lists them."""
    if isinstance(holder, (list, tuple)):
        return [("item", i) for i in range(len(holder))], holder, None
    mapping = holder if isinstance(holder, dict) else vars(holder)
    kind = "key" if isinstance(holder, dict) else "attr"
    return [(kind, name) for name in mapping], mapping.values(), mapping.keys()


class ObjectKeyMemo:
    """The last `object_key` of one root (see the module docstring)."""

    __slots__ = ("_root", "_masks", "_key", "_kinds", "_holders", "_owners", "_dicts",
                 "_views", "_name_views", "_counts", "_items", "_types", "_names", "_floats", "_signs",
                 "_tensors", "_has_grad", "_check")

    def __init__(self) -> None:
        self._root = None
        self._key = None

    def key(self, root: Any, leaf_key, masks: dict | None) -> tuple:
        """`object_key(root, leaf_key, masks)`, reused while nothing it read changed."""
        if self._key is not None and self._root is root and self._masks == (masks or {}) \
                and self._unchanged():
            return self._key
        walked = walk(root)
        key = object_key(root, leaf_key, masks, walked)
        self._remember(root, masks, walked, key)
        return key

    def _unchanged(self) -> bool:
        if not all(map(_is, map(type, self._holders), self._kinds)):
            return False  # (first: `vars` below needs each object to still have a `__dict__`)
        if self._owners and not all(map(_is, map(vars, self._owners), self._dicts)):
            return False
        if tuple(map(len, self._views)) != self._counts:
            return False
        items = list(_chain(self._views))
        for index, sign in zip(self._floats, self._signs):
            if type(items[index]) is not float or sign_class(items[index]) not in (sign,):
                return False  # (a float's key holds the class of its sign)
            items[index] = _ANY_FLOAT
        if not (all(map(_is, items, self._items))
                and all(map(_is, map(type, items), self._types))):
            return False
        if self._names and not all(map(_is, _chain(self._name_views), self._names)):
            return False
        grads = list(map(_grad_of, self._tensors))
        if [g is not None for g in grads] != self._has_grad:
            return False
        return self._check is None or self._check.check(
            *self._tensors, *[g for g in grads if g is not None])

    def _remember(self, root: Any, masks: dict | None, walked: list, key: tuple) -> None:
        self._key = None
        if len(walked) >= _MAX_SLOTS or any(mask is not FLOAT_KEY
                                            for mask in (masks or {}).values()):
            return
        paths = {id(root): ()}  # each container by the path the walk first met it at
        holders, tensors = [root], []
        for path, value in walked:
            if _walkable(value):
                if id(value) not in paths:
                    paths[id(value)] = path
                    holders.append(value)
            elif type(value) in _TENSOR_TYPES:
                tensors.append(value)
            elif isinstance(value, torch.Tensor) or not (
                    type(value) in _IMMUTABLE or isinstance(value, (enum.Enum, _OPAQUE))):
                return  # (a numpy array, a set: keyed by what may change in place)
        grads = [_grad_of(t) for t in tensors]
        checked = tensors + [g for g in grads if g is not None]
        check = tensor_check(checked) if checked else None
        if checked and check is None:
            return
        views, name_views, names, items, floats, signs = [], [], [], [], [], []
        for holder in holders:
            steps, view, name_view = _steps(holder)
            views.append(view)
            if name_view is not None:
                name_views.append(name_view)
                names += list(name_view)
            base = paths[id(holder)]
            for step, item in zip(steps, view):
                if masks and type(item) is float and (*base, step) in masks:
                    floats.append(len(items))
                    signs.append(sign_class(item))
                    item = _ANY_FLOAT
                items.append(item)
        owners = [h for h in holders if is_plain_object(h)]
        self._root, self._masks, self._key = root, dict(masks or {}), key
        self._kinds, self._holders = tuple(map(type, holders)), tuple(holders)
        self._owners, self._dicts = tuple(owners), tuple(map(vars, owners))
        self._views, self._name_views = tuple(views), tuple(name_views)
        self._counts = tuple(map(len, views))
        self._items, self._types = tuple(items), tuple(map(type, items))
        self._names, self._floats, self._signs = tuple(names), tuple(floats), tuple(signs)
        self._tensors, self._has_grad = tensors, [g is not None for g in grads]
        self._check = check
