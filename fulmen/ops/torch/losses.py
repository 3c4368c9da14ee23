"""Loss functions: F.mse_loss, F.nll_loss and F.cross_entropy (class-index targets).

`nll_loss` picks `-input[n, target[n]]` with `take_along_dim` after replacing ignored targets
by 0 (so the gather stays in range), weights it by `weight[target]` and masks ignored entries;
'mean' divides by the sum of the weights of the non-ignored targets (NaN when all are ignored,
as in eager, whose gradient is then zero: `_mean_by`). `cross_entropy` is `nll_loss(log_softmax(input))`, plus eager's label-smoothing
term. Probability targets and the legacy `size_average`/`reduce` arguments run whole.
"""

from __future__ import annotations

from numbers import Number

import torch
import torch.nn.functional as F

from fulmen.core import NotYetSupportedError
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.nn import log_softmax
from fulmen.proxies.tensor import known_same_shape

_REDUCTIONS = ("none", "mean", "sum")


def _unsupported(op: str, message: str) -> NotYetSupportedError:
    return NotYetSupportedError(message, op=f"ltorch.{op}")


def _check_reduction(op: str, reduction, size_average, reduce) -> None:
    if size_average is not None or reduce is not None:
        raise _unsupported(op, "the legacy size_average/reduce arguments")
    if reduction not in _REDUCTIONS:
        raise _unsupported(op, f"reduction={reduction!r} (eager raises)")


def _reduce(loss, reduction: str):
    if reduction == "none":
        return loss
    total = prims.sum(loss, tuple(range(loss.ndim)))
    if reduction == "sum":
        return total
    return prims.div(total, loss.numel()) if loss.numel() else prims.div(total, 0.0)


@torch_op(F.mse_loss)
def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    """`F.mse_loss`: `(input - target)^2` (broadcast, as eager), reduced by `reduction`."""
    _check_reduction("mse_loss", reduction, size_average, reduce)
    if weight is not None or not isinstance(target, torch.Tensor):
        raise _unsupported("mse_loss", "weight= or a non-tensor target")
    if input.dtype != target.dtype or not input.dtype.is_floating_point:
        raise _unsupported("mse_loss", "input and target must share a floating dtype")
    if tuple(input.shape) != tuple(target.shape):
        raise _unsupported("mse_loss", "input and target shapes differ (eager warns and "
                           "broadcasts; run whole)")
    diff = prims.sub(input, target)
    return _reduce(prims.mul(diff, diff), reduction)


def _class_layout(op: str, input, target):
    """Check shapes; return the class dim (1, or 0 for an unbatched input)."""
    if not isinstance(target, torch.Tensor) or target.dtype != torch.int64:
        raise _unsupported(op, "class-index (int64) targets are decomposed")
    if not input.dtype.is_floating_point or input.ndim == 0:
        raise _unsupported(op, "needs a floating input of rank >= 1")
    class_dim = 0 if input.ndim == 1 else 1
    expected = tuple(s for d, s in enumerate(input.shape) if d != class_dim)
    if not known_same_shape(target.shape, expected) and tuple(target.shape) != expected:
        raise _unsupported(op, f"target shape {tuple(target.shape)} for input "
                           f"{tuple(input.shape)} (eager raises)")
    if input.shape[class_dim] == 0:
        raise _unsupported(op, "no classes")
    return class_dim


def _check_weight(op: str, weight, input, class_dim: int) -> None:
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (input.shape[class_dim],):
        raise _unsupported(op, "weight must be a (C,) tensor (eager raises)")
    if weight.dtype != input.dtype:
        raise _unsupported(op, "weight dtype differs from input (eager raises)")


