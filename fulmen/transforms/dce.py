"""Dead code elimination."""

from __future__ import annotations

from fulmen.core import BoundSymbol, Trace
from fulmen.core.proxy import iter_proxies
from fulmen.transforms.base import transform


def live_bsyms(bsyms, outputs) -> tuple[BoundSymbol, ...]:
    """The statements of `bsyms` that `outputs` (or a side effect) need, in order."""
    live = {proxy.name for proxy in iter_proxies(outputs)}
    kept = []
    for bsym in reversed(bsyms):
        if bsym.has_side_effects or live & bsym.output_names:
            kept.append(bsym)
            live |= bsym.input_names
    return tuple(reversed(kept))


@transform("dead code elimination")
def dce(trace: Trace) -> Trace:
    """Remove bound symbols whose outputs are never used (side-effecting ones are kept).

    Example: in `t0 = ltorch.exp(x); t1 = ltorch.sin(x); return t1`, the `exp` line goes.
    """
    kept = live_bsyms(trace.bsyms, trace.output)
    if len(kept) == len(trace.bsyms):
        return trace
    return trace.replace(bsyms=kept)
