"""Attributes replaced while any trace records, put back when the last recording ends.

Some calls reach no `TorchFunctionMode` (`torch.autograd.Function.apply`, `torch.from_numpy`),
so the tracer replaces the attribute that user code calls. A `TracingPatch` makes the
replacement when the first `held()` block starts, in any thread, and puts the original back
when the last one ends: nested and concurrent traces share one replacement. The replacements
run for every caller while the patch is held, so each must answer as the original where no
trace of its own records (the callers keep that state: `autograd_function`, `call_constants`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class TracingPatch:
    """`setattr(owner, name, replacement)` for each `(owner, name, replacement)` while at least
    one `held()` block is active; `originals[i]` is the i-th attribute's own value (read from
    the owner's `__dict__`, so a classmethod stays one), put back when the last block ends."""

    def __init__(self, *patches: tuple[object, str, object]) -> None:
        self._patches = patches
        self.originals = tuple(vars(owner)[name] for owner, name, _ in patches)
        self._lock = threading.Lock()
        self._holders = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The replacements stay in place for the duration of the block."""
        with self._lock:
            if self._holders == 0:
                for owner, name, replacement in self._patches:
                    setattr(owner, name, replacement)
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    for (owner, name, _), original in zip(self._patches, self.originals):
                        setattr(owner, name, original)


__all__ = ["TracingPatch"]
