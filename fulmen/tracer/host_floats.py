"""Tracing with floats read at run time (NOTE [floats read at run time] in
`fulmen.ops.host_float`): the inputs that carry them, `t.item()` without a graph break, and
`math` functions on them.
"""

from __future__ import annotations

import builtins
import contextlib
import math
import threading
from collections.abc import Iterator

import torch

from fulmen.core.trace import TraceCtx, tracing
from fulmen.ops.host_float import (
    FloatDecided,
    FloatProxy,
    has_host_float,
    host_item,
    math_function,
    pick_function,
    sign_class,
)
from fulmen.proxies import TensorProxy
from fulmen.tracer.process_switch import ProcessSwitch

# `math`'s functions, as found when fulmen was imported
_ORIGINAL_MATH = {name: value for name, value in vars(math).items()
                  if callable(value) and not name.startswith("_")}
_WRAPPED_MATH = {name: math_function(name, value) for name, value in _ORIGINAL_MATH.items()}


# builtin `min` and `max`, as found when fulmen was imported
_ORIGINAL_PICKS = {"min": builtins.min, "max": builtins.max}
_WRAPPED_PICKS = {name: pick_function(name, value) for name, value in _ORIGINAL_PICKS.items()}


def _wrap_math() -> None:
    for name, wrapper in _WRAPPED_MATH.items():
        setattr(math, name, wrapper)
    for name, wrapper in _WRAPPED_PICKS.items():
        setattr(builtins, name, wrapper)


def _unwrap_math() -> None:
    for name, original in _ORIGINAL_MATH.items():
        setattr(math, name, original)
    for name, original in _ORIGINAL_PICKS.items():
        setattr(builtins, name, original)


# around a trace with floats read at run time: `math.sqrt(lr)` and `min(lr, x)` record a
# statement (torch's optimizers call `math.sqrt` through the module), other `math` functions on
# them raise
_MATH_SWITCH = ProcessSwitch(_wrap_math, _unwrap_math)


def floats_read_at_run_time(ctx: TraceCtx) -> ProcessSwitch:
    """The context manager around a trace with floats read at run time: `math` functions
    on them are recorded or refused, and `ctx` answers `t.item()` with a `FloatProxy`
    (`item_at_run_time`)."""
    ctx.host_floats = True
    return _MATH_SWITCH


_ITEMS = threading.local()


@contextlib.contextmanager
def items_read_at_run_time() -> Iterator[None]:
    """Around a trace (in this thread) whose `t.item()` of floating tensors are read at run
    time even without float inputs read so: Adam's step count under a constant learning rate,
    whose graph break gave a new answer at every step (`fulmen.jit` asks for it then)."""
    before = getattr(_ITEMS, "on", False)
    _ITEMS.on = True
    try:
        yield
    finally:
        _ITEMS.on = before


def items_requested() -> bool:
    """Whether the trace being made reads `t.item()` at run time (`items_read_at_run_time`)."""
    return getattr(_ITEMS, "on", False)


def read_float(ctx: TraceCtx, name: str, value: float) -> tuple[FloatProxy, TensorProxy]:
    """`(x, carrier)` for a float input read at run time: `carrier` the trace input (a float64
    0-dim tensor, `symbolic.carrier`) called `name`, `x` its value read by the trace's first
    statement; `x` compares with zero as `value` (this call's) does, the class of the sign
    the cache key holds (`objects.float_key`)."""
    carrier = TensorProxy(name, (), torch.float64, "cpu")
    with tracing(ctx):
        proxy = host_item(carrier)
    proxy.sign = sign_class(value)
    return proxy, carrier


def item_at_run_time(ctx: TraceCtx, func, args: tuple, kwargs: dict):
    """`t.item()` read at run time (a `FloatProxy`), or None where it stays a graph break:
    outside a trace with floats read at run time, inside a decomposition, for a tensor that is
    not one floating element."""
    if func is not torch.Tensor.item or not getattr(ctx, "host_floats", False) \
            or len(ctx.scopes) != 1 or kwargs or len(args) != 1:
        return None
    tensor = args[0]
    if not isinstance(tensor, TensorProxy) or not tensor.dtype.is_floating_point \
            or tensor.dtype not in (torch.float32, torch.float64, torch.float16,
                                    torch.bfloat16) or tensor.numel() != 1:
        return None
    return host_item(tensor)


def refuse_nan_constants(ctx: TraceCtx) -> None:
    """After a trace with floats read at run time: raise `FloatDecided` if a statement takes a
    NaN constant, the mark of a `FloatProxy` read as a C double past Python's protocols (NOTE
    [floats read at run time]; a program's own NaN constants only cost the floats' staying
    constant)."""
    if not getattr(ctx, "host_floats", False):
        return
    for bsym in ctx.bsyms:
        if _holds_nan((bsym.args, bsym.kwargs)):
            raise FloatDecided(f"{bsym.sym.id} (a NaN constant)")


def _holds_nan(value) -> bool:
    if type(value) is float:
        return math.isnan(value)
    if isinstance(value, (tuple, list)):
        return any(_holds_nan(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_nan(item) for item in value.values())
    return False


def refuse_host_floats(func, args: tuple, kwargs: dict) -> None:
    """Raise `FloatDecided` for a torch call with no tensor argument that would compute with a
    float read at run time (its result would be a constant of this call's value)."""
    if has_host_float((args, kwargs)):
        raise FloatDecided(f"{getattr(func, '__name__', func)} without a tensor argument")


__all__ = ["floats_read_at_run_time", "item_at_run_time", "items_read_at_run_time",
           "items_requested", "read_float", "refuse_host_floats", "refuse_nan_constants"]
