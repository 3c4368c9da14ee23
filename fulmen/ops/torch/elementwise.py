"""Elementwise torch-level ops: arithmetic (binary and ternary), `atan2`, `copysign`, `maximum`,
`minimum`, and the helpers the other elementwise families share (`unary`: math with a prim of
the same meaning; `logical`: comparisons, logical and bitwise ops, `where`, `clamp`).

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
