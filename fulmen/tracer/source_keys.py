"""Cache keys of the values a program reads besides its arguments (`fulmen.tracer.guards`):
globals, closure cells, module attributes (`source_key`), plain objects and classes the code
reads (`object_source_key`, `class_source_key`); and the stores into them that the call puts
back (`GlobalStore`, `stored_proxies`, `restore_classes`)."""

from __future__ import annotations

import argparse
import dataclasses
import types
from typing import Any

import torch

from fulmen.core import RunsEagerly
from fulmen.proxies import TensorProxy
from fulmen.tracer.key_memo import holder_snapshot
from fulmen.tracer.leaf_keys import _float_key, _leaf_key, _tensor_key
from fulmen.tracer.objects import (
    is_plain_object,
    restore,
    snapshot,
    unchanged,
)
from fulmen.tracer.sources import (
    CONTAINERS,
    FUNCTIONS,
    NUMPY_ARRAYS,
    SCALARS,
    is_user_class,
)

Tensor = torch.Tensor


_EXACT_SCALARS = frozenset([bool, int, str, type(None)])
_MAX_ITEMS = 64  # containers longer than this are keyed by their length only
_NESTED_DEPTH = 2  # levels of containers inside a container keyed by their items


def source_key(value: Any) -> Any:
    """The key of a value read from a global, a closure cell or a module attribute: scalars by
    value; tensors by identity (the program captured that tensor object: its in-place updates
    are seen, a new tensor bound to the name is not; the entry keeps the old one alive, so the
    id cannot be reused while it matters); lists, tuples and dicts by their items, one level
    deep (`CONFIG["scale"]`, `self.sizes[0]`); modules by identity (a global or closure cell
    rebound to another model)."""
    kind = type(value)
    if kind in _EXACT_SCALARS:  # the common case, without `_leaf_key`'s isinstance chain
        return (kind, value)
    if kind is float:
        return (float, _float_key(value))
    if isinstance(value, Tensor):
        return ("tensor", id(value))
    if isinstance(value, torch.nn.Module):  # its state is read afresh; another one is a miss
        return ("module", value)  # (held: its id cannot be reused meanwhile)
    if isinstance(value, FUNCTIONS):  # held in the key: its id cannot be reused meanwhile
        try:
            return ("function", value, hash(value))
        except TypeError:  # a method of an unhashable object
            return ("function", id(value.__self__), value.__func__)
    if kind in CONTAINERS:
        if len(value) > _MAX_ITEMS:
            return (kind, len(value))
        items = value.items() if kind is dict else enumerate(value)
        return (kind, tuple([(k, _item_key(v)) for k, v in items]))
    return _leaf_key(value)


def _written_key(value: Any) -> Any:
    """The key of a module attribute that compiled programs store traced tensors into and never
    read as a tensor (`self.aux_loss = loss`): tensors by metadata, not identity (each call
    stores a new one), so Python that reads `self.aux_loss is None` or its shape is still
    guarded; containers one level deep."""
    if isinstance(value, Tensor):
        return ("tensor", _tensor_key(value))
    if type(value) in CONTAINERS and len(value) <= _MAX_ITEMS:
        items = value.items() if type(value) is dict else enumerate(value)
        return (type(value), tuple([(k, ("tensor", _tensor_key(v)) if isinstance(v, Tensor)
                                     else _item_key(v)) for k, v in items]))
    return source_key(value)


