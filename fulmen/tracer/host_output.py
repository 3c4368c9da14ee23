"""Text the traced code prints while tracing (`print(...)`, `sys.stdout.write`).

A compiled call runs no Python, so a debugging `print(x.shape, x)` in a model's forward would
print once, while tracing, with each traced tensor as its placeholder
(`<TensorProxy t0: "cpu f32[4, 2]">`), and nothing on the calls served from the cache; eager
prints on every call, with values. `catch_prints` puts a catcher in place of `sys.stdout` while
tracing: it keeps back what the tracing thread writes (other threads' writes pass through). A
trace that wrote is refused (`PrintsInTrace`, which `fulmen.jit` answers by running such calls
eagerly) and its text dropped, so the eager call prints it, once, with values. Logging and
warnings write to their own streams and are left alone.
"""

from __future__ import annotations

import contextlib
import sys
import threading

from fulmen.core import RunsEagerly


class PrintsInTrace(RunsEagerly):
    """The traced code printed to `sys.stdout`."""


class _Catcher:
    """Stands for `stream` while one thread traces: that thread's writes are noted and kept
    back, every other thread's pass through."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._thread = threading.get_ident()
        self.wrote = False

    def write(self, text: str) -> int:
        """Keep back the tracing thread's `text`; pass another thread's through."""
        if threading.get_ident() != self._thread:
            return self._stream.write(text)
        self.wrote = self.wrote or bool(text)
        return len(text)

    def flush(self) -> None:
        """Flush the stream for other threads (the tracing thread's text is kept back)."""
        if threading.get_ident() != self._thread:
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def refuse_writes(self) -> None:
        """Raise `PrintsInTrace` if the tracing thread wrote.

        Raises:
            PrintsInTrace: the traced code printed.
        """
        if self.wrote:
            raise PrintsInTrace(
                "the function prints (print(), sys.stdout.write); a compiled call would print "
                "only while tracing, with traced tensors as placeholders", op="print",
                hint="print outside the compiled function (return what to print), or log "
                "with the logging module")


@contextlib.contextmanager
def catch_prints():
    """`sys.stdout` replaced by a `_Catcher` while the block traces; yields the catcher."""
    stream = sys.stdout
    catcher = _Catcher(stream)
    sys.stdout = catcher
    try:
        yield catcher
    finally:
        if sys.stdout is catcher:  # (code that replaced it meanwhile keeps its own)
            sys.stdout = stream
