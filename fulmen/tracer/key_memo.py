"""A memo for the part of a cache key that rarely changes: the values a program may read
besides its arguments (closure cells, globals, module attributes: `guards.scalar_sources`).

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
"""

from __future__ import annotations

import operator
from typing import Any

_is = operator.is_


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
    return tuple(mapping), mapping.values()


def holder_snapshot(holder: Any) -> tuple:
    """What `KeyMemo` compares a holder with on the next call: its type, names and items (and
    each item's type)."""
    kind = type(holder)
    names, items = _contents(holder, kind)
    items = tuple(items)
    return holder, kind, names, items, tuple(map(type, items))


def typed_snapshot(value: Any) -> tuple:
    """The snapshot of a value keyed by its identity and type only (no contents)."""
    return value, type(value), None, None, None


def _unchanged(snapshot: tuple) -> bool:
    holder, kind, names, items, types = snapshot
    if type(holder) is not kind:
        return False
    if items is None:
        return True
    now_names, now_items = _contents(holder, kind)
    if len(now_items) != len(items):
        return False
    if names is not None and not all(map(_is, now_names, names)):
        return False
    return all(map(_is, now_items, items)) and all(map(_is, map(type, now_items), types))


class KeyMemo:
    """The last key computed from a list of values (see the module docstring)."""

    __slots__ = ("values", "key", "snapshots")

    def __init__(self) -> None:
        self.values: list | None = None
        self.key: HashedKey | None = None
        self.snapshots: list[tuple] = []

    def lookup(self, values: list) -> HashedKey | None:
        """The stored key if `values` and every snapshotted holder are as stored, else None."""
        old = self.values
        if old is None or len(values) != len(old) or not all(map(_is, values, old)):
            return None
        for snapshot in self.snapshots:
            if not _unchanged(snapshot):
                return None
        return self.key

    def store(self, values: list, key: HashedKey, snapshots: list[tuple] | None) -> None:
        """Remember `key` for `values`; `snapshots=None` says the key depends on more than
        the snapshots cover, so nothing is remembered."""
        if snapshots is None:
            self.values, self.key, self.snapshots = None, None, []
        else:
            self.values, self.key, self.snapshots = values, key, snapshots
