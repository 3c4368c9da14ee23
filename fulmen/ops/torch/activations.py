"""Activation functions beyond relu/gelu/silu: mish, softplus, hardtanh, leaky_relu, elu, glu.

Each is elementwise on a floating input (glu also splits it in two) and computes in float32 for
float16/bfloat16 inputs, as eager's kernels do. `inplace=True` raises a `FulmenError` (see
NOTE [mutating arguments] in `nn.py`); argument combinations not covered raise
`NotYetSupportedError`, so the tracer runs the op whole.
"""

from __future__ import annotations

from numbers import Number

import torch
import torch.nn.functional as F

from fulmen.core import FulmenError, NotYetSupportedError
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.reductions import compute_dtype
from fulmen.ops.torch.utils import canonical_dim, exp_saturating, to_dtype


def _unsupported(op: str, message: str) -> NotYetSupportedError:
    return NotYetSupportedError(message, op=f"ltorch.{op}")


def _check_inplace(op: str, inplace: bool) -> None:
    if inplace:
        raise FulmenError("inplace=True is not supported yet while tracing", op=f"ltorch.{op}",
                          hint="use the out-of-place form (inplace=False)")


def _floating(op: str, a) -> torch.Tensor:
    """`a` in its computation dtype; non-floating inputs are left to eager."""
    if not isinstance(a, torch.Tensor) or not a.dtype.is_floating_point:
        raise _unsupported(op, "needs a floating tensor input")
    return to_dtype(a, compute_dtype(a.dtype))


def _real_number(op: str, name: str, value) -> float:
    if not isinstance(value, Number) or isinstance(value, (bool, complex)):
        raise _unsupported(op, f"{name}={value!r} (a real number is supported)")
    return float(value)


def slice_along(a, dim: int, start: int, end: int):
    """`a[..., start:end, ...]` along `dim` (a `prims.slice`)."""
    starts = tuple(start if d == dim else 0 for d in range(a.ndim))
    ends = tuple(end if d == dim else size for d, size in enumerate(a.shape))
    return prims.slice_prim(a, starts, ends, (1,) * a.ndim)


def _softplus(x, beta: float, threshold: float):
    """`log1p(exp(beta x)) / beta`, or `x` where `beta x > threshold` (eager's formula). The
    exponential reads 0 where the linear branch is taken: the same values, and differentiated
    prim by prim (`decompose_to_prims` before autodiff) the unused branch's gradient is
    `0 * exp(0)`, not `0 * exp(89) = 0 * inf = NaN` (the torch-level rule is eager's)."""
    scaled = prims.mul(x, beta) if beta != 1.0 else x
    linear = prims.gt(scaled, threshold)
    soft = prims.log1p(prims.exp(prims.where(linear, 0.0, scaled)))
    if beta != 1.0:
        soft = prims.div(soft, beta)
    return prims.where(linear, x, soft)


@torch_op(F.mish)
def mish(input, inplace=False):
    """`F.mish`: `x * tanh(softplus(x))` (softplus with beta 1, threshold 20, as eager)."""
    _check_inplace("mish", inplace)
    x = _floating("mish", input)
    out = prims.mul(x, prims.tanh(_softplus(x, 1.0, 20.0)))
    return to_dtype(out, input.dtype)


@torch_op(F.softplus)
def softplus(input, beta=1.0, threshold=20.0):
    """`F.softplus`: `log(1 + exp(beta x)) / beta`, linear above `threshold`."""
    beta = _real_number("softplus", "beta", beta)
    threshold = _real_number("softplus", "threshold", threshold)
    x = _floating("softplus", input)
    return to_dtype(_softplus(x, beta, threshold), input.dtype)


@torch_op(F.hardtanh)
def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    """`F.hardtanh`: `x` clamped to [min_val, max_val] (NaN stays NaN)."""
    _check_inplace("hardtanh", inplace)
    low = _real_number("hardtanh", "min_val", min_val)
    high = _real_number("hardtanh", "max_val", max_val)
    if low > high:
        raise _unsupported("hardtanh", "min_val > max_val (eager raises)")
    x = _floating("hardtanh", input)
    return to_dtype(prims.minimum(prims.maximum(x, low), high), input.dtype)


@torch_op(F.leaky_relu)
def leaky_relu(input, negative_slope=0.01, inplace=False):
    """`F.leaky_relu`: `x` where `x > 0`, else `negative_slope * x`."""
    _check_inplace("leaky_relu", inplace)
    slope = _real_number("leaky_relu", "negative_slope", negative_slope)
    x = _floating("leaky_relu", input)
    out = prims.where(prims.gt(x, 0), x, prims.mul(x, slope))
    return to_dtype(out, input.dtype)


@torch_op(F.elu)
def elu(input, alpha=1.0, inplace=False):
    """`F.elu`: `x` where `x > 0`, else `alpha * (exp(x) - 1)`; the exponential reads 0 where
    `x` is taken (as in `_softplus`: prim by prim, no `0 * expm1'(89) = 0 * inf` gradient)."""
    _check_inplace("elu", inplace)
    alpha = _real_number("elu", "alpha", alpha)
    x = _floating("elu", input)
    positive = prims.gt(x, 0)
    negative = prims.mul(prims.expm1(prims.where(positive, 0.0, x)), alpha)
    out = prims.where(positive, x, negative)
    return to_dtype(out, input.dtype)


@torch_op(F.glu)
def glu(input, dim=-1):
    """`F.glu`: the first half of `input` along `dim` times the sigmoid of the second half;
    the size along `dim` must be even (`exp` saturating: NOTE [exp past overflow] in utils.py)."""
    if not isinstance(dim, int) or isinstance(dim, bool) or input.ndim == 0:
        raise _unsupported("glu", "needs an int dim and a tensor of rank >= 1")
    dim = canonical_dim(dim, input.ndim, op="ltorch.glu")
    size = input.shape[dim]
    if size % 2:
        raise _unsupported("glu", f"odd size {size} along dim {dim} (eager raises)")
    x = _floating("glu", input)
    first = slice_along(x, dim, 0, size // 2)
    second = slice_along(x, dim, size // 2, size)
    gate = prims.div(1.0, prims.add(exp_saturating(prims.neg(second)), 1.0))
    return to_dtype(prims.mul(first, gate), input.dtype)
