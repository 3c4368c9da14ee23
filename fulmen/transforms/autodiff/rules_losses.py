"""Composite VJP rules of the class-index losses, `F.cross_entropy` and `F.nll_loss`.

Without them, the backward recomputes the loss's decomposition and transposes every prim: a
`take_along_dim` scattered into a zero `(N, C)` tensor, the weights' `where`s and the
`log_softmax` rule, several passes over the logits. Eager runs `nll_loss_backward` (one value
per row, written at the target's column) then `log_softmax_backward`. These rules compute the
same in one expression a fusion executor renders as one row kernel:

    s_n  = w[t_n] * -(g / W)   (mean: W the sum of the non-ignored rows' weights)
         = w[t_n] * -g         (sum)          = w[t_n] * -g_n   (none);   0 where t_n is ignored
    G    = s_n at column t_n, 0 elsewhere                        (nll_loss's cotangent: dx = G)
    dx   = G - exp(log_softmax(x)) * sum_c G                     (cross_entropy)

as eager orders the products, with `w = 1` when no weight is given. With label smoothing e,
eager's composite adds `(e / C) * smooth`, `smooth_n = -sum_c w_c log_softmax(x)[n, c]` (0 where
ignored) reduced like the loss (mean: over the same W), so `G` becomes
`(1 - e) * G - (e / C) * scale_n * w_c` with `scale_n` = g_n, g or g / W, 0 where ignored.
The forward keeps the op whole; calls these rules do not cover (arguments the decomposition
refuses, no elements) run torch.autograd on the op alone.
Reference: eager's `nll_loss_backward` and `_log_softmax_backward_data` (aten LossNLL.cpp,
SoftMax.cpp).
"""

from __future__ import annotations

import torch

from fulmen.ops import ltorch, prims
from fulmen.transforms.autodiff.registry import vjp_rule
from fulmen.transforms.autodiff.rules import autograd_cotangents
from fulmen.transforms.autodiff.rules_composite import _compute_dtype, _keep, _to


def _covered(input, target, weight, size_average, ignore_index, reduce, reduction) -> bool:
    """Whether the rules below compute this call's gradient (else torch.autograd does). The
    class weight never gets one: eager refuses a weight that requires grad."""
    return (isinstance(target, torch.Tensor) and target.dtype == torch.int64
            and input.dtype.is_floating_point and input.ndim >= 1
            and size_average is None and reduce is None
            and reduction in ("none", "mean", "sum") and isinstance(ignore_index, int)
            and input.numel() > 0)


def _row_scales(grad, target, weight, ignore_index: int, reduction: str, dtype):
    """(kept, weights, scale): the non-ignored mask, `w[t_n]` (0 where ignored) and the
    per-row cotangent factor of the reduction (g_n, g or g / W), each of the target's shape."""
    shape = tuple(target.shape)
    kept = prims.ne(target, ignore_index)
    if weight is not None:
        safe = prims.where(kept, target, 0)
        flat = prims.reshape(safe, (target.numel(),))
        picked = prims.reshape(prims.index_select(_to(weight, dtype), 0, flat), shape)
        weights = prims.where(kept, picked, 0.0)
    else:
        weights = prims.convert_element_type(kept, dtype)
    g = _to(grad, dtype)
    if reduction == "none":
        return kept, weights, g
    if reduction == "mean":
        dims = tuple(range(len(shape)))
        g = prims.div(g, prims.sum(weights, dims) if dims else weights)
    return kept, weights, prims.broadcast_in_dim(g, shape, ()) if shape else g


def _nll_cotangent(grad, input, target, weight, ignore_index, reduction, label_smoothing):
    """`G` of the module docstring: the cotangent of log-probabilities `input` (compute dtype),
    and that dtype."""
    dtype = _compute_dtype(input.dtype)
    class_dim = 0 if input.ndim == 1 else 1
    kept, weights, scale = _row_scales(grad, target, weight, ignore_index, reduction, dtype)
    rows = tuple(d for d in range(input.ndim) if d != class_dim)
    full = tuple(input.shape)
    per_row = prims.mul(weights, prims.neg(scale))  # w[t_n] * -(g / W), 0 where ignored
    classes = prims.iota(input.shape[class_dim], 0, 1, torch.int64, input.device)
    at_target = prims.eq(prims.broadcast_in_dim(classes, full, (class_dim,)),
                         prims.broadcast_in_dim(target, full, rows))
    cotangent = prims.where(at_target, prims.broadcast_in_dim(per_row, full, rows), 0.0)
    if label_smoothing:
        cotangent = prims.mul(cotangent, 1.0 - label_smoothing)
        smooth = prims.where(kept, scale, 0.0)
        smooth = prims.mul(smooth, label_smoothing / input.shape[class_dim])
        spread = prims.broadcast_in_dim(smooth, full, rows)
        if weight is not None:
            spread = prims.mul(spread, prims.broadcast_in_dim(_to(weight, dtype), full,
                                                              (class_dim,)))
        cotangent = prims.sub(cotangent, spread)
    return cotangent, dtype, class_dim


@vjp_rule(ltorch.nll_loss)
def _nll_loss_vjp(grad, out, input, target, weight, size_average, ignore_index, reduce,
                  reduction):
    args = (input, target, weight, size_average, ignore_index, reduce, reduction)
    if not _covered(*args):
        return autograd_cotangents(ltorch.nll_loss, args, grad)
    cotangent, _, _ = _nll_cotangent(grad, input, target, weight, ignore_index, reduction, 0.0)
    return (_to(cotangent, input.dtype),) + (None,) * 6


@vjp_rule(ltorch.cross_entropy)
def _cross_entropy_vjp(grad, out, input, target, weight, size_average, ignore_index, reduce,
                       reduction, label_smoothing):
    args = (input, target, weight, size_average, ignore_index, reduce, reduction,
            label_smoothing)
    if not _covered(*args[:7]):
        return autograd_cotangents(ltorch.cross_entropy, args, grad)
    cotangent, dtype, class_dim = _nll_cotangent(grad, input, target, weight, ignore_index,
                                                 reduction, label_smoothing)
    logp = _to(ltorch.log_softmax(input, class_dim), dtype)
    total = prims.sum(cotangent, (class_dim,))
    grad_input = prims.sub(cotangent, prims.mul(prims.exp(logp), _keep(total, logp,
                                                                       (class_dim,))))
    return (_to(grad_input, input.dtype),) + (None,) * 7
