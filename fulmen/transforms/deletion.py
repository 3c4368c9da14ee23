"""Delete-last-used: free each tensor right after the statement that reads it last."""

from __future__ import annotations

from fulmen.core import BoundSymbol, Trace
from fulmen.core.symbol import DEL
from fulmen.transforms.base import transform


@transform("delete last used")
def delete_last_used(trace: Trace) -> Trace:
    """Insert `del a, b` after the last statement that reads `a` and `b`.

    Inputs and intermediates are deleted; the trace's outputs are not. Inputs that are never
    read are deleted at the top, so the trace holds no reference it does not need.
    """
    keep = set(trace.output_names)
    seen: set[str] = set(keep)
    to_delete: list[list] = []
    for bsym in reversed(trace.bsyms):
        last_uses = []
        for proxy in [*bsym.proxy_inputs, *bsym.proxy_outputs]:
            if proxy.name not in seen:
                seen.add(proxy.name)
                last_uses.append(proxy)
        to_delete.append(last_uses)
    to_delete.reverse()
    unused_inputs = [proxy for proxy in trace.args if proxy.name not in seen]

    bsyms: list[BoundSymbol] = []
    if unused_inputs:
        bsyms.append(BoundSymbol(DEL, tuple(unused_inputs)))
    for bsym, dead in zip(trace.bsyms, to_delete):
        bsyms.append(bsym)
        if dead:
            bsyms.append(BoundSymbol(DEL, tuple(dead), source=bsym.source))
    return trace.replace(bsyms=tuple(bsyms))
