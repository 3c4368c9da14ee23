"""A memo for the part of a cache key that rarely changes: the values a program may read
besides its arguments (closure cells, globals, module attributes: `sources.scalar_sources`).

Their key (`guards.CacheKeyBuilder._sources_key`) is a function of each value's identity and
type and, for the holders it looks into one level deep (lists, tuples, dicts, and plain objects
such as an HF config), of the identity and type of every item they hold and of their keys or
attribute names. Between two calls of a model none of that changes, yet computing the key walks
every attribute of every config object. `KeyMemo` keeps the values of the last computation,
a snapshot of each holder and the key; when every value is the very object it was and every
holder holds the very objects it held (identity, compared at C level), the old key is the key
the computation would return, and it is returned instead. Anything else recomputes.

The memo holds the last values alive until the next computation replaces them, so an identity
it compares cannot be reused by a new object meanwhile. The key comes wrapped in a `HashedKey`,
whose hash is computed once: a cache lookup of the same key object then costs no deep hashing.

`TensorKeyMemo` does the same for the metadata of a module's parameters and buffers: their key
is reused while PyTorch's C++ tensor check (`TensorGuards`) says each still has the sizes,
strides, dtype, device and requires_grad it had.

`RootsMemo` does the same for `objects.function_roots` of a jitted function (its optimizer,
the objects in its closure cells and globals), found on every call.
"""

from __future__ import annotations

import builtins
import itertools
import operator
import types
from typing import Any

import torch

from fulmen.tracer.objects import _module_optimizers, function_roots, global_names

_is = operator.is_
_chain = itertools.chain.from_iterable


class HashedKey:
    """A key (any hashable value) with its hash computed once; equal to another `HashedKey`
    exactly when their keys are equal."""

    __slots__ = ("key", "_hash")

    def __init__(self, key: Any) -> None:
        self.key = key
        self._hash = hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (type(other) is HashedKey and self._hash == other._hash
                and self.key == other.key)

    def __repr__(self) -> str:
        return f"HashedKey({self.key!r})"


def _contents(holder: Any, kind: type) -> tuple[Any, Any]:
    """(names or None, items) of what `holder` holds: a list's or tuple's items, a dict's keys
    and values, a plain object's attribute names and values."""
    if kind is list or kind is tuple:
        return None, holder
    mapping = holder if kind is dict else vars(holder)
    return mapping.keys(), mapping.values()


def holder_snapshot(holder: Any) -> tuple:
    """What `KeyMemo` compares a holder with on the next call: its type, names and items (and
    each item's type)."""
    kind = type(holder)
    names, items = _contents(holder, kind)
    items = tuple(items)
    return holder, kind, None if names is None else tuple(names), items, tuple(map(type, items))


def typed_snapshot(value: Any) -> tuple:
    """The snapshot of a value keyed by its identity and type only (no contents)."""
    return value, type(value), None, None, None


