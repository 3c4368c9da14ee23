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
An ignored row's `s_n` is 0 whatever `g` and W are (eager writes nothing there), also when
`ignore_index` names a class.

Without label smoothing, on CPU, `cross_entropy` has a saving forward (NOTE [saving forwards]):
it runs eager's own two kernels, `_log_softmax` then `nll_loss`, so the loss equals eager's, and keeps
the log-probabilities (as eager's graph does) instead of the logits, the same bytes, and for
(C,) and (N, C) logits the W that eager's `nll_loss_forward` returns (no reduction left). The
backward is then one pointwise pass, `G - exp(logp) * sum_c G` with `sum_c G = s_n + 0.0`
exactly (a row holds `s_n` at one column, zeros elsewhere; a target out of range raised in the
forward; `+ 0.0` makes a `-0.0` the sum's `+0.0`), instead of recomputing `log_softmax` and
summing `G` (three passes over the logits, two exps per element). Otherwise the forward keeps
the op whole and the rule recomputes; calls these rules do not cover (arguments the
decomposition refuses, no elements) run torch.autograd on the op alone.
Reference: eager's `nll_loss_backward` and `_log_softmax_backward_data` (aten LossNLL.cpp,
SoftMax.cpp).
"""

from __future__ import annotations

import torch

from fulmen.ops import ltorch, prims
from fulmen.ops.opaque import opaque_symbol
from fulmen.transforms.autodiff.registry import bound_arguments, saving_forward, vjp_rule
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


def _row_scales(grad, target, weight, ignore_index: int, reduction: str, dtype, total=None):
    """(kept, weights, scale): the non-ignored mask, `w[t_n]` (0 where ignored) and the
    per-row cotangent factor of the reduction (g_n, g or g / W), each of the target's shape;
    `total`: W as eager's forward computed it (else summed here)."""
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
        if total is None:
            total = prims.sum(weights, dims) if dims else weights
        g = prims.div(g, _to(total, dtype))
    return kept, weights, prims.broadcast_in_dim(g, shape, ()) if shape else g


def _nll_cotangent(grad, input, target, weight, ignore_index, reduction, label_smoothing,
                   total=None):
    """`G` of the module docstring: the cotangent of log-probabilities `input` (compute dtype),
    that dtype, the class dimension and `s_n` (of the target's shape)."""
    dtype = _compute_dtype(input.dtype)
    class_dim = 0 if input.ndim == 1 else 1
    kept, weights, scale = _row_scales(grad, target, weight, ignore_index, reduction, dtype,
                                       total)
    rows = tuple(d for d in range(input.ndim) if d != class_dim)
    full = tuple(input.shape)
    # w[t_n] * -(g / W); exactly 0 where ignored (not 0 * -inf = NaN when every row is)
    per_row = prims.where(kept, prims.mul(weights, prims.neg(scale)), 0.0)
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
    return cotangent, dtype, class_dim, per_row


@vjp_rule(ltorch.nll_loss)
def _nll_loss_vjp(grad, out, input, target, weight, size_average, ignore_index, reduce,
                  reduction):
    args = (input, target, weight, size_average, ignore_index, reduce, reduction)
    if not _covered(*args):
        return autograd_cotangents(ltorch.nll_loss, args, grad)
    cotangent, _, _, _ = _nll_cotangent(grad, input, target, weight, ignore_index, reduction,
                                        0.0)
    return (_to(cotangent, input.dtype),) + (None,) * 6


@vjp_rule(ltorch.cross_entropy)
def _cross_entropy_vjp(grad, out, input, target, weight, size_average, ignore_index, reduce,
                       reduction, label_smoothing):
    args = (input, target, weight, size_average, ignore_index, reduce, reduction,
            label_smoothing)
    if not _covered(*args[:7]):
        return autograd_cotangents(ltorch.cross_entropy, args, grad)
    cotangent, dtype, class_dim, _ = _nll_cotangent(grad, input, target, weight, ignore_index,
                                                    reduction, label_smoothing)
    logp = _to(ltorch.log_softmax(input, class_dim), dtype)
    total = prims.sum(cotangent, (class_dim,))
    grad_input = prims.sub(cotangent, prims.mul(prims.exp(logp), _keep(total, logp,
                                                                       (class_dim,))))
    return (_to(grad_input, input.dtype),) + (None,) * 7


LOG_SOFTMAX = opaque_symbol(torch.ops.aten._log_softmax.default)
NLL_LOSS = opaque_symbol(torch.ops.aten.nll_loss_nd.default)  # what `F.nll_loss` calls
NLL_FORWARD = opaque_symbol(torch.ops.aten.nll_loss_forward.default)  # its (C,) / (N, C) case
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # torch's reduction enum


@saving_forward(ltorch.cross_entropy)
def _cross_entropy_saving(bsym, requires: set[str]):
    """Eager's `_log_softmax` and `nll_loss`, keeping the log-probabilities, and the one-pass
    backward of the module docstring; declines label smoothing and the calls the rule leaves to
    torch.autograd."""
    values = bound_arguments(bsym.sym, bsym.args, bsym.kwargs)
    input, target, weight, size_average, ignore_index, reduce, reduction, smoothing = values
    if smoothing or not _covered(*values[:7]) or input.name not in requires:
        return None
    if input.device.type != "cpu":  # measured on CPU; CUDA keeps the fused row kernels
        return None
    class_dim = 0 if input.ndim == 1 else 1
    logp = LOG_SOFTMAX(input, class_dim, False)
    if input.ndim <= 2:  # eager's kernel also returns W, which its backward divides by
        loss, weights = NLL_FORWARD(logp, target, weight, _REDUCTIONS[reduction], ignore_index)
    else:
        loss = NLL_LOSS(logp, target, weight, _REDUCTIONS[reduction], ignore_index)
        weights = None

    def backward(grad, output):
        cotangent, dtype, _, per_row = _nll_cotangent(
            grad, logp, target, weight, ignore_index, reduction, 0.0,
            weights if reduction == "mean" else None)
        total = prims.add(per_row, 0.0)  # sum_c G, exactly (module docstring)
        rows = tuple(d for d in range(logp.ndim) if d != class_dim)
        total = prims.broadcast_in_dim(total, tuple(logp.shape), rows)
        grad_input = prims.sub(cotangent, prims.mul(prims.exp(_to(logp, dtype)), total))
        return (_to(grad_input, input.dtype),) + (None,) * 7

    return loss, backward

