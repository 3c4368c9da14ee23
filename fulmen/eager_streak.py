"""Calls that keep running eagerly for one reason stop paying for a trace each time.

A call that misses the cache is traced; a trace that finds something a compiled program
cannot do (`RunsEagerly`: `loss.backward()` inside the function, a store the program could
not repeat) runs the call eagerly, and the key is remembered so the same call runs eagerly at
once (`_Jitted._eager_keys`). Where the key changes on every call, as in a training step
jitted whole, whose optimizer's learning rate a scheduler changes each step, every call would
trace again only to run eagerly: about as long as the step itself.

`EagerStreak` notices misses that ended eagerly for the same reason in a row: from the second
one on, misses run eagerly without tracing, and only every 4th, 8th, 16th, ... such miss is
traced again (the code may take another path by then). Running the user's code eagerly is
always right, so this changes only how often a trace is attempted; a compiled call ends the
streak.
"""

from __future__ import annotations

_START = 2  # misses in a row with one reason before tracing is skipped
_MAX_EXPONENT = 10  # a trace attempted at least every 1024 skipped misses


class EagerStreak:
    """Misses in a row that ran eagerly for one reason (`reason`: the kind and the warning,
    which names the user's line)."""

    def __init__(self) -> None:
        self.reason: tuple[str, str] | None = None
        self.count = 0
        self.skipped = 0

    def ran_eagerly(self, reason: tuple[str, str]) -> None:
        """A miss was traced and ran eagerly because of `reason`."""
        if reason == self.reason:
            self.count = min(self.count + 1, _MAX_EXPONENT)
        else:
            self.reason, self.count = reason, 1
        self.skipped = 0

    def end(self) -> None:
        """A miss compiled, or the compiled entries were dropped: the streak ends."""
        self.reason, self.count, self.skipped = None, 0, 0

    def skip_trace(self) -> bool:
        """Whether this miss should run eagerly for `reason` without being traced."""
        if self.count < _START:
            return False
        self.skipped += 1
        return self.skipped < 2 ** self.count
