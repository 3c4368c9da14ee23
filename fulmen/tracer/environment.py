"""Environment variables the traced code reads: recorded while tracing, keyed from then on.

NOTE [environment reads]: traced code runs real Python, so `if os.environ.get("USE_X")`
(also `os.getenv`, `"X" in os.environ`, `os.environ["X"]`) is answered once, at trace time,
and the branch is baked into the trace. While the tracer runs the user's code,
`os.environ`'s class is swapped for a subclass that records, for the tracing thread only, the
names looked up (every lookup goes through `__getitem__`); reading the whole environment
(iterating it, `dict(os.environ)`, `.copy()`) records `WHOLE`. Lookups made by fulmen's own
modules (`fulmen.config`) and by modules imported while tracing (at import time, once) are
not the program's and are not recorded. The cache key then
covers those variables' values (`CacheKeyBuilder.watch_environment`), as torch.compile guards
each variable a compiled frame read, so setting one between calls retraces. The class is put
back when the last concurrent trace ends; other threads see the same mapping meanwhile.
A program that sets or deletes a variable is not compiled (a compiled call would not repeat
the write): the trace's writes are undone and the call runs eagerly (`RunsEagerly`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator

from fulmen.core.source import SourceLocation, user_source_location

WHOLE = "*"  # the whole environment was read: keyed by all its items
_Environ = type(os.environ)
_getenv = os.environ.get
_local = threading.local()
_lock = threading.Lock()
_active = 0  # traces recording at once (the class is swapped while > 0)
_PASS_THROUGH = ("os", "_collections_abc", "contextlib")  # modules whose lookups are a caller's


def _programs(access) -> bool:
    """Whether the environment access being made (by this thread, while tracing) is the traced
    program's: not fulmen's own, nor a module's being imported."""
    if access is None:
        return False
    frame = sys._getframe(3)
    while frame is not None and frame.f_globals.get("__name__") in _PASS_THROUGH:
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    if module == "fulmen" or module.startswith("fulmen."):
        return False  # fulmen's own (`fulmen.config`)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("importlib."):
            return False  # a module imported while tracing (sympy's settings): once, at import
        frame = frame.f_back
    return True


def _record(name: str) -> None:
    access = getattr(_local, "access", None)
    if _programs(access):
        access.reads.add(name)


def _record_write(name: str) -> None:
    access = getattr(_local, "access", None)
    if _programs(access) and name not in access.writes:
        access.writes[name] = (_Environ.get(os.environ, name), user_source_location(3))


class EnvironmentAccess:
    """What a traced program did to the environment: `reads`, the names it looked up (`WHOLE`:
    all of them); `writes`, name -> (its value before the first write, the user's line)."""

    def __init__(self) -> None:
        self.reads: set[str] = set()
        self.writes: dict[str, tuple[str | None, SourceLocation | None]] = {}

    def undo_writes(self) -> None:
        """Put back the values the program's writes replaced."""
        for name, (value, _) in self.writes.items():
            if value is None:
                _Environ.pop(os.environ, name, None)
            else:
                _Environ.__setitem__(os.environ, name, value)


class _RecordingEnviron(_Environ):
    """`os.environ` while tracing: records what the tracing thread's program reads and sets."""

    def __getitem__(self, key):
        _record(key)
        return _Environ.__getitem__(self, key)

    def __iter__(self):
        _record(WHOLE)
        return _Environ.__iter__(self)

    def __setitem__(self, key, value):
        _record_write(key)
        _Environ.__setitem__(self, key, value)

    def __delitem__(self, key):
        _record_write(key)
        _Environ.__delitem__(self, key)


def environment_items() -> tuple:
    """All of the environment's `(name, value)` pairs, sorted (the key of `WHOLE`)."""
    return tuple(sorted(os.environ.items()))


def environment_source(name: str) -> tuple[str, Callable[[], object]]:
    """The cache-key source (`(label, read)`, as `scalar_sources`) of the variable `name`
    (`WHOLE`: of the whole environment)."""
    if name == WHOLE:
        return "os.environ", environment_items
    return f"os.environ[{name!r}]", functools.partial(_getenv, name)


@contextlib.contextmanager
def environment_recorded() -> Iterator[EnvironmentAccess]:
    """While active, what this thread's code reads from and writes to the environment is
    recorded in the `EnvironmentAccess` it yields (NOTE [environment reads]); on exit the
    program's writes are undone (a compiled call would not repeat them: the caller runs the
    call eagerly, which makes them again)."""
    global _active
    outer = getattr(_local, "access", None)
    access = EnvironmentAccess()
    with _lock:
        _active += 1
        if _active == 1:
            os.environ.__class__ = _RecordingEnviron
    _local.access = access
    try:
        yield access
    finally:
        _local.access = outer
        access.undo_writes()
        if WHOLE in access.reads:  # (the names it looked up are among the items)
            access.reads.intersection_update((WHOLE,))
        if outer is not None:  # a trace inside a trace: the outer program did it too
            outer.reads |= access.reads
            for name, write in access.writes.items():
                outer.writes.setdefault(name, write)
        with _lock:
            _active -= 1
            if _active == 0:
                os.environ.__class__ = _Environ


@contextlib.contextmanager
def environment_unrecorded() -> Iterator[None]:
    """While active, this thread's environment reads are not the traced program's (fulmen
    making a symbol: PyTorch's ShapeEnv reads its settings from the environment each time)."""
    outer = getattr(_local, "access", None)
    _local.access = None
    try:
        yield
    finally:
        _local.access = outer


__all__ = ["WHOLE", "EnvironmentAccess", "environment_items", "environment_recorded",
           "environment_unrecorded",
           "environment_source"]
