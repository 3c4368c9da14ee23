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
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator

WHOLE = "*"  # the whole environment was read: keyed by all its items
_Environ = type(os.environ)
_getenv = os.environ.get
_local = threading.local()
_lock = threading.Lock()
_active = 0  # traces recording at once (the class is swapped while > 0)
_PASS_THROUGH = ("os", "_collections_abc", "contextlib")  # modules whose lookups are a caller's


def _record(name: str) -> None:
    reads = getattr(_local, "reads", None)
    if reads is None:
        return
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in _PASS_THROUGH:
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    if module == "fulmen" or module.startswith("fulmen."):
        return  # fulmen's own (`fulmen.config`)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("importlib."):
            return  # a module imported while tracing (sympy's settings): read once, at import
        frame = frame.f_back
    reads.add(name)


class _RecordingEnviron(_Environ):
    """`os.environ` while tracing: records the names the tracing thread looks up."""

    def __getitem__(self, key):
        _record(key)
        return _Environ.__getitem__(self, key)

    def __iter__(self):
        _record(WHOLE)
        return _Environ.__iter__(self)


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
def environment_reads_recorded() -> Iterator[set[str]]:
    """While active, the names of the environment variables this thread's code looks up are
    added to the set it yields (NOTE [environment reads])."""
    global _active
    outer = getattr(_local, "reads", None)
    reads: set[str] = set()
    with _lock:
        _active += 1
        if _active == 1:
            os.environ.__class__ = _RecordingEnviron
    _local.reads = reads
    try:
        yield reads
    finally:
        if WHOLE in reads:  # (the names it looked up are among the items)
            reads.intersection_update((WHOLE,))
        _local.reads = outer
        if outer is not None:  # a trace inside a trace: the outer program read them too
            outer |= reads
        with _lock:
            _active -= 1
            if _active == 0:
                os.environ.__class__ = _Environ


__all__ = ["WHOLE", "environment_items", "environment_reads_recorded", "environment_source"]
