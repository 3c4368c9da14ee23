"""How many compiled entries a jitted callable keeps before further calls run eagerly.

NOTE [cache limits per call structure]
A jitted function is called with calls of several structures: HF `generate` calls the forward
without a cache (prefill) and with one (decoding), with and without an attention mask, a
sliding-window cache before and after it fills. Each structure needs entries of its own, a few
each (a batch size, a branch of HF's masking code), and one limit over all of them (8, as
torch.compile's per code object) was spent by the structures themselves: a `generate` at a new
batch size after a few prompt lengths ran its calls eagerly, though no guard kept failing.

The limit the user sets (`cache_size_limit`, `FULMEN_CACHE_SIZE_LIMIT`) is therefore counted per
call structure: the paths of the argument tree with each leaf's type, and for an object argument
(an HF cache) the paths of the tensors and numbers it holds, without sizes, values or the lengths
of lists and tuples (`layers[0].keys` and `layers[1].keys` are one path; a list that grows at
every call is one structure, whose entries the limit bounds). A guard that
keeps failing (a size or number that changes at every call without becoming symbolic, a dtype
alternating) makes entries of one structure and reaches the limit as before; the warning names
the guard that failed most often between calls of that structure. An overall cap
(`FULMEN_ACCUMULATED_CACHE_SIZE_LIMIT`, default 64; torch.compile's
`accumulated_recompile_limit` is 256) bounds the entries of all structures together (each holds
its traces and compiled code, about 1 MiB for a 2-layer model). Entries dropped since
(`_drop_subsumed`) no longer count.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen import config
from fulmen.tracer.explain import explain_change
from fulmen.tracer.objects import is_plain_object, walk

_NUMBERS = (int, float, bool)


def call_structure(args: tuple, kwargs: dict) -> frozenset:
    """What a call's structure is made of: the paths of the argument tree with each leaf's type,
    and the paths of the tensors and numbers inside object arguments; no size, dtype or value,
    and no list or tuple length (a list that grows at every call keeps its structure, and the
    limit bounds its entries as it bounds a size that keeps changing)."""
    parts = set()
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
        # (args or kwargs, and the position of a positional argument, kept)
        path = (*path[:2], *map(_step, path[2:]))
        if is_plain_object(leaf):
            parts.add((path, type(leaf)))
            parts.update((path, *(_held_step(step) for step in steps)) for steps, value
                         in walk(leaf)
                         if isinstance(value, torch.Tensor) or type(value) in _NUMBERS)
        else:
            parts.add((path, torch.Tensor if isinstance(leaf, torch.Tensor) else type(leaf)))
    return frozenset(parts)


def _step(key) -> Any:
    """A step of a pytree path, list and tuple positions left out."""
    if isinstance(key, pytree.SequenceKey):
        return "[]"
    if isinstance(key, pytree.MappingKey):
        return ("key", key.key)
    return str(key)


def _held_step(step: tuple) -> tuple:
    """A step of `walk`'s paths, list and tuple positions left out."""
    return ("item",) if step[0] == "item" else step


def _subject(reason: str) -> str:
    """`x.shape` of `'x.shape changed from (4,) to (5,)'` (or `... is new` / `... is gone`)."""
    for marker in (" changed from ", " is new (", " is gone ("):
        if marker in reason:
            return reason.split(marker, 1)[0]
    return reason


class CacheLimits:
    """The entries a jitted callable may hold: `per_structure` for each call structure, and
    `accumulated` over all (NOTE [cache limits per call structure]).

    `missed(args, kwargs, described)` is told of every miss (with the described call of
    `fulmen.tracer.explain`), `over_limit(entries)` answers whether the miss may compile and
    `compiled(entry)` marks the entry it made with its structure.
    """

    def __init__(self, per_structure: int, accumulated: int | None = None) -> None:
        self.per_structure = per_structure
        if accumulated is None:
            accumulated = config.get("FULMEN_ACCUMULATED_CACHE_SIZE_LIMIT")
        self.accumulated = max(accumulated, per_structure)
        self._ids: dict[tuple, int] = {}  # call structure -> a small number
        self._last: dict[int, dict] = {}  # structure -> the described call of its last miss
        self._failed: dict[int, Counter] = {}  # structure -> guard -> misses it failed
        self._current = -1  # the structure of the last miss
        self._reasons: list[str] = []  # its reasons, against the last miss of that structure

    def missed(self, args: tuple, kwargs: dict, described: dict) -> None:
        """Note a miss of the call `(args, kwargs)`, described as `described`."""
        structure = self._ids.setdefault(call_structure(args, kwargs), len(self._ids))
        last = self._last.get(structure)
        self._reasons = explain_change(last, described) if last is not None else []
        self._failed.setdefault(structure, Counter()).update(map(_subject, self._reasons))
        self._last[structure] = described
        self._current = structure

    def compiled(self, entry) -> None:
        """Mark `entry`, compiled for the last miss, with that miss's structure."""
        entry.structure = self._current

    def over_limit(self, entries) -> tuple[str, str] | None:
        """None if the last miss may compile beside `entries` (every entry held, of any
        structure), else `(kind, warning)`: it runs eagerly."""
        entries = list(entries)
        if len(entries) >= self.accumulated:
            return "accumulated_cache_size_limit", (
                f"has been compiled for {len(entries)} different calls of all structures "
                "together (FULMEN_ACCUMULATED_CACHE_SIZE_LIMIT); calls matching none of them "
                "run eagerly")
        same = sum(entry.structure == self._current for entry in entries)
        if same < self.per_structure:
            return None
        failed = self._failed.get(self._current, Counter()).most_common(1)
        guard = (f"the guard that kept failing is {failed[0][0]} ({failed[0][1]} retraces); "
                 if failed else "")
        last = f"the last retrace was because {'; '.join(self._reasons)}. " \
            if self._reasons else ""
        return f"cache_size_limit {self._current}", (
            f"has been compiled for {same} different calls of one structure "
            f"(cache_size_limit); calls of it matching none of them run eagerly: {guard}{last}"
            "Raise the limit with fulmen.jit(..., cache_size_limit=N) or "
            "FULMEN_CACHE_SIZE_LIMIT, or keep that value fixed between calls")


__all__ = ["CacheLimits", "call_structure"]
