"""The `transform` decorator: names a pass, times it, and records provenance.

A pass is a pure function `Trace -> Trace`. The decorator stamps the returned trace with
`provenance` ("after <name>") and the seconds the pass took, and runs `check_trace` on it
(set `FULMEN_CHECK=0` to skip verification). The pass body only transforms; a pass that
returns its input unchanged produces no new stage.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

from fulmen.core import Trace, check_trace

CHECK_TRACES = os.environ.get("FULMEN_CHECK", "1") != "0"


def transform(name: str) -> Callable[[Callable[..., Trace]], Callable[..., Trace]]:
    """Decorate a pass `fn(trace, ...) -> Trace`.

    Example:
        @transform("dead code elimination")
        def dce(trace): ...
    """

    def decorate(fn: Callable[..., Trace]) -> Callable[..., Trace]:
        @functools.wraps(fn)
        def run(trace: Trace, *args, **kwargs) -> Trace:
            start = time.perf_counter()
            result = fn(trace, *args, **kwargs)
            if result is trace:
                return trace
            seconds = time.perf_counter() - start
            result = result.replace(provenance=f"after {name}", seconds=seconds)
            if CHECK_TRACES:
                check_trace(result)
            return result

        run.pass_name = name
        return run

    return decorate
