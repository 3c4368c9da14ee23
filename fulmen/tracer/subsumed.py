"""Static cache entries that a later entry with symbolic sizes makes redundant.

NOTE [subsumed entries]: under `dynamic=None` the first calls of a function are compiled for
their exact shapes; once a size varies, an entry with symbolic sizes is traced, and it often
accepts every call an older static entry accepts (the prefill of the first `generate` once
the prompt length varies, the evaluation forward once a forward at another length came). Both
count toward `cache_size_limit`, so a realistic flow (train, evaluate, `generate` at several
prompt lengths) reached the limit and ran further calls eagerly. A static entry is dropped when
a new symbolic entry is made that takes every call it served:
- its key, with the sizes (and integers) the new entry leaves out of its key erased
  (`erased_key`), equals the current call's key so erased: the same structure, dtypes,
  devices, requires_grad, contiguity, Python values, ambient state, module attributes (every
  guard that is not about a size);
- the new entry's shape guard holds on the sizes, strides and integers of the call the static
  entry was compiled for (`CallSizes`), which are the sizes of every call it served (its key
  fixes them all; a storage offset it does not fix is unknown, and a guard on it fails).
Where anything cannot be told (an offset-keyed argument, a grad on a tensor inside an object
argument, a guard that raises), the static entry is kept. Dropping an entry can never make a
result wrong: every call still passes the guards of the entry it runs; the worst a wrong
decision could do is a compilation more.
"""

from __future__ import annotations

from typing import Any

import torch

from fulmen.tracer.leaf_keys import HELD, REPEATED
from fulmen.tracer.objects import is_plain_object, walk
from fulmen.tracer.symbolic import INT, STRIDES

_ERASED_INT = ("erased int",)


class _Sizes:
    """What a shape guard reads of a tensor (`size()`, `stride()`, `storage_offset()`),
    without the tensor; an offset the entry's key does not fix raises."""

    __slots__ = ("_offset", "_shape", "_stride")

    def __init__(self, tensor: torch.Tensor, offset_known: bool) -> None:
        self._shape = tuple(tensor.shape)
        self._stride = tuple(tensor.stride())
        self._offset = tensor.storage_offset() if offset_known else None

    def size(self, dim: int | None = None):
        return torch.Size(self._shape) if dim is None else self._shape[dim]

    def stride(self, dim: int | None = None):
        return self._stride if dim is None else self._stride[dim]

    def storage_offset(self) -> int:
        if self._offset is None:
            raise LookupError("a storage offset the static entry's key does not fix")
        return self._offset


class _Held:
    """An object argument's integers and tensor sizes at their paths (`objects.follow`)."""

    __slots__ = ("_steps",)  # (a path through an attribute `_steps` finds this: kept, safely)

    def __init__(self) -> None:
        self._steps: dict = {}

    def __getattr__(self, name: str):
        try:
            return object.__getattribute__(self, "_steps")[("attr", name)]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key):
        for kind in ("item", "key"):
            if (kind, key) in self._steps:
                return self._steps[(kind, key)]
        raise KeyError(key)


def call_sizes(leaves: list, offsets: frozenset) -> list:
    """The stand-in of a call's flattened arguments that a shape guard can be evaluated on:
    tensors by their sizes, strides and (where the key fixes it: positions in `offsets`, tensors
    inside object arguments) storage offsets, integers as themselves, object arguments as the
    paths to their tensors and integers; None for anything else."""
    found: list[Any] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            found.append(_Sizes(leaf, i in offsets))
        elif type(leaf) is int:
            found.append(leaf)
        elif is_plain_object(leaf):
            root = _Held()
            for path, value in walk(leaf):
                if isinstance(value, torch.Tensor):
                    _put(root, path, _Sizes(value, True))
                elif type(value) is int:
                    _put(root, path, value)
            found.append(root)
        else:
            found.append(None)
    return found


def _put(root: _Held, path: tuple, value) -> None:
    """Record `value` at `path` (skipped where a step's key is a tensor: not kept alive)."""
    if any(isinstance(key, torch.Tensor) for _, key in path):
        return
    for step in path[:-1]:
        root = root._steps.setdefault(step, _Held())
        if not isinstance(root, _Held):
            return
    root._steps.setdefault(path[-1], value)


def accepts(shape_guard, sizes: list) -> bool:
    """Whether `shape_guard` holds on the stand-in `sizes` (`call_sizes`); False where it
    reads what the stand-in does not know."""
    try:
        return bool(shape_guard(sizes))
    except Exception:  # noqa: BLE001 - an unknown offset, a path the stand-in lacks: keep it
        return False


