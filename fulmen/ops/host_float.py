"""Python floats computed at run time: a float that changes between calls is an input, not a
constant (NOTE [floats read at run time]).

NOTE [floats read at run time]
An LR scheduler changes `param_group["lr"]` at every step, and Adam reads its step count with
`state["step"].item()`. Baked into the trace as constants, each new value would compile again
(past `cache_size_limit`, eagerly). A float the jitted function sees change between calls
(`fulmen.tracer.shape_policy`) is traced instead as a `FloatProxy`: a `float` subclass with a
trace name, whose value the compiled program reads at every call from a float64 0-dim carrier
tensor (`HOST_ITEM(lr_carrier)`, exact for every Python float). In such a trace `t.item()` of
a one-element floating tensor is a `FloatProxy` too (the statement `Tensor.item(t)`, run at
run time, not a graph break).

Values stay eager's bit for bit because nothing is computed differently:
- Python arithmetic on a FloatProxy (`lr / (1 - beta1 ** step)`) records one statement per
  operation (`operator.truediv(lr, t3)`), run at run time on Python floats in the same order as
  eager (no algebra, no float32 rounding); `math.sqrt`/`exp`/`log`/... likewise.
- a torch call that receives a FloatProxy (`param.addcdiv_(a, b, value=-step_size)`) is
  recorded whole, as the exact torch op (opaque), never decomposed: no decomposition rounds or
  compares the number at trace time.
As a C double a FloatProxy is NaN, and a trace in which a statement takes a NaN constant is
refused (`tracer.host_floats.refuse_nan_constants`): code that reads the number past Python's
protocols (`from math import sqrt` bound before tracing, a meta kernel sizing `arange`) never
leaves a constant of one call's value in the program.
A float input's sign is keyed (`sign_class`: negative, zero, positive or NaN), so comparing it
with zero, and `bool` of it, answer from that class (SGD's `if momentum != 0` under a momentum
that OneCycleLR cycles: it stays a run-time input); a float computed from it has no such class.
Stored into an object (a scheduler's next rate into `param_groups`), it is returned by the
program and stored by the epilogue (`fulmen.tracer.objects.Epilogue`). Anything else that needs
the value itself while tracing raises `FloatDecided`: other comparisons, `bool`, `int`,
`round`, hashing, formatting, `float()`, other `math` functions, numpy, a torch call with no
tensor argument that would compute with it. The jitted
function then traces again with its floats as constants (guarded by value, as before).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from fulmen.core import FulmenError, Symbol
from fulmen.core.proxy import Proxy, iter_proxies
from fulmen.core.symbol import Namespace
from fulmen.core.trace import get_tracectx
from fulmen.proxies import TensorProxy

HOST = Namespace("host", "fulmen.ops.host_float", "from fulmen.ops import host_float as host")


class FloatDecided(FulmenError):
    """A float read at run time (`FloatProxy`) was needed as a value while tracing."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} needs the value of a float that changes between calls",
                         op="float")


class FloatProxy(float, Proxy):
    """A Python float whose value is known only at run time (NOTE [floats read at run time]).

    No traced statement depends on its value: arithmetic records statements, and every
    question about the value raises `FloatDecided`. As a C double it is NaN: code that reads
    the number past Python's protocols (`from math import sqrt` bound before tracing, a meta
    kernel sizing `arange` by it) gets NaN, which shows in the results or fails the trace,
    never a plausible constant of this one call.
    """

    def __new__(cls, name: str) -> FloatProxy:
        proxy = super().__new__(cls, math.nan)
        proxy.name = name
        proxy.sign = None  # a float input's keyed `sign_class`, None where not known
        return proxy

    def type_string(self) -> str:
        return "float"

    def __repr__(self) -> str:
        return f"<FloatProxy {self.name}>"

    def __reduce_ex__(self, protocol):
        raise FloatDecided("copying or pickling")

    def __array_ufunc__(self, *args, **kwargs):
        raise FloatDecided("numpy")

    def __array__(self, *args, **kwargs):
        raise FloatDecided("numpy")


def _decided(what: str):
    def method(self, *args, **kwargs):
        raise FloatDecided(what)
    method.__name__ = what
    return method


def sign_class(value: float) -> float:
    """The class of `value` a float input is keyed by: -1.0, 0.0, 1.0 or NaN, which compares
    with zero (and is true or false) as `value` does."""
    if value == 0:
        return 0.0
    if value > 0:
        return 1.0
    return -1.0 if value < 0 else math.nan


def _sign_answer(what: str, answer):
    def method(self, *args):
        if self.sign is not None and (not args or (type(args[0]) in (int, float)
                                                   and args[0] == 0)):
            return answer(self.sign, *args)
        raise FloatDecided(what)
    method.__name__ = what
    return method


for _name, _answer in (("__eq__", operator.eq), ("__ne__", operator.ne), ("__lt__", operator.lt),
                       ("__le__", operator.le), ("__gt__", operator.gt), ("__ge__", operator.ge),
                       ("__bool__", bool)):
    setattr(FloatProxy, _name, _sign_answer(_name, _answer))

