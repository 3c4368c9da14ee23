"""Draws from Python's and NumPy's global random generators while tracing.

A compiled call runs no Python, so a number drawn from `random` or `numpy.random` while tracing
(HF wav2vec2's LayerDrop `np.random.random()`, SpecAugment's masks, `if random.random() < p:`
for stochastic depth) would be baked into every later call: each step would drop the same
layers. `HostRandomState` takes both generators' states before tracing; a trace that changed
them drew, and its program is refused (`HostRandomness`, which `fulmen.jit` answers by running
such calls eagerly) after the states are put back, so the eager call draws what it would have.
(Another thread drawing meanwhile makes a call run eagerly too: slower, never wrong.) torch's own
generator is traced (random ops are statements of the trace).
"""

from __future__ import annotations

import random
import sys

from fulmen.core import NotYetSupportedError


class HostRandomness(NotYetSupportedError):
    """The traced code drew from Python's or NumPy's global random generator."""


class HostRandomState:
    """The states of Python's `random` and (when imported) NumPy's global generator."""

    def __init__(self) -> None:
        self._python = random.getstate()
        numpy = sys.modules.get("numpy")
        self._numpy = numpy.random.get_state() if numpy is not None else None

    def drawn(self) -> bool:
        """Whether either generator moved since the states were taken."""
        if random.getstate() != self._python:
            return True
        if self._numpy is None:
            return False
        now = sys.modules["numpy"].random.get_state()
        return now[2:] != self._numpy[2:] or not (now[1] == self._numpy[1]).all()

    def restore(self) -> None:
        """Put both generators back as they were."""
        random.setstate(self._python)
        if self._numpy is not None:
            sys.modules["numpy"].random.set_state(self._numpy)

    def refuse_draws(self) -> None:
        """Raise `HostRandomness` (after putting the generators back) if the code drew.

        Raises:
            HostRandomness: the traced code drew from `random` or `numpy.random`.
        """
        if self.drawn():
            self.restore()
            raise HostRandomness(
                "the function draws from Python's or NumPy's random generator (random.random(), "
                "np.random...); a compiled call would repeat the numbers drawn while tracing",
                op="random", hint="draw with torch (torch.rand, torch.randint), whose random ops "
                "fulmen compiles")