def _contiguous(shape: tuple, strides: tuple) -> bool:
    """`Tensor.is_contiguous()` of a tensor with these sizes and strides (a meta tensor's)."""
    return torch.empty_strided(shape, strides, device="meta").is_contiguous()


def _erased_tensor(key: Any, dims: tuple, has_grad: bool | None) -> tuple | None:
    """A tensor's key (shape, dtype, device, requires_grad, strides, ...) with the sizes in
    `dims` erased and contiguity in place of the strides (none where `dims` ends with
    `STRIDES`), as `leaf_keys._masked_key` keys it; `has_grad` None: from the key's length."""
    if not isinstance(key, tuple) or len(key) < 5 or not isinstance(key[0], torch.Size) \
            or dims == INT:
        return None
    shape, dtype, device, requires_grad, strides = key[:5]
    if has_grad is None:
        has_grad = len(key) == 6  # `_argument_tensor_key`: the grad's key after the strides
    free = dims[-1] == STRIDES
    dims = dims[:-1] if free else dims
    if any(d >= len(shape) for d in dims):
        return None
    sizes = list(shape)
    for d in dims:
        sizes[d] = None
    return ("erased", tuple(sizes), dtype, device, requires_grad,
            None if free else _contiguous(tuple(shape), strides), has_grad)


def erased_key(key: tuple, symbolic: dict, offsets: frozenset) -> tuple | None:
    """The static cache key `key` (`CacheKeyBuilder.key` without `symbolic`) with the sizes in
    `symbolic` (argument position -> dims, or `INT`) erased; two calls whose erased keys are
    equal have the same key for the entry with those symbolic dims. None where the key does not
    tell (an argument keyed with its storage offset, a structure the dims do not fit)."""
    if not key:
        return None
    if type(key[0]) is int:  # positional plain tensors: (count, global, state, *tensor keys)
        parts = list(key)
        for position, dims in symbolic.items():
            if type(position) is not int or position >= key[0]:
                return None
            parts[3 + position] = _erased_tensor(parts[3 + position], dims, None)
            if parts[3 + position] is None:
                return None
        return tuple(parts)
    spec, global_key, state_key, leaf_keys = key
    leaf_keys = list(leaf_keys)
    held: dict[int, dict] = {}  # object argument -> path -> dims
    for position, dims in symbolic.items():
        if isinstance(position, tuple):
            if position[0] < 0:  # an integer of the function's own objects: keyed apart
                return None
            held.setdefault(position[0], {})[position[1]] = dims
            continue
        if position >= len(leaf_keys) or position in offsets:
            return None
        leaf = leaf_keys[position]
        if isinstance(leaf, tuple) and leaf[:1] == (REPEATED,):
            continue  # an earlier argument again: keyed (and sized) as that one
        if dims == INT:
            if not (isinstance(leaf, tuple) and len(leaf) == 2 and leaf[0] is int
                    and type(leaf[1]) is int):  # `_leaf_key` of an integer: (int, value)
                return None
            leaf_keys[position] = _ERASED_INT
        else:
            leaf_keys[position] = _erased_tensor(leaf, dims, None)
            if leaf_keys[position] is None:
                return None
    for root, paths in held.items():
        if root >= len(leaf_keys) or not isinstance(leaf_keys[root], tuple):
            return None
        key, repeats = leaf_keys[root], None
        if len(key) == 3 and key[1] == HELD:  # (its key, HELD, repeats): `mark_repeated`
            key, repeats = key[0], key[2]
        if not isinstance(key, tuple) or not isinstance(key[0], type):
            return None
        parts = list(key)
        erased = 0
        for i, part in enumerate(parts[1:], 1):
            dims = paths.get(part[0]) if isinstance(part, tuple) and part else None
            if dims is None:
                continue
            if dims == INT:  # (path, (int, value))
                if len(part) != 2 or not isinstance(part[1], tuple) or part[1][:1] != (int,):
                    return None
                parts[i] = (part[0], _ERASED_INT)
            else:  # (path, object tensor key, grad key): a grad's leafness is not in the key
                if len(part) != 3 or part[2] is not None:
                    return None
                tensor = _erased_tensor(part[1], dims, False)
                if tensor is None:
                    return None
                parts[i] = (part[0], tensor, None)
            erased += 1
        if erased != len(paths):
            return None
        leaf_keys[root] = tuple(parts) if repeats is None else (tuple(parts), HELD, repeats)
    return (spec, global_key, state_key, tuple(leaf_keys))
