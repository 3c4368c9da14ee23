"""Unary elementwise torch-level ops with a prim of the same meaning (`exp`, `sqrt`, `tanh`,
`floor`, `isnan`, ...), and `round`, `sigmoid`, `isposinf`/`isneginf`, `nan_to_num`.

Promotion, computation dtype and unsupported arguments as in `elementwise` (its helpers).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fulmen.core import Symbol
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.elementwise import TensorLike, _composite, _map, _unsupported, mul
from fulmen.ops.torch.utils import Promotion, exp_saturating

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


@torch_op(torch.Tensor.__rtruediv__)
def rtruediv(self: torch.Tensor, other: TensorLike) -> torch.Tensor:
    """`other / self`, computed like eager as `self.reciprocal() * other`."""
    return mul(reciprocal(self), other)


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
