"""VJP rules that keep eager's gradients at the edges of an op's domain.

The rules of the prims in a decomposition give the right derivative almost everywhere, but not
eager's answer at the edges:

- subgradients: `relu` at exactly 0 gets no gradient from eager's `threshold_backward` (its
  decomposition keeps that under prim-level autodiff too: NOTE [relu at zero] in
  ops/torch/nn.py); `clamp` gives the full gradient at its bounds and
  none to a NaN, `hardtanh` none at its bounds and the full gradient to a NaN.
- overflow: the transpose of `1 / (1 + exp(-x))` multiplies a zero cotangent by `exp(-x) = inf`
  below about -88 (float32), so `sigmoid`, `glu`, `softplus`, `elu` and `mish` gave NaN where
  eager's fused backward is finite (their decompositions now avoid it too, for prim-level
  autodiff: NOTE [exp past overflow] in ops/torch/utils.py; the rules here stay eager's
  formulas, one fused pass). (`std` needs no rule: its decomposition keeps the zero
  deviation of a constant row out of sqrt's derivative, see `reductions._standard_deviation`.)

Each rule here is eager's backward formula (`derivatives.yaml` and the ATen kernels it names),
computed in float32 for float16/bfloat16 inputs as eager's kernels do.
"""

from __future__ import annotations

import torch

from fulmen.ops import ltorch, prims
from fulmen.transforms.autodiff.registry import vjp_rule
from fulmen.transforms.autodiff.rules import _zeros_like, autograd_cotangents

_HALF = (torch.float16, torch.bfloat16)


def _compute(a):
    """`a` in the dtype eager's backward kernels compute in (float32 for half precision)."""
    return prims.convert_element_type(a, torch.float32) if a.dtype in _HALF else a


def _to(a, dtype):
    return a if a.dtype == dtype else prims.convert_element_type(a, dtype)


def _floating(a) -> bool:
    return isinstance(a, torch.Tensor) and a.dtype.is_floating_point


def _pass_where(keep, grad):
    """`grad` where `keep` holds, else 0 (a number: a fused kernel needs no zero tensor)."""
    return prims.where(keep, grad, 0.0)


# --- subgradients: relu, hardtanh, clamp ------------------------------------------------------


def _relu_grad(grad, out):
    """`threshold_backward(grad, out, 0)`: nothing where the output is <= 0 (so a NaN input
    passes the gradient)."""
    return prims.where(prims.le(out, 0), 0.0, grad)


@vjp_rule(ltorch.relu)
def _relu_vjp(grad, out, input):
    return (_relu_grad(grad, out),)


@vjp_rule(ltorch.functional_relu)
def _functional_relu_vjp(grad, out, input, inplace):
    return _relu_grad(grad, out), None


@vjp_rule(ltorch.hardtanh)
def _hardtanh_vjp(grad, out, input, min_val, max_val, inplace):
    """`hardtanh_backward`: nothing at or beyond the bounds, the gradient elsewhere (NaN too)."""
    outside = prims.bitwise_or(prims.le(input, float(min_val)), prims.ge(input, float(max_val)))
    return prims.where(outside, 0.0, grad), None, None, None


def _clamp_grad(grad, input, low, high):
    """`clamp_backward` for number bounds: the gradient where `low <= x <= high` (bounds
    included, NaN excluded)."""
    inside = None
    if low is not None:
        inside = prims.ge(input, low)
    if high is not None:
        below = prims.le(input, high)
        inside = below if inside is None else prims.bitwise_and(inside, below)
    return _pass_where(inside, grad)


def _tensor_bound(*bounds) -> bool:
    return any(isinstance(bound, torch.Tensor) for bound in bounds)


@vjp_rule(ltorch.clamp)
def _clamp_vjp(grad, out, input, min, max):
    if _tensor_bound(min, max) or not _floating(input):
        return autograd_cotangents(ltorch.clamp, (input, min, max), grad)
    return _clamp_grad(grad, input, min, max), None, None


@vjp_rule(ltorch.clamp_min)
def _clamp_min_vjp(grad, out, input, min):
    if _tensor_bound(min) or not _floating(input):
        return autograd_cotangents(ltorch.clamp_min, (input, min), grad)
    return _clamp_grad(grad, input, min, None), None


@vjp_rule(ltorch.clamp_max)
def _clamp_max_vjp(grad, out, input, max):
    if _tensor_bound(max) or not _floating(input):
        return autograd_cotangents(ltorch.clamp_max, (input, max), grad)
    return _clamp_grad(grad, input, None, max), None


# --- overflow-safe forms: sigmoid, glu, softplus, elu, mish -----------------------------------


def _sigmoid_grad(grad, y):
    """`sigmoid_backward`: `grad * (1 - y) * y` from the output, finite for any input."""
    return prims.mul(prims.mul(grad, prims.sub(1, y)), y)


@vjp_rule(ltorch.sigmoid)
def _sigmoid_vjp(grad, out, input):
    if not _floating(input):
        return (None,)
    return (_to(_sigmoid_grad(_compute(grad), _compute(out)), input.dtype),)


def _sigmoid(x):
    """`1 / (1 + exp(-x))`, which is 0 (not NaN) where exp(-x) overflows."""
    return prims.reciprocal(prims.add(prims.exp(prims.neg(x)), 1))


