"""The lists and dicts among a call's arguments: stores the traced code makes into them are
replayed into the caller's containers after every compiled call (NOTE [argument container
stores]), or refused."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.core import RunsEagerly
from fulmen.tracer.objects import (
    ARGUMENTS,
    Epilogue,
    follow,
    path_text,
    restore,
    snapshot,
    unchanged,
    walk,
)


def _steps(key_path) -> tuple | None:
    """A pytree key path as `follow` steps, or None when it goes through a node that is not a
    tuple, list or dict (a namedtuple's or dataclass's field)."""
    steps = []
    for key in key_path:
        if isinstance(key, pytree.SequenceKey):
            steps.append(("item", key.idx))
        elif isinstance(key, pytree.MappingKey):
            steps.append(("key", key.key))
        else:
            return None
    return tuple(steps)


class ContainerStoreRefused(RunsEagerly):
    """The traced code changes a list or dict argument in a way the epilogue cannot replay
    (NOTE [argument container stores]): the call runs eagerly."""


class ArgumentContainers:
    """The lists and dicts inside a call's arguments, and the stores the traced code makes into
    them (`cache.append(kv)`, `state["h"] = h`, `cache.pop()`).

    NOTE [argument container stores]: pytree flattens lists and dicts, so the traced code sees
    copies rebuilt around the proxies, and a store into one would be lost. Each changed seen
    is recorded as an epilogue store replacing the real container's contents (found at the same
    path in the call's arguments, `ARGUMENTS`) after every compiled call. In the templates, the
    argument containers and the argument tensors stand for the current call's (`arguments`), so
    unchanged items keep their identity; new tensors are the trace's results. The cache key
    holds the arguments' tree structure (each list's length, each dict's keys), so a container
    that changed shape compiles anew. Refused where the copies cannot
    behave as eager's one object: a changed container passed twice or also reachable from an
    object argument (a store through one would show in the other), one the function also
    returns (eager returns the very object), a subclass of list or dict (HF's `ModelOutput`
    keeps attributes beside its items), and a store of a traced Python number (a symbolic
    size). Such a call runs eagerly (`ContainerStoreRefused`), where eager's stores are made.
    """

    def __init__(self, copies: Any, real: Any) -> None:
        self.found: list[tuple[tuple, Any, Any]] = []  # (steps, seen, snapshot)
        self._visit(copies, ())
        counts: dict[int, int] = {}
        for steps, _, _ in self.found:
            counts[id(follow(real, steps))] = counts.get(id(follow(real, steps)), 0) + 1
        self._real_ids = {steps: id(follow(real, steps)) for steps, _, _ in self.found}
        self._counts = counts

    def _visit(self, value: Any, steps: tuple) -> None:
        if isinstance(value, (list, dict)):
            self.found.append((steps, value, snapshot(value)))
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                self._visit(item, (*steps, ("item", index)))
        elif isinstance(value, dict):
            for key, item in value.items():
                self._visit(item, (*steps, ("key", key)))

    def changed(self) -> list[tuple[tuple, Any]]:
        """`(steps, seen)` of each container the traced code changed."""
        return [(steps, seen) for steps, seen, saved in self.found if not unchanged(seen, saved)]

    def record(self, epilogue: Epilogue, output: Any, input_paths: list) -> None:
        """Add a store to `epilogue` for each changed container (see the note); `input_paths`
        holds `(proxy, pytree key path)` of the call's tensor leaves.

        Raises:
            ContainerStoreRefused: in the refused cases of the note.
        """
        for proxy, key_path in input_paths:  # stored as themselves (`self.last = x`)
            steps = _steps(key_path)
            if steps is not None:
                epilogue.arguments.setdefault(id(proxy), steps)
                epilogue.keep.append(proxy)
        changed = self.changed()
        if not changed:
            return
        returned = {id(value) for _, value in walk(output)} | {id(output)}
        for steps, seen in changed:
            where = "arguments" + path_text(steps)
            real_id = self._real_ids[steps]
            if self._counts[real_id] > 1 or real_id in epilogue.existing:
                raise ContainerStoreRefused(
                    f"the function changes the list or dict passed as {where}, which is also "
                    "passed elsewhere in the arguments", op="list/dict argument",
                    hint="pass it once, or return the new value instead")
            if type(seen) not in (list, dict):  # a subclass may keep more than its items
                raise ContainerStoreRefused(
                    f"the function changes the {type(seen).__qualname__} passed as {where}",
                    op="list/dict argument", hint="return the new value instead")
            if id(seen) in returned:
                raise ContainerStoreRefused(
                    f"the function changes the list or dict passed as {where} and returns it",
                    op="list/dict argument", hint="return a new list, or only change it")
            template = list(seen) if isinstance(seen, list) else dict(seen)
            if any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))
                   for _, v in walk(template)):
                raise ContainerStoreRefused(
                    f"the function stores a traced size into the list or dict passed as {where}",
                    op="list/dict argument", hint="store int(size), or return it")
            epilogue.stores.append((ARGUMENTS, steps, None, template))
        for steps, seen, _ in self.found:
            epilogue.arguments[id(seen)] = steps
            epilogue.keep.append(seen)

    def restore(self) -> list[str]:
        """Put the copies back as they were; return where each changed one was passed."""
        changed = ["arguments" + path_text(steps) for steps, _ in self.changed()]
        for _, seen, saved in self.found:
            restore(seen, saved)
        return changed
