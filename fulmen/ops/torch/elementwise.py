"""Elementwise torch-level ops: arithmetic, math, comparisons, `where`, `clamp`.

Every op here promotes and broadcasts its operands exactly as eager does (see `utils`), computes
in the computation dtype (float16/bfloat16 in float32) and converts to the result dtype. Ops
whose result is exact in any dtype (`neg`, `floor`, `maximum`, `where`, `clamp`...) compute in
the result dtype directly, so they record no conversions.

Arguments a decomposition does not cover (operands on different devices, a Python object that
is not a number, argument combinations eager rejects) raise `NotYetSupportedError`: the tracer
then records the opaque op, which runs (or rejects) the call exactly as eager does.

NOTE [reflected dunders]: `2 - x` calls `Tensor.__rsub__(x, 2)`, and `torch.sub(2, x)` is not
valid, so each non-commutative reflected dunder is its own op whose canonical callable is the
dunder. Commutative ones (`__radd__`, `__rmul__`, `__rand__`...) are spellings of the forward
op, since `x + 2` and `2 + x` are the same IEEE operation.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable
from numbers import Number

import torch

from fulmen.core import NotYetSupportedError, Symbol
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.utils import (
    Promotion,
    broadcast_shapes,
    broadcast_to,
    check_like_eager,
    check_uint64_operands,
    elementwise,
    exp_saturating,
    promote,
    to_dtype,
)

T = torch.Tensor
TensorLike = torch.Tensor | Number

_SCALAR_TYPES = (bool, int, float, complex)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _unsupported(op: str, message: str) -> NotYetSupportedError:
    return NotYetSupportedError(message, op=f"ltorch.{op}")


def _check_operands(op: str, args) -> list[torch.Tensor]:
    """The tensor operands of `args`; refuse Python objects that are not numbers, no tensor at
    all, and tensors on several devices (eager accepts a CPU scalar tensor beside a CUDA one)."""
    tensors = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            tensors.append(arg)
        elif not isinstance(arg, _SCALAR_TYPES):
            raise _unsupported(op, f"operand of type {type(arg).__name__} is not a number")
    if not tensors:
        raise _unsupported(op, "needs a tensor operand")
    if len({tensor.device for tensor in tensors}) > 1:
        raise _unsupported(op, "operands on different devices")
    check_uint64_operands(op, args)
    return tensors


# NOTE [scalars with reduced-precision tensors]: eager's CPU kernels for `add`, `sub`, `pow`,
# `remainder` and `fmod` cast a Python number (and `alpha=`) to the tensor's dtype before they
# compute in float32, so on the CPU `x_f16 % 1.7` divides by float16(1.7) = 1.7002. Their
# decompositions round such numbers the same way for CPU tensors. `mul`, `div`, `lerp` and
# `addcmul` keep the number in float32, as do these decompositions on other devices (where the
# kernels' reading of the number has not been measured yet).
_REDUCED_FLOATS = (torch.float16, torch.bfloat16)


def _round_scalars(args, dtype: torch.dtype) -> tuple:
    """`args` with Python numbers (not bools) rounded to `dtype` when it is a reduced-precision
    dtype and the tensors are on the CPU."""
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    if dtype not in _REDUCED_FLOATS or not tensors or tensors[0].device.type != "cpu":
        return tuple(args)
    rounded = []
    for arg in args:
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            with torch._C.DisableTorchFunction():  # a plain constant, not a traced op
                arg = torch.tensor(arg, dtype=dtype).item()
        rounded.append(arg)
    return tuple(rounded)


def _map(
    prim: Symbol,
    *args,
    kind: Promotion = Promotion.DEFAULT,
    exact: bool = False,
    round_scalars: bool = False,
):
    """`prim` applied with eager's promotion and broadcasting. `exact`: compute in the result
    dtype (for operations whose result is exact in any dtype, and rounded divisions, whose
    reduced-precision kernels round the quotient to the dtype); `round_scalars`: see NOTE
    [scalars with reduced-precision tensors]."""
    _check_operands(prim.name, args)
    if round_scalars:
        args = _round_scalars(args, promote(*args, kind=kind)[1])
    compute = promote(*args)[1] if exact else None
    return elementwise(prim, *args, kind=kind, compute_dtype=compute)


def _composite(
    op: str, fn: Callable, *args, kind: Promotion = Promotion.DEFAULT, exact: bool = False
):
    """`fn(*operands)` (a composition of prims) with eager's promotion and broadcasting.

    Tensor operands are converted to the computation dtype and broadcast to a common shape;
    numbers and None pass through. A non-bool result is converted to the result dtype.
    """
    present = [arg for arg in args if arg is not None]
    tensors = _check_operands(op, present)
    computation, result = promote(*present, kind=kind)
    if exact:
        computation = result
    shape = broadcast_shapes(*[tensor.shape for tensor in tensors])
    operands = [
        broadcast_to(to_dtype(arg, computation), shape) if isinstance(arg, torch.Tensor) else arg
        for arg in args
    ]
    out = fn(*operands)
    return out if out.dtype == torch.bool else to_dtype(out, result)


def _is_integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _check_scale(op: str, value, result: torch.dtype) -> None:
    """Eager's rules for `alpha=`/`value=`: no float for integral results, bool only for bool
    (and the factor never changes the dtype of the product it scales)."""
    if isinstance(value, torch.Tensor) or not isinstance(value, _SCALAR_TYPES):
        raise _unsupported(op, "the scale factor must be a Python number")
    if isinstance(value, bool) != (result == torch.bool) and value != 1:
        raise _unsupported(op, "bool scale factors go with bool results only")
    if isinstance(value, float) and _is_integral(result):
        raise _unsupported(op, "a float scale factor needs a floating result")
    if isinstance(value, complex) and not result.is_complex:
        raise _unsupported(op, "a complex scale factor needs a complex result")


def _scale(a, value):
    """`a * value` for a tensor or a number (value 1 leaves `a` alone)."""
    if value == 1:
        return a
    return prims.mul(a, value) if isinstance(a, torch.Tensor) else a * value


def _result_dtype(op: str, *args, kind: Promotion = Promotion.DEFAULT) -> torch.dtype:
    present = [arg for arg in args if arg is not None]
    _check_operands(op, present)
    return promote(*present, kind=kind)[1]


# ---------------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------------


def _scaled_binary(op: str, prim: Symbol, a, b, alpha):
    """`prim(a, alpha * b)` computed in the computation dtype, as eager's add/sub kernels."""
    result = _result_dtype(op, a, b)
    _check_scale(op, alpha, result)
    if alpha == 1 and not isinstance(alpha, bool):
        return _map(prim, a, b, round_scalars=True)
    a, b, alpha = _round_scalars((a, b, alpha), result)
    return _composite(op, lambda x, y: prim(x, _scale(y, alpha)), a, b)