def _half_along(a, dim: int, index: int):
    size = a.shape[dim] // 2
    starts = tuple(index * size if d == dim else 0 for d in range(a.ndim))
    ends = tuple((index + 1) * size if d == dim else n for d, n in enumerate(a.shape))
    return prims.slice_prim(a, starts, ends, (1,) * a.ndim)


@vjp_rule(ltorch.glu)
def _glu_vjp(grad, out, input, dim):
    """`glu_backward` with `a, b` the halves: `grad * sigmoid(b)` for `a`, and
    `(1 - sigmoid(b)) * sigmoid(b) * grad * a` for `b`."""
    dim = dim % input.ndim
    x, g = _compute(input), _compute(grad)
    first, gate = _half_along(x, dim, 0), _sigmoid(_half_along(x, dim, 1))
    grad_first = prims.mul(g, gate)
    slope = prims.mul(prims.sub(1, gate), gate)
    grad_second = prims.mul(prims.mul(slope, g), first)
    return _to(prims.cat([grad_first, grad_second], dim), input.dtype), None


@vjp_rule(ltorch.softplus)
def _softplus_vjp(grad, out, input, beta, threshold):
    """`softplus_backward`: `grad` where `beta x > threshold`, else `grad * z / (z + 1)` with
    `z = exp(beta x)`."""
    x, g = _compute(input), _compute(grad)
    scaled = prims.mul(x, float(beta))
    z = prims.exp(scaled)
    soft = prims.div(prims.mul(g, z), prims.add(z, 1))
    return _to(prims.where(prims.gt(scaled, float(threshold)), g, soft), input.dtype), None, None


@vjp_rule(ltorch.elu)
def _elu_vjp(grad, out, input, alpha, inplace):
    """`elu_backward` (scale 1, input scale 1): `grad * alpha * exp(x)` where `x <= 0`, else
    `grad` (so a NaN input passes the gradient)."""
    x, g = _compute(input), _compute(grad)
    negative = prims.mul(prims.mul(g, float(alpha)), prims.exp(x))
    return _to(prims.where(prims.le(x, 0), negative, g), input.dtype), None, None


@vjp_rule(ltorch.mish)
def _mish_vjp(grad, out, input, inplace):
    """`mish_backward`: `grad * (t + x * sigmoid(x) * (1 - t^2))` with
    `t = tanh(log1p(exp(x)))` (no threshold: `t` is 1 where exp overflows)."""
    x, g = _compute(input), _compute(grad)
    t = prims.tanh(prims.log1p(prims.exp(x)))
    slope = prims.mul(prims.mul(x, _sigmoid(x)), prims.sub(1, prims.mul(t, t)))
    return _to(prims.mul(g, prims.add(t, slope)), input.dtype), None


# --- max/min: eager's gradient goes to the selected element -----------------------------------


def _evenly_to_extremum(grad, out, input):
    """`evenly_distribute_backward`: `grad / count` to each element equal to the extremum `out`
    of all of `input`, where a NaN extremum is equal to the NaN elements (amax's rule would
    give NaN everywhere)."""
    value = prims.broadcast_in_dim(out, tuple(input.shape), ())
    hit = prims.bitwise_or(prims.eq(input, value),
                           prims.bitwise_and(prims.isnan(input), prims.isnan(value)))
    share = prims.div(grad, prims.sum(prims.convert_element_type(hit, grad.dtype),
                                      tuple(range(input.ndim))))
    return prims.where(hit, prims.broadcast_in_dim(share, tuple(input.shape), ()), 0.0)


def _to_selected_index(grad, indices, input, dim: int, keepdim: bool):
    """`value_selecting_reduction_backward`: each cotangent goes to the element whose index
    `max(x, dim)`/`min(x, dim)` returned (the first extremum, or the first NaN), not shared by
    ties."""
    dim = dim % input.ndim
    if not keepdim:
        kept = tuple(1 if d == dim else size for d, size in enumerate(input.shape))
        grad, indices = prims.reshape(grad, kept), prims.reshape(indices, kept)
    return prims.scatter_add(_zeros_like(input), dim, indices, grad)


def _max_or_min_rule(sym):
    def rule(grad, out, input, dim, keepdim, other):
        if isinstance(dim, torch.Tensor) or other is not None:  # the elementwise form
            b = dim if isinstance(dim, torch.Tensor) else other
            grad_input, grad_b = autograd_cotangents(sym, (input, b), grad)
            if isinstance(dim, torch.Tensor):
                return grad_input, grad_b, None, None
            return grad_input, None, None, grad_b
        if not _floating(input):
            return None, None, None, None
        if dim is None:
            return _evenly_to_extremum(grad, out, input), None, None, None
        if input.ndim == 0:
            return grad[0], None, None, None
        values_grad = grad[0]
        if values_grad is None:
            return None, None, None, None
        grad_input = _to_selected_index(values_grad, out[1], input, dim, keepdim)
        return grad_input, None, None, None

    rule.__name__ = f"_{sym.name}_vjp"
    vjp_rule(sym)(rule)


_max_or_min_rule(ltorch.max)
_max_or_min_rule(ltorch.min)
