"""A process-wide setting switched on while any trace (in any thread) needs it.

`fulmen.tracer.int_answers` replaces the builtin `isinstance` and `fulmen.tracer.
compiled_callees` sets torch's compiler stance while tracing; both are process-wide, and traces
may overlap in several threads, so the setting goes on with the first trace and back with the
last (also after an error): `ProcessSwitch`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ProcessSwitch:
    """Context manager: `on()` when the first of overlapping `with` blocks enters, `off()`
    when the last leaves (also on an exception)."""

    def __init__(self, on: Callable[[], None], off: Callable[[], None]) -> None:
        self._on, self._off = on, off
        self._lock = threading.Lock()
        self._active = 0

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._on()
            self._active += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._off()


__all__ = ["ProcessSwitch"]
