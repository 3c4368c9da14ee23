"""`ObjectInputs`: the object arguments of one traced call (and the objects the traced function
holds: the `self` of a jitted bound method, its closure's objects), swapped in for tracing and put
back after it.

Before tracing, each tensor found inside the objects (`fulmen.tracer.objects.walk`) is replaced
by a proxy that becomes a trace input, read again through the same path on every call
(`read_tensors`); integers and floats traced as symbols are replaced by them. After tracing, the
objects are compared with their snapshots and each store the code made becomes an epilogue
action (`fulmen.tracer.objects.Epilogue`), then the objects are put back as they were.

This module sits above `objects.py` (the walk, keys, snapshots and the epilogue), which never
imports it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from fulmen.core import NotYetSupportedError, RunsEagerly
from fulmen.proxies import TensorProxy
from fulmen.tracer.objects import (
    _COPIED,
    _OPAQUE,
    Epilogue,
    _copy_memo,
    _grad_of,
    _store,
    _walkable,
    float_in_tuple,
    follow,
    path_text,
    rebuilt_tuples,
    restore,
    snapshot,
    tuple_chain,
    unchanged,
    walk,
)


class UnreplayableObjectStore(RunsEagerly):
    """A store into an object the traced code reads whose value cannot be rebuilt on later
    calls: the call runs eagerly."""


class UnrebuildableTuple(RunsEagerly):
    """A tensor inside an object argument is held by a tuple subclass that cannot be rebuilt
    with a proxy in its place (only plain and named tuples can): capturing the tensor would
    read the first call's, so the call runs eagerly."""