for _name in ("__hash__", "__int__", "__float__", "__index__", "__round__", "__floor__",
              "__ceil__", "__trunc__", "__str__", "__format__", "__divmod__", "__rdivmod__",
              "as_integer_ratio", "hex", "is_integer", "__getnewargs__", "conjugate"):
    setattr(FloatProxy, _name, _decided(_name))


def _new() -> FloatProxy:
    ctx = get_tracectx()
    if ctx is None:
        raise FloatDecided("a float computed outside tracing")
    return FloatProxy(ctx.names.new("f"))


def _number(value: Any) -> bool:
    return type(value) in (int, float, bool) or isinstance(value, FloatProxy)


def _binary_meta(a, b) -> FloatProxy:
    return _new()


def _unary_meta(a) -> FloatProxy:
    return _new()


def _symbol(name: str, fn, meta) -> Symbol:
    return Symbol(name, meta, namespace=HOST, impl=fn, torch_fn=fn)


_BINARY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
           "truediv": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
           "pow": operator.pow}
_UNARY = {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs}
_MATH = ("sqrt", "exp", "expm1", "log", "log1p", "log2", "log10", "sin", "cos", "tan", "tanh",
         "atan", "fabs")  # one float in, one float out
SYMBOLS: dict[str, Symbol] = {}
for _name, _fn in _BINARY.items():
    SYMBOLS[_name] = _symbol(_name, _fn, _binary_meta)
for _name, _fn in _UNARY.items():
    SYMBOLS[_name] = _symbol(_name, _fn, _unary_meta)
for _name in _MATH:
    _fn = getattr(math, _name)
    SYMBOLS[f"math_{_name}"] = _symbol(f"math_{_name}", _fn, _unary_meta)
_PICKS = {"min": min, "max": max}  # of two numbers: recorded (Adafactor's `min(lr, 1 / s)`)
for _name, _fn in _PICKS.items():
    SYMBOLS[f"builtin_{_name}"] = _symbol(f"builtin_{_name}", _fn, _binary_meta)


def _binary(name: str, reflected: bool):
    sym = SYMBOLS[name]

    def method(self, other):
        if not _number(other):
            return NotImplemented
        return sym(other, self) if reflected else sym(self, other)
    return method


for _name in _BINARY:
    setattr(FloatProxy, f"__{_name}__", _binary(_name, False))
    setattr(FloatProxy, f"__r{_name}__", _binary(_name, True))
for _name in _UNARY:
    setattr(FloatProxy, f"__{_name}__", lambda self, _sym=SYMBOLS[_name]: _sym(self))


def _item_meta(tensor: TensorProxy) -> FloatProxy:
    return _new()


def _item(tensor: torch.Tensor) -> float:
    return tensor.item()


# `tensor.item()` of a one-element floating tensor (or a float carrier), read at run time
HOST_ITEM = Symbol("item", _item_meta, namespace=HOST, impl=_item, torch_fn=_item)


def host_item(tensor: TensorProxy) -> FloatProxy:
    """Record `tensor.item()` (a float64 carrier, or a floating tensor of one element) as a
    statement whose `FloatProxy` output is read at run time."""
    return HOST_ITEM(tensor)


def has_host_float(tree: Any) -> bool:
    """Whether a FloatProxy is among the (nested) arguments `tree`."""
    return any(isinstance(proxy, FloatProxy) for proxy in iter_proxies(tree))


def math_function(name: str, original):
    """`math.<name>` as called while tracing with FloatProxies: recorded for the functions of
    one float in `_MATH`, refused (`FloatDecided`) for every other on a FloatProxy; the
    original for plain numbers."""
    sym = SYMBOLS.get(f"math_{name}")

    def wrapper(*args, **kwargs):
        if not any(isinstance(arg, FloatProxy) for arg in (*args, *kwargs.values())):
            return original(*args, **kwargs)
        if sym is None or len(args) != 1 or kwargs:
            raise FloatDecided(f"math.{name}")
        return sym(args[0])
    wrapper.__name__ = name
    wrapper.__wrapped__ = original
    return wrapper


def pick_function(name: str, original):
    """Builtin `min` or `max` as called while tracing with FloatProxies: of two numbers one of
    which is a FloatProxy, recorded (run at run time by the builtin itself, so ties and NaNs
    pick as eager's); refused (`FloatDecided`) for other calls on a FloatProxy; the original
    otherwise."""
    sym = SYMBOLS[f"builtin_{name}"]

    def wrapper(*args, **kwargs):
        if not any(isinstance(arg, FloatProxy) for arg in (*args, *kwargs.values())):
            return original(*args, **kwargs)
        if len(args) != 2 or kwargs or not all(map(_number, args)):
            raise FloatDecided(name)
        return sym(*args)
    wrapper.__name__ = name
    wrapper.__wrapped__ = original
    return wrapper


__all__ = ["FloatDecided", "FloatProxy", "HOST_ITEM", "SYMBOLS", "has_host_float", "sign_class",
           "host_item", "math_function", "pick_function"]
