"""Reseeding torch's generator inside a traced function is caught where it happens.

A compiled function does not repeat `torch.manual_seed(...)` on later calls, so a function that
seeds (or sets the generator state) cannot be compiled faithfully. `install()` wraps torch's
Python entry points for that (`torch.manual_seed`, `torch.seed`, `torch.set_rng_state` and their
`torch.random` spellings) once: outside tracing they behave exactly as before; called while this
thread records a trace they raise `SeedsInside` naming the user's line (the call runs eagerly).
Other threads keep drawing and seeding freely (the check is per thread, unlike comparing the
generator state before and after tracing, which another thread's draws would trip).
"""

from __future__ import annotations

import functools

import torch

from fulmen.core import RunsEagerly, get_tracectx
from fulmen.core.source import user_source_location

_ENTRY_POINTS = ("manual_seed", "seed", "set_rng_state")


class SeedsInside(RunsEagerly):
    """The traced function sets torch's random state (`torch.manual_seed` inside): a compiled
    call would not repeat that, so the call runs eagerly."""


def seeds_inside(op: str, where=None) -> SeedsInside:
    """The error for reseeding torch's generator while tracing (`op` names the entry point)."""
    return SeedsInside(
        "the function sets torch's random state (torch.manual_seed, set_rng_state, ...) while "
        "it runs; a compiled function would not repeat that on later calls", op=op, where=where,
        hint="seed outside the compiled function")


_installed = False


def _refusing(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if get_tracectx() is not None:
            raise seeds_inside(f"torch.{name}", user_source_location())
        return fn(*args, **kwargs)

    wrapper.__fulmen_seed_guard__ = True
    return wrapper


def install() -> None:
    """Wrap the seeding entry points of `torch` and `torch.random` (idempotent)."""
    global _installed
    if _installed:
        return
    for module in (torch, torch.random):
        for name in _ENTRY_POINTS:
            fn = getattr(module, name, None)
            if fn is not None and not getattr(fn, "__fulmen_seed_guard__", False):
                setattr(module, name, _refusing(name, fn))
    _installed = True
