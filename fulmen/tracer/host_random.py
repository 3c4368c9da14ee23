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

import torch
from torch.utils import _pytree as pytree

from fulmen.core import RunsEagerly


class HostRandomness(RunsEagerly):
    """The traced code drew from Python's or NumPy's global random generator."""


class HostRandomState:
    """The states of Python's `random` and (when imported) NumPy's global generator, taken
    before tracing; the trace runs from sentinel states (one draw further), so that code that
    seeds a generator and draws (HF BigBird's `np.random.seed(...)` on every call) is seen even
    when it ends where the generator already was (right after an eager call did the same)."""

    def __init__(self) -> None:
        self._python = random.getstate()
        random.random()
        self._python_sentinel = random.getstate()
        numpy = sys.modules.get("numpy")
        self._numpy = self._numpy_sentinel = None
        if numpy is not None:
            self._numpy = numpy.random.get_state()
            numpy.random.random()
            self._numpy_sentinel = numpy.random.get_state()

    def drawn(self) -> bool:
        """Whether either generator moved from its sentinel state."""
        if random.getstate() != self._python_sentinel:
            return True
        if self._numpy is None:
            return False
        now, then = sys.modules["numpy"].random.get_state(), self._numpy_sentinel
        return now[2:] != then[2:] or not (now[1] == then[1]).all()

    def restore(self) -> None:
        """Put both generators back as they were before tracing."""
        random.setstate(self._python)
        if self._numpy is not None:
            sys.modules["numpy"].random.set_state(self._numpy)

    def refuse_draws(self) -> None:
        """Put the generators back; raise `HostRandomness` if the code drew.

        Raises:
            HostRandomness: the traced code drew from `random` or `numpy.random`.
        """
        drawn = self.drawn()
        self.restore()
        if drawn:
            raise HostRandomness(
                "the function draws from Python's or NumPy's random generator (random.random(), "
                "np.random...); a compiled call would repeat the numbers drawn while tracing",
                op="random", hint="draw with torch (torch.rand, torch.randint), whose random ops "
                "fulmen compiles")


def _is_global(generator: torch.Generator) -> bool:
    """Whether `generator` is torch's global generator of its device (what eager draws from
    when no generator is given)."""
    cuda = torch.cuda.default_generators if torch.cuda.is_initialized() else ()
    return generator is torch.default_generator or any(generator is g for g in cuda)


def refuse_private_generators(trace, arguments) -> None:
    """Raise `HostRandomness` if a random op of `trace` draws from a `torch.Generator` that is
    neither torch's global one nor among `arguments` (the call's `(args, kwargs)`).

    Such a generator was created inside the function (`torch.Generator().manual_seed(0)`, a
    fresh, seeded generator on every eager call) or read from a global or an attribute: the
    compiled program would hold the one object seen while tracing and keep drawing from it, so
    the call runs eagerly instead. A generator passed as an argument is keyed by identity and
    drawn from at run time.

    Raises:
        HostRandomness: naming the op and the user's line.
    """
    passed = {id(leaf) for leaf in pytree.tree_leaves(arguments)
              if isinstance(leaf, torch.Generator)}
    for bsym in trace.bsyms:
        generator = bsym.kwargs.get("generator") if bsym.kwargs else None
        if (isinstance(generator, torch.Generator) and id(generator) not in passed
                and not _is_global(generator)):
            raise HostRandomness(
                "the function draws from a torch.Generator that is not one of its arguments "
                "(made inside it, or read from a global or an attribute); a compiled call would "
                "keep drawing from the generator seen while tracing",
                op=bsym.sym.name, where=bsym.source,
                hint="pass the generator as an argument (then the call is compiled)")
