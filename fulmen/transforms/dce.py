"""Dead code elimination."""

from __future__ import annotations

from fulmen.core import BoundSymbol, Trace
from fulmen.core.proxy import Proxy, iter_proxies
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


def free_values(bsyms, outputs, given) -> tuple[Proxy, ...]:
    """The values `bsyms` and `outputs` read that no statement of `bsyms` defines and that are
    not among the proxies `given`, in order of first use: what a backward needs from its
    forward (its residuals), the cotangents being `given`."""
    defined = {name for bsym in bsyms for name in bsym.output_names}
    defined |= {proxy.name for proxy in iter_proxies(given)}
    free: dict[str, Proxy] = {}
    for proxy in [p for bsym in bsyms for p in bsym.proxy_inputs] + list(iter_proxies(outputs)):
        if proxy.name not in defined:
            free.setdefault(proxy.name, proxy)
    return tuple(free.values())


@transform("dead code elimination")
def dce(trace: Trace) -> Trace:
    """Remove bound symbols whose outputs are never used (side-effecting ones are kept).

    Example: in `t0 = ltorch.exp(x); t1 = ltorch.sin(x); return t1`, the `exp` line goes.
    """
    kept = live_bsyms(trace.bsyms, trace.output)
    if len(kept) == len(trace.bsyms):
        return trace
    return trace.replace(bsyms=kept)