def _tensors_in(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if type(value) in CONTAINERS:
        return [v for v in (value.values() if type(value) is dict else value)
                if isinstance(v, Tensor)]
    return []


_MAX_ATTRIBUTES = 512


def class_source_key(cls: type) -> Any:
    """The key of a user class the code reads (`CFG.lr`, `self.scale` from the module's class):
    the class and its data attributes (numbers, strings, tensors, containers), as
    `object_source_key` keys a plain object's."""
    return (cls, tuple([(k, _item_key(v)) for k, v in vars(cls).items()
                        if not k.startswith("__") and _is_data(v)]))


def _is_data(value: Any) -> bool:
    return isinstance(value, (*SCALARS, Tensor)) or type(value) in CONTAINERS


def changed_classes(before: list[tuple[type, dict]]) -> list[type]:
    """The classes among `(class, dict(vars(class)))` snapshots whose attributes were stored
    or deleted since (compared by identity)."""
    return [cls for cls, saved in before if len(vars(cls)) != len(saved) or any(
        vars(cls).get(k, before) is not v for k, v in saved.items())]


def restore_classes(before: list[tuple[type, dict]]) -> None:
    """Put the classes of `changed_classes` snapshots back as they were."""
    for cls, saved in before:
        for k in [k for k in vars(cls) if k not in saved]:
            delattr(cls, k)
        for k, v in saved.items():
            if vars(cls).get(k, before) is not v:
                setattr(cls, k, v)


def object_source_key(value: Any) -> Any:
    """The key of a plain object a module holds (`self.config`): its type and its attributes,
    as `source_key` keys a dict's items; containers and data objects inside a data object
    (`_is_data_object`: a config) by their items too, inside another object (a logger, whose
    `_cache` fills as it is used) by identity."""
    state = vars(value)
    if len(state) > _MAX_ATTRIBUTES:
        return (type(value), id(value), len(state))
    depth = _NESTED_DEPTH if _is_data_object(value) else 0
    return (type(value), tuple([(k, _item_key(v, depth)) for k, v in state.items()]))


_DATA_OBJECTS = (types.SimpleNamespace, argparse.Namespace)


def _is_data_object(value: Any) -> bool:
    """A configuration object whose attributes `_item_key` keys when it is nested in a keyed
    value (`CFG.attention.dropout`): a dataclass, a namespace, an instance of a user class. Not
    any object with a `__dict__`: a logger nested in a config would key every logger."""
    return (type(value) in _DATA_OBJECTS or dataclasses.is_dataclass(value)
            and not isinstance(value, type)) or (
        is_user_class(type(value)) and is_plain_object(value))


def _nested_items(value: Any, depth: int) -> Any:
    """The items `_item_key` keys inside `value` (a container or data object), or None when it
    keys `value` by identity (too deep, too many)."""
    if depth <= 0:
        return None
    if type(value) in CONTAINERS:
        return value if len(value) <= _MAX_ITEMS else None
    if _is_data_object(value):
        state = vars(value)
        return state if len(state) <= _MAX_ATTRIBUTES else None
    return None


def _container_snapshots(value: Any, depth: int = _NESTED_DEPTH) -> list[tuple]:
    """Snapshots (`KeyMemo`) of a container or plain object and of the containers and data
    objects `_item_key` keys by their items inside it, so that changing a nested one recomputes
    the key."""
    snapshots = [holder_snapshot(value)]
    if type(value) in CONTAINERS:
        items = value if len(value) <= _MAX_ITEMS else ()  # (longer: keyed by length only)
    else:
        items = vars(value) if len(vars(value)) <= _MAX_ATTRIBUTES else ()
    if depth > 0:
        for item in (items.values() if isinstance(items, dict) else items):
            if _nested_items(item, depth) is not None:
                snapshots += _container_snapshots(item, depth - 1)
    return snapshots


def _collect_holders(value: Any, found: dict[int, Any], depth: int) -> None:
    if id(value) in found or not (type(value) in (list, dict) or is_plain_object(value)):
        return
    found[id(value)] = value
    items = snapshot(value)
    if depth > 0 and items is not None and len(items) <= _MAX_ITEMS:
        for item in (items.values() if isinstance(items, dict) else items):
            _collect_holders(item, found, depth - 1)


class GlobalStore(RunsEagerly):
    """The traced code stores into a global or a closure variable, or into a container or
    object held by one or by a default argument: a traced tensor (`STATS["loss"] = loss`,
    `nonlocal last; last = y`) would leave a proxy there, and a Python value (`global step;
    step += 1`, `acc.append(1)` into `acc=[]`) would not be stored by a compiled call, whose
    key was read before the store. The call runs eagerly (and what it stored into is put back
    as it was before tracing)."""


def stored_proxies(snapshots: list[tuple[Any, Any]]) -> tuple[list[str], list[str]]:
    """The stores the trace made into the holders and names of `global_snapshots`: what each
    that now holds a proxy was ("the global name 'LAST'", "a global dict"), and what each
    changed otherwise was. Where any changed, every one is put back: the call runs eagerly,
    which makes the trace's stores again (`counter[0] += 1; feats.append(y)` would count
    twice)."""
    leaked, stored = [], []
    changed = []
    for holder, saved in snapshots:
        if type(holder) is tuple:  # (a module's globals, a name) or (a closure cell, None)
            now = _bound(holder)
            if now is not saved:
                where = "a variable of an enclosing function" if holder[1] is None \
                    else f"the global name {holder[1]!r}"
                (leaked if isinstance(now, TensorProxy) else stored).append(where)
                changed.append((holder, saved))
            continue
        if unchanged(holder, saved):
            continue
        now = snapshot(holder)
        if any(isinstance(item, TensorProxy)
               for item in (now.values() if isinstance(now, dict) else now)):
            leaked.append(f"a global {type(holder).__name__}")
        else:
            stored.append(f"a {type(holder).__name__} held by a global, a closure variable or "
                          "a default argument")
        changed.append((holder, saved))
    for holder, saved in changed:
        if type(holder) is not tuple:
            restore(holder, saved)
        elif holder[1] is None:
            holder[0].cell_contents = saved
        else:
            holder[0][holder[1]] = saved
    return leaked, stored


def _bound(binding: tuple) -> Any:
    owner, name = binding
    return owner.cell_contents if name is None else owner.get(name)


def _item_key(value: Any, depth: int = _NESTED_DEPTH) -> Any:
    """The key of an item of a container `source_key` reads: as `source_key`'s for scalars and
    tensors; nested containers by their items too, `depth` more levels (`CFG["model"]["act"]`
    changed in place), then by identity."""
    kind = type(value)
    if kind in _EXACT_SCALARS:
        return (kind, value)
    if isinstance(value, Tensor):
        return ("tensor", id(value))
    if isinstance(value, (*SCALARS, *NUMPY_ARRAYS)):
        return _leaf_key(value)
    items = _nested_items(value, depth)
    if items is not None:
        items = items.items() if isinstance(items, dict) else enumerate(items)
        return (kind, tuple([(k, _item_key(v, depth - 1)) for k, v in items]))
    return (type(value), id(value))



__all__ = ["GlobalStore", "changed_classes", "class_source_key", "object_source_key",
           "restore_classes", "source_key", "stored_proxies"]