class KeyMemo:
    """The last key computed from a list of values (see the module docstring).

    `store` flattens the snapshots so that `lookup` compares everything with a few C-level
    passes (`map(operator.is_, ...)`) instead of a Python loop per holder: the holders' types;
    the `__dict__` of each plain object (a replaced `__dict__` is another object); the number of
    items of each holder (an item moved from one list to another keeps the total); then every
    item, its type, and every name, in one sequence each, read through live views
    (`dict.values()`, the list itself) made when the key was stored.
    """

    __slots__ = ("values", "key", "snapshots", "_holders", "_kinds", "_owners", "_dicts",
                 "_item_views", "_name_views", "_counts", "_items", "_types", "_names")

    def __init__(self) -> None:
        self.values: list | None = None
        self.key: HashedKey | None = None
        self.snapshots: list[tuple] = []

    def lookup(self, values: list) -> HashedKey | None:
        """The stored key if `values` and every snapshotted holder are as stored, else None."""
        old = self.values
        if old is None or len(values) != len(old) or not all(map(_is, values, old)):
            return None
        return self.held_key()

    def held_key(self) -> HashedKey | None:
        """The stored key if every snapshotted holder is as stored (the values being known to
        be the stored ones: `source_reads` NOTE [unchanged sources]), else None."""
        if self.values is None:
            return None
        if not self._holders:
            return self.key
        if not all(map(_is, map(type, self._holders), self._kinds)):
            return None  # (first: `vars` below needs each object to still have a `__dict__`)
        if self._owners and not all(map(_is, map(vars, self._owners), self._dicts)):
            return None
        views = self._item_views
        if tuple(map(len, views)) != self._counts:
            return None
        items = tuple(_chain(views))
        if not (all(map(_is, items, self._items)) and all(map(_is, map(type, items),
                                                               self._types))):
            return None
        if self._names and not all(map(_is, _chain(self._name_views), self._names)):
            return None
        return self.key

    def store(self, values: list, key: HashedKey, snapshots: list[tuple] | None) -> None:
        """Remember `key` for `values`; `snapshots=None` says the key depends on more than
        the snapshots cover, so nothing is remembered."""
        if snapshots is None:
            self.values, self.key, self.snapshots = None, None, []
            return
        self.values, self.key, self.snapshots = values, key, snapshots
        self._holders = tuple([s[0] for s in snapshots])
        self._kinds = tuple([s[1] for s in snapshots])
        owners, item_views, name_views, names, items, types = [], [], [], [], [], []
        for holder, kind, saved_names, saved_items, saved_types in snapshots:
            if saved_items is None:  # keyed by identity and type only
                continue
            if saved_names is None:  # a list or tuple: the holder is its own view
                item_views.append(holder)
            else:
                mapping = holder if kind is dict else vars(holder)
                if kind is not dict and not isinstance(holder, type):  # (a class's cannot be
                    owners.append((holder, mapping))  # replaced; `vars` makes a new proxy)
                item_views.append(mapping.values())
                name_views.append(mapping.keys())
                names += saved_names
            items += saved_items
            types += saved_types
        self._owners = tuple([holder for holder, _ in owners])
        self._dicts = tuple([mapping for _, mapping in owners])
        self._item_views, self._name_views = tuple(item_views), tuple(name_views)
        self._counts = tuple([len(s[3]) for s in snapshots if s[3] is not None])
        self._items, self._types, self._names = tuple(items), tuple(types), tuple(names)


try:  # PyTorch's C++ check of tensor metadata (what Dynamo's tensor guards were built on)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a build without Dynamo: keys are computed every call
    _TensorGuards = None

_DENSE_TYPES = (torch.Tensor, torch.nn.Parameter)


def tensor_check(tensors) -> Any:
    """A C++ check that tensors still have the dispatch keys (device type and more), dtype,
    device index, requires_grad, sizes and strides of `tensors`, or None for tensors it is not
    made for (subclasses, non-strided layouts)."""
    if _TensorGuards is None or not all(
            type(t) in _DENSE_TYPES and t.layout == torch.strided for t in tensors):
        return None
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])
    except Exception:  # noqa: BLE001 - no check: the key is computed every call
        return None


class ArgumentKeyMemo:
    """The keys of a call's positional arguments when every one is a plain tensor (`key_of`
    each: `leaf_keys._argument_tensor_key`), or None when one is not. Reused while PyTorch's
    C++ tensor check says each argument is still a plain tensor with the sizes, strides, dtype,
    device and requires_grad the keys were computed from (as `TensorKeyMemo`: about 0.1 µs a
    tensor instead of 0.8). Only arguments none of which requires grad are remembered: a leaf
    requiring grad is keyed by its `.grad` as well, which the check does not see."""

    __slots__ = ("key_of", "_check", "_keys", "_count")

    def __init__(self, key_of) -> None:
        self.key_of = key_of
        self._check = None
        self._keys: tuple = ()
        self._count = -1

    def keys(self, args: tuple) -> tuple | None:
        check = self._check
        if check is not None and len(args) == self._count and check.check(*args):
            return self._keys
        if not all([type(a) is torch.Tensor for a in args]):
            return None
        keys = tuple([self.key_of(a) for a in args])
        remember = args and not any([a.requires_grad for a in args])
        self._check = tensor_check(args) if remember else None
        self._keys, self._count = keys, len(args)
        return keys


class TensorKeyMemo:
    """The key of a list of tensors' metadata (`key_of` per tensor: its shape, dtype, device,
    requires_grad and strides), reused while PyTorch's C++ tensor check says each tensor still
    has all of these (it compares them, and more, at C speed: a module's 16 parameters in about
    1.5 µs instead of 12). A tensor replaced by another of the same metadata keeps the key, as
    the key itself would."""

    __slots__ = ("key_of", "_check", "_key", "_count")

    def __init__(self, key_of) -> None:
        self.key_of = key_of
        self._check = None
        self._key: HashedKey | None = None
        self._count = -1

    def key(self, tensors: list) -> HashedKey:
        check = self._check
        if check is not None and len(tensors) == self._count and check.check(*tensors):
            return self._key
        key = HashedKey(tuple([self.key_of(t) for t in tensors]))
        self._check, self._key, self._count = tensor_check(tensors), key, len(tensors)
        return key


