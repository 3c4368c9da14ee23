"""`torch.compile` and fulmen in one program: each leaves the other's code alone.

Inside a fulmen trace, a function or module compiled by `torch.compile` (`fulmen.jit(torch.compile(
model))`, a `@torch.compile` helper the traced code calls) is traced as the plain Python it wraps:
`compiled_code_runs_eagerly()` sets torch's compiler stance to `force_eager` around the trace, so
Dynamo neither compiles nor runs its own machinery (which saves and restores torch's random state,
a store a trace cannot replay) under fulmen's proxies; the ops it runs are recorded like any other.

The other way round, Dynamo tracing a fulmen-compiled call (`torch.compile(fulmen.jit(model))`)
would inline fulmen's Python; `outside_dynamo(call, ...)` is the graph break it meets instead: the
call runs, compiled by fulmen, between Dynamo's graphs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback

from fulmen.tracer.process_switch import ProcessSwitch

_stance = []  # the `set_stance` object that puts back the stance found by the first trace


def _force_eager() -> None:
    _stance.append(torch.compiler.set_stance("force_eager"))


def _put_back() -> None:
    _stance.pop().__exit__(None, None, None)


_SWITCH = ProcessSwitch(_force_eager, _put_back)


@contextlib.contextmanager
def compiled_code_runs_eagerly() -> Iterator[None]:
    """Around a trace: `torch.compile`d callables run their Python eagerly (the stance is
    process-wide; it is put back when the last trace in any thread ends, also after an error).
    Inside an active Dynamo frame callback (a `torch._dynamo.optimize` context entered by hand)
    the stance cannot change; the trace then runs as it comes."""
    callback = get_eval_frame_callback()
    if "torch._dynamo" not in sys.modules or (callback is not None and callback is not False):
        yield  # no `torch.compile` yet (its import costs a second: never made here), or no
        return  # stance can change
    with _SWITCH:
        yield


def outside_dynamo(call, *args, **kwargs):
    """`call(*args, **kwargs)` as a graph break for Dynamo: a fulmen-compiled call reached
    while `torch.compile` traces runs here, with Dynamo's frame callback off (Dynamo is
    imported then; the `torch.compiler.disable`d runner is made at the first such call)."""
    if not _RUNNER:
        _RUNNER.append(torch.compiler.disable(_run, recursive=True))
    return _RUNNER[0](call, *args, **kwargs)


def _run(call, *args, **kwargs):
    return call(*args, **kwargs)


_RUNNER: list = []


__all__ = ["compiled_code_runs_eagerly", "outside_dynamo"]