def _nll(logp, target, weight, ignore_index: int, reduction: str, class_dim: int):
    """Weighted negative log likelihood of class-index targets (see the module docstring)."""
    ignored = prims.eq(target, ignore_index)
    safe_target = prims.where(ignored, prims.full(tuple(target.shape), 0, target.dtype,
                                                  target.device), target)
    index = prims.broadcast_in_dim(
        safe_target, tuple(1 if d == class_dim else s for d, s in enumerate(logp.shape)),
        tuple(d for d in range(logp.ndim) if d != class_dim))
    picked = prims.reshape(prims.take_along_dim(logp, index, class_dim), tuple(target.shape))
    zeros = prims.full(tuple(target.shape), 0.0, logp.dtype, logp.device)
    if weight is not None:
        flat = prims.reshape(safe_target, (target.numel(),))
        weights = prims.reshape(prims.index_select(weight, 0, flat), tuple(target.shape))
    else:
        weights = prims.full(tuple(target.shape), 1.0, logp.dtype, logp.device)
    weights = prims.where(ignored, zeros, weights)
    loss = prims.neg(prims.mul(picked, weights))
    if reduction == "none":
        return loss, weights
    all_dims = tuple(range(loss.ndim))
    total = prims.sum(loss, all_dims) if all_dims else loss
    if reduction == "sum":
        return total, weights
    return _mean_by(total, prims.sum(weights, all_dims) if all_dims else weights), weights


def _mean_by(total, denom):
    """`total / denom`, NaN where `denom` is 0 (every target ignored: eager's 0 / 0) with a zero
    gradient there, as eager's backward (a plain division gave NaN gradients: 0 * (1 / 0))."""
    empty = prims.eq(denom, 0)
    shape = tuple(denom.shape)
    safe = prims.where(empty, prims.full(shape, 1.0, denom.dtype, denom.device), denom)
    return prims.where(empty, prims.full(shape, float("nan"), total.dtype, total.device),
                       prims.div(total, safe))


@torch_op(F.nll_loss)
def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean"):
    """`F.nll_loss` with class-index targets: input (C,), (N, C) or (N, C, d1, ...)."""
    _check_reduction("nll_loss", reduction, size_average, reduce)
    class_dim = _class_layout("nll_loss", input, target)
    _check_weight("nll_loss", weight, input, class_dim)
    if not isinstance(ignore_index, int):
        raise _unsupported("nll_loss", f"ignore_index={ignore_index!r}")
    return _nll(input, target, weight, ignore_index, reduction, class_dim)[0]


@torch_op(F.cross_entropy)
def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                  reduce=None, reduction="mean", label_smoothing=0.0):
    """`F.cross_entropy` with class-index targets: `nll_loss(log_softmax(input, class_dim))`;
    with `label_smoothing` e, `(1 - e) * nll + e / C * smooth`, where `smooth` is the
    (weighted) sum of `-log_softmax` over classes, reduced as eager reduces it."""
    _check_reduction("cross_entropy", reduction, size_average, reduce)
    if isinstance(target, torch.Tensor) and target.dtype.is_floating_point:
        raise _unsupported("cross_entropy", "probability targets run whole")
    class_dim = _class_layout("cross_entropy", input, target)
    _check_weight("cross_entropy", weight, input, class_dim)
    if not isinstance(ignore_index, int) or not isinstance(label_smoothing, Number) or not (
            0.0 <= label_smoothing <= 1.0):
        raise _unsupported("cross_entropy", "ignore_index / label_smoothing out of range")
    logp = log_softmax(input, class_dim)
    loss, weights = _nll(logp, target, weight, ignore_index, reduction, class_dim)
    if not label_smoothing:
        return loss
    classes = input.shape[class_dim]
    terms = logp
    if weight is not None:
        terms = prims.mul(logp, prims.broadcast_in_dim(weight, tuple(logp.shape), (class_dim,)))
    smooth = prims.neg(prims.sum(terms, (class_dim,)))
    ignored = prims.eq(target, ignore_index)
    smooth = prims.where(ignored, prims.full(tuple(target.shape), 0.0, smooth.dtype,
                                             smooth.device), smooth)
    all_dims = tuple(range(smooth.ndim))
    if reduction == "none":
        reduced = smooth
    else:
        reduced = prims.sum(smooth, all_dims) if all_dims else smooth
        if reduction == "mean":
            if weight is not None:
                denom = prims.sum(weights, all_dims) if all_dims else weights
            else:
                kept = prims.convert_element_type(prims.logical_not(ignored), smooth.dtype)
                denom = prims.sum(kept, all_dims) if all_dims else kept
            reduced = _mean_by(reduced, denom)
    return prims.add(prims.mul(loss, 1.0 - label_smoothing),
                     prims.mul(reduced, label_smoothing / classes))