_code_of = operator.attrgetter("__code__")
_cell_contents = operator.attrgetter("cell_contents")


def _type_decides_plainness(value: Any) -> bool:
    """Whether `objects.is_plain_object(value)` and `callable(value)` are functions of
    `type(value)`: not so where `hasattr(value, "__dict__")` may reach a `__getattr__`."""
    kind = type(value)
    return not hasattr(kind, "__getattr__") or any("__dict__" in vars(k) for k in kind.__mro__)


class RootsMemo:
    """`objects.function_roots(fn)` of a jitted function, reused while every read it made
    gives what it gave (the function's own objects are found again on every call: closure
    cells and globals may be rebound).

    NOTE [function roots memo]: the answer depends on the functions and methods it visits (a
    function's `__code__` is writable, its `__closure__` and `__globals__` are not, a method's
    `__self__` and `__func__` neither), on each closure cell's contents, each weak reference's
    referent, the values the code reads as globals, the optimizers a module it meets holds as attributes
    (asked again on every call), and on the type of every value it judges
    (`is_plain_object`, `callable`). The memo keeps each of those (holding them alive, so
    identities cannot be reused) and compares them by identity at C level. A traversal through
    another kind of callable, a list, tuple or dict whose items it reads, an empty cell, a weak reference (the memo would keep its
    referent alive) or a value whose plainness its type does not decide is not remembered."""

    __slots__ = ("_fn", "_roots", "_functions", "_codes", "_cells", "_contents", "_values",
                 "_types", "_namespace", "_names", "_globals", "_modules")

    def __init__(self) -> None:
        self._fn = None

    def roots(self, fn: Any) -> list:
        """`function_roots(fn)`, from the memo where nothing it read changed."""
        if self._fn is fn and self._unchanged():
            return list(self._roots)
        log: list = []
        roots = function_roots(fn, log=log)
        self._remember(fn, roots, log)
        return roots

    def _unchanged(self) -> bool:
        if not all(map(_is, map(_code_of, self._functions), self._codes)):
            return False
        try:
            contents = list(map(_cell_contents, self._cells))
        except ValueError:  # a cell emptied (`del` of a closed-over name)
            return False
        if not all(map(_is, contents, self._contents)):
            return False
        if self._names and not all(map(_is, map(self._namespace.get, self._names),
                                           self._globals)):
            return False
        for module, optimizers in self._modules:  # (`model.opt = ...` after the first call)
            now = _module_optimizers(module)
            if len(now) != len(optimizers) or not all(map(_is, now, optimizers)):
                return False
        return all(map(_is, map(type, self._values), self._types))

    def _remember(self, fn: Any, roots: list, log: list) -> None:
        self._fn = None
        if None in log:
            return
        functions, codes, cells, contents, values, modules = [], [], [], [], [], []
        namespace, names, global_values = None, [], []
        for entry in log:
            kind = entry[0]
            if kind == "code":
                functions.append(entry[1])
                codes.append(entry[2])
            elif kind == "cell":
                cells.append(entry[1])
                contents.append(entry[2])
            elif kind == "value":
                values.append(entry[1])
            elif kind == "module":
                modules.append((entry[1], entry[2]))
            else:  # "globals"
                namespace, names, global_values = entry[1], entry[2], entry[3]
                values += global_values
        if not all(map(_type_decides_plainness, values)):
            return
        self._fn, self._roots = fn, tuple(roots)
        self._functions, self._codes = tuple(functions), tuple(codes)
        self._cells, self._contents = tuple(cells), tuple(contents)
        self._values, self._types = tuple(values), tuple(map(type, values))
        self._namespace, self._names = namespace, tuple(names)
        self._globals = tuple(global_values)
        self._modules = tuple(modules)


def reads_unbound_globals(fn: Any) -> bool:
    """Whether `fn` reads a global that is not bound yet (or bound to None, nor a builtin): an
    optimizer assigned to it after `fulmen.jit(train_step)` is one of its objects, keyed on
    every call as those found when jitting (a key without it ran a stale program, or failed to
    find the object a compiled call reads)."""
    if not isinstance(fn, types.FunctionType):
        return False
    namespace = fn.__globals__
    return any(namespace.get(name) is None and name not in vars(builtins)
               for name in global_names(fn.__code__))
