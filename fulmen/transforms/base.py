"""The `transform` decorator: names a pass, times it, and records provenance.

A pass is a pure function `Trace -> Trace`. The decorator stamps the returned trace with
`provenance` ("after <name>") and the seconds the pass took, and runs `check_trace` on it:
by default the structural checks (SSA, def-before-use, metadata); `FULMEN_CHECK=1` also prints
and compiles every stage (the test suite sets it), `FULMEN_CHECK=0` skips verification. The pass body only transforms; a pass that
returns its input unchanged produces no new stage.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from fulmen import config
from fulmen.core import Trace, check_trace

CHECK_TRACES = config.get("FULMEN_CHECK") != "0"
CHECK_SOURCE = config.get("FULMEN_CHECK") == "1"  # print and compile every stage too


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
                check_trace(result, compile_source=CHECK_SOURCE)
            return result

        run.pass_name = name
        return run

    return decorate