@torch_op(torch.add, methods=("add", "__add__", "__radd__"))
def add(input: TensorLike, other: TensorLike, *, alpha: Number = 1) -> torch.Tensor:
    """`input + alpha * other`."""
    return _scaled_binary("add", prims.add, input, other, alpha)


@torch_op(torch.sub, torch.subtract, methods=("sub", "subtract", "__sub__"))
def sub(input: TensorLike, other: TensorLike, *, alpha: Number = 1) -> torch.Tensor:
    """`input - alpha * other`."""
    _check_bool_subtraction("sub", input, other)
    return _scaled_binary("sub", prims.sub, input, other, alpha)


def _check_bool_subtraction(op: str, a, b) -> None:
    """Eager refuses `-` with a bool operand (a Python bool too): raise its error while tracing
    (a fused kernel would compute it)."""
    if any(isinstance(v, bool) or getattr(v, "dtype", None) == torch.bool for v in (a, b)):
        check_like_eager(op, torch.sub, a, b)


@torch_op(torch.rsub)
def rsub(input: TensorLike, other: TensorLike, *, alpha: Number = 1) -> torch.Tensor:
    """`other - alpha * input`."""
    _check_bool_subtraction("rsub", input, other)
    return _scaled_binary("rsub", prims.sub, other, input, alpha)


