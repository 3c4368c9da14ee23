"""Elementwise prims: unary, binary and ternary maps, comparisons and dtype conversion.

Tensor operands must already share shape, dtype and device (torch-level ops broadcast and
promote first); Python numbers may stand for any operand. The output has the operands' shape,
and their dtype, or bool for comparisons and classification (`isnan`, ...).
"""

from __future__ import annotations

from numbers import Number

import torch

from fulmen.ops.prims.base import check, check_elementwise, prim
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import strides_of

__all__ = [
    "BOOL_RESULT",
    "neg", "abs", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh",
    "atanh", "erf", "erfc", "erfinv", "lgamma", "digamma", "floor", "ceil", "round", "trunc",
    "sign", "reciprocal", "bitwise_not", "logical_not", "isnan", "isinf", "isfinite", "signbit",
    "add", "sub", "mul", "div", "floor_div", "trunc_div", "remainder", "fmod", "pow", "maximum",
    "minimum", "atan2", "copysign", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_left_shift", "bitwise_right_shift", "eq", "ne", "lt", "le", "gt", "ge", "where",
    "convert_element_type",
]  # fmt: skip


def _map_meta(name: str, args, bool_result: bool) -> TensorProxy:
    first = check_elementwise(name, args)
    return _output_like(first, args, torch.bool if bool_result else first.dtype)


def _output_like(first: torch.Tensor, args, dtype: torch.dtype) -> TensorProxy:
    """The output of an elementwise map over `args` (tensor `first` among them).

    NOTE [elementwise layout]: eager's kernels give the output its operands' layout: a map over
    transposed tensors is transposed (`empty_like`'s preserve_format). When every tensor
    operand has the same non-contiguous strides, the output reports eager's layout, so that
    `(x.transpose(1, 2) * 2).contiguous().view(...)` keeps the user's copy; operands of
    different layouts still give a contiguous description.
    """
    strides = strides_of(first)
    if first.is_contiguous() or any(
            isinstance(arg, torch.Tensor) and strides_of(arg) != strides for arg in args):
        return TensorProxy.like(first, dtype=dtype)
    with torch._C.DisableTorchFunction():  # not a traced op
        layout = torch.empty_like(torch.empty_strided(first.shape, strides, device="meta"))
    return TensorProxy(None, first.shape, dtype, first.device, strides=layout.stride())


def _unary(name: str, *, bool_result: bool = False, doc: str = ""):
    def meta(a: TensorProxy) -> TensorProxy:
        check(isinstance(a, torch.Tensor), name, "operand must be a tensor")
        return _map_meta(name, (a,), bool_result)

    meta.__doc__ = doc or f"Elementwise {name}."
    return prim(name, tags=["elementwise", "unary"])(meta)


def _binary(name: str, *, bool_result: bool = False, doc: str = ""):
    def meta(a: TensorProxy | Number, b: TensorProxy | Number) -> TensorProxy:
        return _map_meta(name, (a, b), bool_result)

    meta.__doc__ = doc or f"Elementwise {name}."
    return prim(name, tags=["elementwise", "binary"])(meta)


neg = _unary("neg")
abs = _unary("abs")  # noqa: A001
exp = _unary("exp")
exp2 = _unary("exp2")
expm1 = _unary("expm1")
log = _unary("log")
log1p = _unary("log1p")
log2 = _unary("log2")
log10 = _unary("log10")
sqrt = _unary("sqrt")
rsqrt = _unary("rsqrt")
sin = _unary("sin")
cos = _unary("cos")
tan = _unary("tan")
asin = _unary("asin")
acos = _unary("acos")
atan = _unary("atan")
sinh = _unary("sinh")
cosh = _unary("cosh")
tanh = _unary("tanh")
asinh = _unary("asinh")
acosh = _unary("acosh")
atanh = _unary("atanh")
erf = _unary("erf")
erfc = _unary("erfc")
erfinv = _unary("erfinv")
lgamma = _unary("lgamma")
digamma = _unary("digamma")
floor = _unary("floor")
ceil = _unary("ceil")
round = _unary("round", doc="Round half to even, like torch.round.")  # noqa: A001
trunc = _unary("trunc")
sign = _unary("sign")
reciprocal = _unary("reciprocal")
bitwise_not = _unary("bitwise_not")
logical_not = _unary("logical_not", bool_result=True)
isnan = _unary("isnan", bool_result=True)
isinf = _unary("isinf", bool_result=True)
isfinite = _unary("isfinite", bool_result=True)
signbit = _unary("signbit", bool_result=True)

add = _binary("add")
sub = _binary("sub")
mul = _binary("mul")
div = _binary("div", doc="True division (floating and complex operands).")
floor_div = _binary("floor_div", doc="Division rounded toward -inf, like torch.floor_divide.")
trunc_div = _binary("trunc_div", doc="Division rounded toward zero (C semantics for integers).")
remainder = _binary("remainder", doc="Python-style modulus: the result has the divisor's sign.")
fmod = _binary("fmod", doc="C-style modulus: the result has the dividend's sign.")
pow = _binary("pow")  # noqa: A001
maximum = _binary("maximum", doc="Elementwise max; NaN if either operand is NaN.")
minimum = _binary("minimum", doc="Elementwise min; NaN if either operand is NaN.")
atan2 = _binary("atan2")
copysign = _binary("copysign")
bitwise_and = _binary("bitwise_and")
bitwise_or = _binary("bitwise_or")
bitwise_xor = _binary("bitwise_xor")
bitwise_left_shift = _binary("bitwise_left_shift")
bitwise_right_shift = _binary("bitwise_right_shift")
eq = _binary("eq", bool_result=True)
ne = _binary("ne", bool_result=True)
lt = _binary("lt", bool_result=True)
le = _binary("le", bool_result=True)
gt = _binary("gt", bool_result=True)
ge = _binary("ge", bool_result=True)

BOOL_RESULT = {"logical_not", "isnan", "isinf", "isfinite", "signbit", "eq", "ne", "lt", "le",
               "gt", "ge"}  # fmt: skip


@prim("where", tags=["elementwise", "ternary"])
def where(pred: TensorProxy, a: TensorProxy | Number, b: TensorProxy | Number) -> TensorProxy:
    """`a` where `pred` is true, else `b`; `pred` is bool and shares the shape of tensor operands."""
    check(isinstance(pred, torch.Tensor) and pred.dtype == torch.bool, "where", "pred must be a bool tensor")
    values = [x for x in (a, b) if isinstance(x, torch.Tensor)]
    if values:
        first = check_elementwise("where", values)
        check(pred.shape == first.shape, "where",
              lambda: f"pred shape {pred.shape} != {first.shape}")
        return _output_like(first, (pred, a, b), first.dtype)
    check(False, "where", "needs a tensor value operand (torch-level where materialises scalars)")


@prim("convert_element_type", tags=["elementwise", "unary"])
def convert_element_type(a: TensorProxy, dtype: torch.dtype) -> TensorProxy:
    """`a` converted to `dtype`, elementwise (as `Tensor.to(dtype)`)."""
    check(isinstance(a, torch.Tensor), "convert_element_type", "operand must be a tensor")
    check(isinstance(dtype, torch.dtype), "convert_element_type", f"{dtype!r} is not a dtype")
    return _output_like(a, (a,), dtype)
