"""Dead code elimination."""

from __future__ import annotations

from fulmen.core import Trace
from fulmen.transforms.base import transform


@transform("dead code elimination")
def dce(trace: Trace) -> Trace:
    """Remove bound symbols whose outputs are never used (side-effecting ones are kept).

    Example: in `t0 = ltorch.exp(x); t1 = ltorch.sin(x); return t1`, the `exp` line goes.
    """
    live = set(trace.output_names)
    kept = []
    for bsym in reversed(trace.bsyms):
        if bsym.has_side_effects or live & bsym.output_names:
            kept.append(bsym)
            live |= bsym.input_names
    if len(kept) == len(trace.bsyms):
        return trace
    return trace.replace(bsyms=tuple(reversed(kept)))
