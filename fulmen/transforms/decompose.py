"""Decompose torch-level ops into their prims."""

from __future__ import annotations

from fulmen.core import Trace, flatten
from fulmen.transforms.base import transform


@transform("decomposition into prims")
def decompose_to_prims(trace: Trace) -> Trace:
    """Replace every torch-level op by its prim decomposition (opaque ops stay as they are).

    Useful to check decompositions (the result runs prims only) and as input to fusion.
    """
    bsyms = [flat for bsym in trace.bsyms for flat in flatten(bsym)]
    if len(bsyms) == len(trace.bsyms) and all(a is b for a, b in zip(bsyms, trace.bsyms)):
        return trace
    return trace.replace(bsyms=tuple(bsyms))