class ObjectInputs:
    """The object arguments of one traced call (see the module docstring).

    `roots` maps a flat argument index (or, negative, the position in `function_roots` of the
    traced function: -1 is the first) to the object.
    """

    def __init__(self, roots: dict[int, Any]) -> None:
        self.roots = roots
        self.tensor_paths: list[tuple[int, tuple]] = []
        self.epilogue = Epilogue()
        self._saved: list[tuple[Any, Any, Any]] = []  # (owner, step, real tensor or int)
        self._objects: dict[int, Any] = {}  # every container walked, by id
        self._snapshots: dict[int, tuple[Any, Any]] = {}
        self._rekeyed: list[tuple[dict, list]] = []

    def swap_in(self, make_proxy, make_int=None, stand_in=None
                ) -> list[tuple[TensorProxy, torch.Tensor]]:
        """Replace each tensor inside the objects by `make_proxy(root, path, tensor)` (or by
        what `stand_in(root, tensor, proxy)` gives for it: the proxy of the same tensor met
        before, NOTE [repeated tensor arguments]), and each
        integer or float for which `make_int(root, path, value)` gives a SymInt (a
        `FloatProxy`) by it; return
        `(proxy, tensor)` pairs in input order."""
        pairs = []
        stored = []  # what each tensor of `pairs` was replaced by in its holder
        existing = self.epilogue.existing
        for root_index, root in self.roots.items():
            self._objects[id(root)] = root
            existing.setdefault(id(root), (root_index, ()))
            for path, value in walk(root):
                if type(value) in (int, float) and make_int is not None:
                    owner = follow(root, path[:-1])
                    if isinstance(owner, tuple):  # a float in a plain tuple: the tuple rebuilt
                        if type(value) is float and float_in_tuple(root, path):
                            number = make_int(root_index, path, value)
                            if number is not None:
                                items = list(owner)
                                items[path[-1][1]] = number
                                holder = follow(root, path[:-2])
                                self._saved.append((holder, path[-2], owner))
                                _store(holder, path[-2], tuple(items))
                        continue
                    number = make_int(root_index, path, value)
                    if number is not None:
                        self._saved.append((owner, path[-1], value))
                        _store(owner, path[-1], number)
                elif _walkable(value):
                    self._objects[id(value)] = value
                    existing.setdefault(id(value), (root_index, path))
                elif isinstance(value, torch.Tensor) and not isinstance(value, TensorProxy):
                    owner = follow(root, path[:-1])
                    start = tuple_chain(root, path) if isinstance(owner, tuple) else None
                    if isinstance(owner, tuple) and start is None:
                        continue  # a tuple root is immutable: its tensors are the same objects
                    proxy = make_proxy(root_index, path, value)
                    held = proxy if stand_in is None else stand_in(root_index, value, proxy)
                    if start is not None:  # xLSTM's `cache.rnn_state[layer]`: tuples rebuilt
                        outer = follow(root, path[:start])
                        rebuilt = rebuilt_tuples(outer, path[start:], held)
                        if rebuilt is None:
                            raise UnrebuildableTuple(
                                f"a tensor of an object argument is held by a "
                                f"{type(outer).__qualname__} fulmen cannot rebuild "
                                f"(at {path_text(path)})", op="getitem",
                                hint="hold it in a list, a plain tuple or a named tuple")
                        holder = follow(root, path[:start - 1])
                        self._saved.append((holder, path[start - 1], outer))
                        _store(holder, path[start - 1], rebuilt)
                    else:
                        self._saved.append((owner, path[-1], value))
                        _store(owner, path[-1], held)
                    self.tensor_paths.append((root_index, path))
                    pairs.append((proxy, value))
                    stored.append(held)
                    grad_tensor = _grad_of(value)
                    if grad_tensor is not None:  # an optimizer reads `p.grad`: an input too
                        grad_path = (*path, ("attr", "grad"))
                        grad = make_proxy(root_index, grad_path, grad_tensor)
                        with torch._C.DisableTorchFunctionSubclass():
                            proxy.grad = grad
                        self.tensor_paths.append((root_index, grad_path))
                        pairs.append((grad, grad_tensor))
                        stored.append(grad)
        self._rekey(stored, [tensor for _, tensor in pairs])
        self._snapshots = {cid: (obj, snapshot(obj)) for cid, obj in self._objects.items()}
        return pairs

    def _rekey(self, proxies: list, tensors: list) -> None:
        """Dicts keyed by a tensor that is now an input (`optimizer.state[param]`) are keyed
        by its proxy while tracing, so the traced code finds the entries."""
        by_tensor = {id(t): p for p, t in zip(proxies, tensors)}
        for container in self._objects.values():
            if isinstance(container, dict) and any(id(k) in by_tensor for k in container):
                items = list(container.items())
                self._rekeyed.append((container, items))
                container.clear()
                container.update((by_tensor.get(id(k), k), v) for k, v in items)

    def record_stores(self) -> None:
        """Record the stores the traced code made into the objects (`epilogue.stores`)."""
        for obj, saved in self._snapshots.values():
            if saved is None or unchanged(obj, saved):
                continue
            root, path = self.epilogue.existing[id(obj)]
            if isinstance(obj, list):
                self.epilogue.stores.append((root, path, None, list(obj)))
                continue
            now = dict(obj) if isinstance(obj, dict) else dict(vars(obj))
            kind = "key" if isinstance(obj, dict) else "attr"
            if set(saved) - set(now):
                raise NotYetSupportedError(
                    f"the compiled function deletes {sorted(set(saved) - set(now))} from an "
                    f"object it was given ({type(obj).__qualname__})", op="del",
                    hint="delete outside the compiled function")
            for key, value in now.items():
                if key not in saved or saved[key] is not value:
                    self.epilogue.stores.append((root, path, (kind, key), value))
        for _, _, _, template in self.epilogue.stores:
            self._check_replayable(template)

    def _check_replayable(self, template: Any) -> None:
        """Raise `UnreplayableObjectStore` if a stored value cannot be rebuilt for later calls
        (`Epilogue.run` deep-copies what is new in it: a lock, a file, a C object cannot be)."""
        def kept(value):
            if isinstance(value, _OPAQUE) or id(value) in self.epilogue.existing \
                    or not _walkable(value):
                return value
            return _COPIED

        try:
            copy.deepcopy(template, _copy_memo(template, kept))
        except Exception as error:  # noqa: BLE001 - pickling protocols raise anything
            raise UnreplayableObjectStore(
                f"the function stores a value into an object it reads that cannot be copied "
                f"for later calls ({type(error).__name__}: {error})", op="setattr",
                hint="keep such objects out of the compiled function") from None

    def finish_restore(self) -> None:
        """Put every object back as it was before tracing (real tensors, no proxies)."""
        for obj, saved in self._snapshots.values():
            if saved is not None:
                restore(obj, saved)
        for owner, step, tensor in reversed(self._saved):  # (a tuple rebuilt twice: its first)
            _store(owner, step, tensor)
        for container, items in self._rekeyed:
            container.clear()
            container.update(items)

    def read_tensors(self, roots: dict[int, Any]) -> list[torch.Tensor]:
        """The tensors inside the call's objects, in input order."""
        return [follow(roots[root], path) for root, path in self.tensor_paths]
