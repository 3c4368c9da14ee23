"""Graph-break guards: the statement a trace records where Python needed a tensor's value.

When traced code asks a question only real values answer (`if mask.all():`, `n = t.item()`,
`x[mask]`), the tracer computes the real answer, hands it to the Python code and records

    # graph break: bool(t17) at model.py:12  if mask.all():
    breaks.guard('bool(t17)', _c0, True, t17)

where `_c0` is `torch.Tensor.__bool__`. `guard(question, fn, expected, *args, **kwargs)` evaluates `fn(*args, **kwargs)` on the run's real values
and raises `BranchMiss` when the answer differs from the one the rest of the trace was recorded
under. The compiled program is split after each guard into segments (`fulmen.transforms.
segments`); the runtime evaluates the guard between segments and picks the continuation recorded
for the answer (`fulmen.tree`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fulmen.core import FulmenError, Symbol
from fulmen.core.printer import GRAPH_BREAK_TAG
from fulmen.core.symbol import Namespace

BREAKS = Namespace("breaks", "fulmen.ops.breaks", "from fulmen.ops import breaks")


class BranchMiss(FulmenError):
    """A guard saw an answer the compiled path was not recorded for (the runtime retraces)."""

    def __init__(self, answer: Any, expected: Any) -> None:
        super().__init__(f"guard answered {answer!r}, the path was recorded for {expected!r}",
                         op="graph break")
        self.answer = answer


def answer_key(value: Any) -> Any:
    """A hashable key for a guard's answer that tells apart every answer Python can tell apart:
    `True` from `1`, `0.0` from `-0.0`, NaN equal to NaN, lists by content, arrays by bytes."""
    if isinstance(value, float):
        return (float, "nan" if math.isnan(value) else value.hex())
    if isinstance(value, complex):
        return (complex, answer_key(value.real), answer_key(value.imag))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(answer_key(item) for item in value))
    if isinstance(value, torch.Size):
        return (tuple, tuple(value))
    if hasattr(value, "tobytes") and hasattr(value, "dtype"):  # numpy arrays and scalars
        return (type(value), str(value.dtype), getattr(value, "shape", ()), value.tobytes())
    return (type(value), value)


def output_shapes(*tensors: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """The shapes of `tensors` (the answer of a data-dependent output shape)."""
    return tuple(tuple(t.shape) for t in tensors)


def guard(question: str, fn, expected: Any, *args, **kwargs) -> None:
    """Raise `BranchMiss` unless `fn(*args, **kwargs)` answers `expected`; `question` is how
    the break is named in printed traces and logs (`bool(t17)`).

    Raises:
        BranchMiss: carrying the new answer.
    """
    answer = fn(*args, **kwargs)
    if answer_key(answer) != answer_key(expected):
        raise BranchMiss(answer, expected)


def _guard_meta(question, fn, expected, *args, **kwargs) -> None:
    return None


GUARD = Symbol("guard", _guard_meta, namespace=BREAKS, impl=guard,
               tags={"side_effect", GRAPH_BREAK_TAG})