@torch_op(T.__rsub__)
def rsub_dunder(self: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`other - self` (Python's `2 - x`)."""
    _check_bool_subtraction("rsub_dunder", self, other)
    return _scaled_binary("rsub_dunder", prims.sub, other, self, 1)


@torch_op(torch.mul, torch.multiply, methods=("mul", "multiply", "__mul__", "__rmul__"))
def mul(input: TensorLike, other: TensorLike) -> torch.Tensor:
    """`input * other`."""
    return _map(prims.mul, input, other)


_ROUNDED_DIVISION = {"trunc": prims.trunc_div, "floor": prims.floor_div}


@torch_op(
    torch.div,
    torch.divide,
    torch.true_divide,
    methods=("div", "divide", "true_divide", "__truediv__"),
)
def div(input: TensorLike, other: TensorLike, *, rounding_mode: str | None = None) -> torch.Tensor:
    """`input / other`; `rounding_mode` "trunc" or "floor" rounds the quotient (integer
    operands stay integral, with C or Python semantics respectively)."""
    if rounding_mode is None:
        return _map(prims.div, input, other, kind=Promotion.INT_TO_FLOAT)
    if rounding_mode not in _ROUNDED_DIVISION:
        raise _unsupported("div", f"rounding_mode={rounding_mode!r}")
    return _map(_ROUNDED_DIVISION[rounding_mode], input, other, exact=True)


@torch_op(T.__rtruediv__)
def rtruediv(self: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`other / self`, computed like eager as `self.reciprocal() * other`."""
    return mul(reciprocal(self), other)


@torch_op(torch.floor_divide, methods=("floor_divide", "__floordiv__"))
def floor_divide(input: TensorLike, other: TensorLike) -> torch.Tensor:
    """`input // other`: the quotient rounded toward minus infinity."""
    return _map(prims.floor_div, input, other, exact=True)


@torch_op(T.__rfloordiv__)
def rfloordiv(self: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`other // self`."""
    return _map(prims.floor_div, other, self, exact=True)


@torch_op(torch.remainder, methods=("remainder", "__mod__"))
def remainder(input: TensorLike, other: TensorLike) -> torch.Tensor:
    """Python's modulus: the result has the sign of `other`."""
    return _map(prims.remainder, input, other, round_scalars=True)


@torch_op(T.__rmod__)
def rmod(self: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`other % self`."""
    return _map(prims.remainder, other, self, round_scalars=True)


@torch_op(torch.fmod, methods=("fmod",))
def fmod(input: TensorLike, other: TensorLike) -> torch.Tensor:
    """C's modulus: the result has the sign of `input`."""
    return _map(prims.fmod, input, other, round_scalars=True)


def _pow(op: str, base, exponent):
    if isinstance(base, torch.Tensor) and isinstance(exponent, torch.Tensor):
        if base.dtype == torch.bool and exponent.dtype == torch.bool:
            raise _unsupported(op, "pow of two bool tensors")  # eager has no bool kernel
    return _map(prims.pow, base, exponent, kind=Promotion.BOOL_TO_LONG, round_scalars=True)


@torch_op(torch.pow, methods=("pow", "__pow__"))
def pow(input: TensorLike, exponent: TensorLike) -> torch.Tensor:
    """`input ** exponent`; `input` may be a number (`torch.pow(2, x)`)."""
    return _pow("pow", input, exponent)


@torch_op(T.__rpow__)
def rpow(self: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`other ** self` (Python's `2 ** x`)."""
    return _pow("rpow", other, self)


@torch_op(torch.float_power, methods=("float_power",))
def float_power(input: TensorLike, exponent: TensorLike) -> torch.Tensor:
    """`input ** exponent` computed in float64 (complex128 if an operand is complex)."""
    tensors = _check_operands("float_power", (input, exponent))
    complex_ = any(t.dtype.is_complex for t in tensors) or any(
        isinstance(a, complex) for a in (input, exponent)
    )
    dtype = torch.complex128 if complex_ else torch.float64
    return _composite("float_power", prims.pow, to_dtype(input, dtype), to_dtype(exponent, dtype))


@torch_op(torch.square, methods=("square",))
def square(input: torch.Tensor) -> torch.Tensor:
    """`input * input` (bool becomes int64, as `input ** 2`)."""
    return _composite("square", lambda a: prims.mul(a, a), input, kind=Promotion.BOOL_TO_LONG)


@torch_op(torch.neg, torch.negative, methods=("neg", "negative", "__neg__"))
def neg(input: torch.Tensor) -> torch.Tensor:
    """`-input`."""
    return _map(prims.neg, input, exact=True)


@torch_op(torch.positive, methods=("positive", "__pos__"))
def positive(input: torch.Tensor) -> torch.Tensor:
    """`+input`: the input itself, as in eager."""
    if not isinstance(input, torch.Tensor) or input.dtype == torch.bool:
        raise _unsupported("positive", "needs a non-bool tensor")
    return input


@torch_op(torch.abs, torch.absolute, methods=("abs", "absolute", "__abs__"))
def abs(input: torch.Tensor) -> torch.Tensor:
    """`|input|`."""
    if isinstance(input, torch.Tensor) and input.dtype.is_complex:
        raise _unsupported("abs", "complex abs")  # prims.abs keeps the operand's dtype
    return _map(prims.abs, input, exact=True)


# ---------------------------------------------------------------------------------------------
# Unary math with a prim of the same meaning
# ---------------------------------------------------------------------------------------------


def _unary(
    name: str,
    prim: Symbol,
    torch_fn: Callable,
    *aliases: Callable,
    methods: tuple[str, ...] = (),
    kind: Promotion = Promotion.INT_TO_FLOAT,
    exact: bool = False,
) -> Symbol:
    def decomposition(input):
        if not isinstance(input, torch.Tensor):
            raise _unsupported(name, "needs a tensor")
        return _map(prim, input, kind=kind, exact=exact)

    decomposition.__name__ = name
    decomposition.__doc__ = f"Elementwise {name} (`prims.{prim.name}` after promotion)."
    return torch_op(torch_fn, *aliases, methods=methods or (name,), name=name)(decomposition)


# fmt: off
_S = torch.special
exp = _unary("exp", prims.exp, torch.exp)
exp2 = _unary("exp2", prims.exp2, torch.exp2, _S.exp2)
expm1 = _unary("expm1", prims.expm1, torch.expm1, _S.expm1)
log = _unary("log", prims.log, torch.log)
log1p = _unary("log1p", prims.log1p, torch.log1p, _S.log1p)
log2 = _unary("log2", prims.log2, torch.log2)
log10 = _unary("log10", prims.log10, torch.log10)
sqrt = _unary("sqrt", prims.sqrt, torch.sqrt)
rsqrt = _unary("rsqrt", prims.rsqrt, torch.rsqrt)
sin = _unary("sin", prims.sin, torch.sin)
cos = _unary("cos", prims.cos, torch.cos)
tan = _unary("tan", prims.tan, torch.tan)
asin = _unary("asin", prims.asin, torch.asin, torch.arcsin, methods=("asin", "arcsin"))
acos = _unary("acos", prims.acos, torch.acos, torch.arccos, methods=("acos", "arccos"))
atan = _unary("atan", prims.atan, torch.atan, torch.arctan, methods=("atan", "arctan"))
sinh = _unary("sinh", prims.sinh, torch.sinh)
cosh = _unary("cosh", prims.cosh, torch.cosh)
tanh = _unary("tanh", prims.tanh, torch.tanh)
asinh = _unary("asinh", prims.asinh, torch.asinh, torch.arcsinh, methods=("asinh", "arcsinh"))
acosh = _unary("acosh", prims.acosh, torch.acosh, torch.arccosh, methods=("acosh", "arccosh"))
atanh = _unary("atanh", prims.atanh, torch.atanh, torch.arctanh, methods=("atanh", "arctanh"))
erf = _unary("erf", prims.erf, torch.erf, _S.erf)
erfc = _unary("erfc", prims.erfc, torch.erfc, _S.erfc)
erfinv = _unary("erfinv", prims.erfinv, torch.erfinv, _S.erfinv)
lgamma = _unary("lgamma", prims.lgamma, torch.lgamma, _S.gammaln)
digamma = _unary("digamma", prims.digamma, torch.digamma, _S.digamma, _S.psi)
reciprocal = _unary("reciprocal", prims.reciprocal, torch.reciprocal)
floor = _unary("floor", prims.floor, torch.floor, kind=Promotion.DEFAULT, exact=True)
ceil = _unary("ceil", prims.ceil, torch.ceil, kind=Promotion.DEFAULT, exact=True)
trunc = _unary("trunc", prims.trunc, torch.trunc, torch.fix, methods=("trunc", "fix"),
               kind=Promotion.DEFAULT, exact=True)
sign = _unary("sign", prims.sign, torch.sign, kind=Promotion.DEFAULT, exact=True)
signbit = _unary("signbit", prims.signbit, torch.signbit, kind=Promotion.ALWAYS_BOOL, exact=True)
isnan = _unary("isnan", prims.isnan, torch.isnan, kind=Promotion.ALWAYS_BOOL, exact=True)
isinf = _unary("isinf", prims.isinf, torch.isinf, kind=Promotion.ALWAYS_BOOL, exact=True)
isfinite = _unary("isfinite", prims.isfinite, torch.isfinite, kind=Promotion.ALWAYS_BOOL,
                  exact=True)
logical_not = _unary("logical_not", prims.logical_not, torch.logical_not,
                     kind=Promotion.ALWAYS_BOOL, exact=True)
# fmt: on


@torch_op(torch.round, _S.round, methods=("round",))
def round(input: torch.Tensor, *, decimals: int = 0) -> torch.Tensor:
    """Round half to even; `decimals != 0` runs as the opaque op."""
    if decimals != 0:
        raise _unsupported("round", "decimals != 0")
    return _map(prims.round, input, exact=True)


@torch_op(torch.sigmoid, _S.expit, methods=("sigmoid",))
def sigmoid(input: torch.Tensor) -> torch.Tensor:
    """`1 / (1 + exp(-input))`, in eager's order of operations (`exp` saturating: NOTE [exp
    past overflow] in utils.py)."""

    def fn(a):
        return prims.reciprocal(prims.add(exp_saturating(prims.neg(a)), 1))

    return _composite("sigmoid", fn, input, kind=Promotion.INT_TO_FLOAT)


def _special_inf(name: str, value: float):
    def decomposition(input):
        if not isinstance(input, torch.Tensor) or input.dtype.is_complex:
            raise _unsupported(name, "needs a real tensor")
        return _map(prims.eq, input, value, kind=Promotion.ALWAYS_BOOL, exact=True)

    decomposition.__name__ = name
    decomposition.__doc__ = f"`input == {value}` (all false for integral tensors)."
    return torch_op(getattr(torch, name), methods=(name,), name=name)(decomposition)


isposinf = _special_inf("isposinf", math.inf)
isneginf = _special_inf("isneginf", -math.inf)


@torch_op(torch.nan_to_num, methods=("nan_to_num",))
def nan_to_num(
    input: torch.Tensor, nan: float = 0.0, posinf: float | None = None, neginf: float | None = None
) -> torch.Tensor:
    """NaN, +inf and -inf replaced by `nan`, `posinf` (default: the dtype's max) and `neginf`
    (default: its lowest). Integral tensors run as the opaque op (eager returns a copy)."""
    if not isinstance(input, torch.Tensor) or not input.dtype.is_floating_point:
        raise _unsupported("nan_to_num", "needs a floating tensor")
    info = torch.finfo(input.dtype)
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf
    if nan is None:
        nan = 0.0
    out = prims.where(prims.isnan(input), nan, input)
    out = prims.where(prims.eq(input, math.inf), posinf, out)
    return prims.where(prims.eq(input, -math.inf), neginf, out)


# ---------------------------------------------------------------------------------------------
# Ternary arithmetic: lerp, addcmul, addcdiv
# ---------------------------------------------------------------------------------------------


@torch_op(torch.lerp, methods=("lerp",))
def lerp(input: torch.Tensor, end: torch.Tensor, weight: TensorLike) -> torch.Tensor:
    """`input + weight * (end - input)`, with eager's switch to
    `end - (end - input) * (1 - weight)` where `|weight| >= 0.5`."""
    values = [input, end] + ([weight] if isinstance(weight, torch.Tensor) else [])
    if not all(isinstance(v, torch.Tensor) for v in (input, end)):
        raise _unsupported("lerp", "input and end must be tensors")
    if len({v.dtype for v in values}) > 1 or not input.dtype.is_floating_point:
        raise _unsupported("lerp", "operands of different or non-floating dtypes")
    if not isinstance(weight, (torch.Tensor, float, int)) or isinstance(weight, bool):
        raise _unsupported("lerp", "weight must be a tensor or a real number")

    def fn(a, b, w):
        diff = prims.sub(b, a)
        if not isinstance(w, torch.Tensor):
            if builtins.abs(w) < 0.5:
                return prims.add(a, prims.mul(diff, w))
            return prims.sub(b, prims.mul(diff, 1 - w))
        low = prims.add(a, prims.mul(w, diff))
        high = prims.sub(b, prims.mul(diff, prims.sub(1, w)))
        return prims.where(prims.lt(prims.abs(w), 0.5), low, high)

    return _composite("lerp", fn, input, end, weight)


def _addc(op: str, prim: Symbol, input, tensor1, tensor2, value):
    if not all(isinstance(t, torch.Tensor) for t in (input, tensor1, tensor2)):
        raise _unsupported(op, "operands must be tensors")
    result = _result_dtype(op, input, tensor1, tensor2)
    _check_scale(op, value, result)

    def fn(a, b, c):
        return prims.add(a, prim(_scale(b, value), c))

    return _composite(op, fn, input, tensor1, tensor2)


@torch_op(torch.addcmul, methods=("addcmul",))
def addcmul(
    input: torch.Tensor, tensor1: torch.Tensor, tensor2: torch.Tensor, *, value: Number = 1
) -> torch.Tensor:
    """`input + value * tensor1 * tensor2`."""
    return _addc("addcmul", prims.mul, input, tensor1, tensor2, value)


@torch_op(torch.addcdiv, methods=("addcdiv",))
def addcdiv(
    input: torch.Tensor, tensor1: torch.Tensor, tensor2: torch.Tensor, *, value: Number = 1
) -> torch.Tensor:
    """`input + value * tensor1 / tensor2` (integral `tensor1`/`tensor2` are rejected, as in
    eager)."""
    for t in (tensor1, tensor2):
        if isinstance(t, torch.Tensor) and _is_integral(t.dtype):
            raise _unsupported("addcdiv", "integer division")
    return _addc("addcdiv", prims.div, input, tensor1, tensor2, value)


# ---------------------------------------------------------------------------------------------
# Binary math: atan2, copysign, maximum, minimum
# ---------------------------------------------------------------------------------------------


def _both_tensors(op: str, a, b) -> None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise _unsupported(op, "both operands must be tensors")


@torch_op(torch.atan2, torch.arctan2, methods=("atan2", "arctan2"))
def atan2(input: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """The angle of the point (`other`, `input`)."""
    _both_tensors("atan2", input, other)
    return _map(prims.atan2, input, other, kind=Promotion.INT_TO_FLOAT)


@torch_op(torch.copysign, methods=("copysign",))
def copysign(input: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`|input|` with the sign of `other`."""
    if not isinstance(input, torch.Tensor):
        raise _unsupported("copysign", "input must be a tensor")
    return _map(prims.copysign, input, other, kind=Promotion.INT_TO_FLOAT)


@torch_op(torch.maximum, methods=("maximum",))
def maximum(input: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum; NaN where either operand is NaN."""
    _both_tensors("maximum", input, other)
    return _map(prims.maximum, input, other, exact=True)


@torch_op(torch.minimum, methods=("minimum",))
def minimum(input: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Elementwise minimum; NaN where either operand is NaN."""
    _both_tensors("minimum", input, other)
    return _map(prims.minimum, input, other, exact=True)


# ---------------------------------------------------------------------------------------------
# Comparisons and logical ops
# ---------------------------------------------------------------------------------------------


def _comparison(
    name: str, prim: Symbol, torch_fn: Callable, *aliases: Callable, methods: tuple[str, ...]
) -> Symbol:
    def decomposition(input, other):
        if not isinstance(input, torch.Tensor):
            raise _unsupported(name, "input must be a tensor")
        return _map(prim, input, other, kind=Promotion.ALWAYS_BOOL, exact=True)

    decomposition.__name__ = name
    decomposition.__doc__ = f"Elementwise `{name}` after promotion to a common dtype; bool result."
    return torch_op(torch_fn, *aliases, methods=methods, name=name)(decomposition)


eq = _comparison("eq", prims.eq, torch.eq, methods=("eq", "__eq__"))
ne = _comparison("ne", prims.ne, torch.ne, torch.not_equal, methods=("ne", "not_equal", "__ne__"))
lt = _comparison("lt", prims.lt, torch.lt, torch.less, methods=("lt", "less", "__lt__"))
le = _comparison("le", prims.le, torch.le, torch.less_equal, methods=("le", "less_equal", "__le__"))
gt = _comparison("gt", prims.gt, torch.gt, torch.greater, methods=("gt", "greater", "__gt__"))
ge = _comparison(
    "ge", prims.ge, torch.ge, torch.greater_equal, methods=("ge", "greater_equal", "__ge__")
)


def _logical(name: str, prim: Symbol) -> Symbol:
    def decomposition(input, other):
        _both_tensors(name, input, other)
        _check_operands(name, (input, other))
        shape = broadcast_shapes(input.shape, other.shape)
        a = broadcast_to(to_dtype(input, torch.bool), shape)
        b = broadcast_to(to_dtype(other, torch.bool), shape)
        return prim(a, b)

    decomposition.__name__ = name
    decomposition.__doc__ = f"`{name}` of the operands' truth values (nonzero is true)."
    torch_fn = getattr(torch, name)
    return torch_op(torch_fn, methods=(name,), name=name)(decomposition)


logical_and = _logical("logical_and", prims.bitwise_and)
logical_or = _logical("logical_or", prims.bitwise_or)
logical_xor = _logical("logical_xor", prims.bitwise_xor)


# ---------------------------------------------------------------------------------------------
# Bitwise ops
# ---------------------------------------------------------------------------------------------


def _bitwise(op: str, prim: Symbol, a, b):
    if _is_integral(_result_dtype(op, a, b)):
        return _map(prim, a, b)
    raise _unsupported(op, "bitwise ops need integral or bool operands")


def _bitwise_op(name: str, prim: Symbol, methods: tuple[str, ...]) -> Symbol:
    def decomposition(input, other):
        return _bitwise(name, prim, input, other)

    decomposition.__name__ = name
    decomposition.__doc__ = f"Elementwise `{name}` of integral or bool operands."
    return torch_op(getattr(torch, name), methods=methods, name=name)(decomposition)


bitwise_and = _bitwise_op("bitwise_and", prims.bitwise_and, ("bitwise_and", "__and__", "__rand__"))
bitwise_or = _bitwise_op("bitwise_or", prims.bitwise_or, ("bitwise_or", "__or__", "__ror__"))
bitwise_xor = _bitwise_op("bitwise_xor", prims.bitwise_xor, ("bitwise_xor", "__xor__", "__rxor__"))
bitwise_left_shift = _bitwise_op(
    "bitwise_left_shift", prims.bitwise_left_shift, ("bitwise_left_shift", "__lshift__")
)
bitwise_right_shift = _bitwise_op(
    "bitwise_right_shift", prims.bitwise_right_shift, ("bitwise_right_shift", "__rshift__")
)


@torch_op(T.__rlshift__)
def rlshift(self: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`other << self`."""
    return _bitwise("rlshift", prims.bitwise_left_shift, other, self)


@torch_op(T.__rrshift__)
def rrshift(self: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`other >> self`."""
    return _bitwise("rrshift", prims.bitwise_right_shift, other, self)


@torch_op(torch.bitwise_not, methods=("bitwise_not", "__invert__"))
def bitwise_not(input: torch.Tensor) -> torch.Tensor:
    """`~input` (logical not for bool tensors)."""
    if not isinstance(input, torch.Tensor) or not _is_integral(input.dtype):
        raise _unsupported("bitwise_not", "needs an integral or bool tensor")
    return prims.bitwise_not(input)


# ---------------------------------------------------------------------------------------------
# where and clamp
# ---------------------------------------------------------------------------------------------


@torch_op(torch.where)
def where(condition: torch.Tensor, input: TensorLike = None, other: TensorLike = None):
    """`input` where `condition` holds, else `other`; either may be a number.

    The one-argument form (`torch.where(condition)`, a data-dependent shape) is the opaque op.
    """
    if input is None or other is None:
        raise _unsupported("where", "the one-argument form")
    if not isinstance(condition, torch.Tensor) or condition.dtype != torch.bool:
        raise _unsupported("where", "condition must be a bool tensor")
    for value in (input, other):
        if not isinstance(value, (torch.Tensor, *_SCALAR_TYPES)):
            raise _unsupported("where", "values must be tensors or numbers")
    values = [v for v in (input, other) if isinstance(v, torch.Tensor)]
    if len({t.device for t in (condition, *values)}) > 1:
        raise _unsupported("where", "operands on different devices")
    if len(values) < 2:  # a number that does not fit the result dtype: eager raises
        check_like_eager("where", torch.where, condition, input, other)
    dtype = promote(input, other)[1]
    shape = broadcast_shapes(condition.shape, *[v.shape for v in values])
    pred = broadcast_to(condition, shape)
    a, b = (broadcast_to(to_dtype(v, dtype), shape) for v in (input, other))
    if not values:  # two numbers: materialise one, as the prim needs a tensor value
        a = prims.full(tuple(shape), a, dtype, condition.device)
    return prims.where(pred, a, b)


@torch_op(T.where)
def tensor_where(self: torch.Tensor, condition: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`self.where(condition, other)`: `torch.where(condition, self, other)`."""
    return where(condition, self, other)


@torch_op(torch.clamp, torch.clip, methods=("clamp", "clip"))
def clamp(
    input: torch.Tensor,
    min: TensorLike | None = None,
    max: TensorLike | None = None,
) -> torch.Tensor:
    """`minimum(maximum(input, min), max)`: NaN in any operand gives NaN, and `max` wins where
    `min > max`, as in eager. `min`/`max` are numbers or tensors."""
    if min is None and max is None:
        raise _unsupported("clamp", "needs min or max")
    if not isinstance(input, torch.Tensor):
        raise _unsupported("clamp", "input must be a tensor")
    if len({isinstance(bound, torch.Tensor) for bound in (min, max) if bound is not None}) > 1:
        raise _unsupported("clamp", "one tensor bound and one number bound")  # eager rejects it
    if not any(isinstance(bound, torch.Tensor) for bound in (min, max)):
        check_like_eager("clamp", torch.clamp, input, min, max)  # a bound the dtype cannot hold

    def fn(a, low, high):
        if low is not None:
            a = prims.maximum(a, low)
        if high is not None:
            a = prims.minimum(a, high)
        return a

    return _composite("clamp", fn, input, min, max, exact=True)


@torch_op(torch.clamp_min, methods=("clamp_min",))
def clamp_min(input: torch.Tensor, min: TensorLike) -> torch.Tensor:
    """`clamp(input, min=min)`."""
    return clamp(input, min, None)


@torch_op(torch.clamp_max, methods=("clamp_max",))
def clamp_max(input: torch.Tensor, max: TensorLike) -> torch.Tensor:
    """`clamp(input, max=max)`."""
    return clamp(input, None, max)
