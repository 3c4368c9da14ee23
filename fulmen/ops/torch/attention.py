"""`F.scaled_dot_product_attention`, decomposed: `softmax(q k^T * scale + mask) v`.

The torch executor runs the op whole (eager's fused kernel); the decomposition is what fusers
and the backward see. Causal masks keep key `j` for query `i` when `j <= i` (top-left aligned,
as eager). A boolean mask keeps `True` positions; a floating mask is added to the scores.

NOTE [fully masked rows]: eager returns zeros (and zero gradients) for a query row whose keys
are all masked out. The softmax here subtracts a row maximum replaced by 0 when it is `-inf`
and divides by a row sum replaced by 1 when it is 0, so such rows give exact zeros too, and the
backward never divides 0 by 0.

NOTE [attention dropout]: on CPU eager runs a call with `dropout_p > 0` on its math backend
(the flash kernel refuses dropout), which applies `at::dropout` to the softmax weights: a mask
`empty_like(weights).bernoulli_(1 - p)` from the global generator, divided by `1 - p`, times
the weights. The decomposition draws the same mask with `prims.bernoulli` at the same point,
so the numbers drawn are eager's. The autodiff transform differentiates such a call through its
decomposition (a random decomposition is never recomputed by a rule), so the backward reuses
the very mask; its softmax is `safe_softmax` (`torch._safe_softmax`, as eager's), whose rule
reads the kept weights instead of transposing the max, exp and sum. CUDA (Philox inside the fused kernels) and `p` outside (0, 1) run the op whole.
"""

from __future__ import annotations

import math
from numbers import Number

import torch
import torch.nn.functional as F

from fulmen.core import NotYetSupportedError
from fulmen.ops import prims
from fulmen.ops.torch.base import torch_op
from fulmen.ops.torch.reductions import expand_reduced
from fulmen.ops.torch.utils import broadcast_shapes, to_dtype


def _unsupported(message: str) -> NotYetSupportedError:
    return NotYetSupportedError(message, op="ltorch.scaled_dot_product_attention")


def _transpose_last(t):
    dims = list(range(t.ndim))
    dims[-1], dims[-2] = dims[-2], dims[-1]
    return prims.permute(t, tuple(dims))


def _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> None:
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) and t.ndim >= 2 for t in tensors):
        raise _unsupported("query, key and value must be tensors of rank >= 2")
    if len({t.dtype for t in tensors}) != 1 or query.dtype not in (torch.float32, torch.float64):
        raise _unsupported("query, key and value must share a float32/float64 dtype")
    if not (query.shape[:-2] == key.shape[:-2] == value.shape[:-2]) and not _grouped(
            query, key, value, enable_gqa):
        raise _unsupported("batch dims differ (broadcast, or grouped-query attention without "
                           "enable_gqa or with key and value head counts that differ)")
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise _unsupported("embedding or sequence sizes differ (eager raises)")
    if dropout_p != 0.0 and not _math_dropout(tensors, attn_mask, dropout_p):
        raise _unsupported("dropout_p > 0 off the CPU, or outside (0, 1): the op runs whole")
    if is_causal and attn_mask is not None:
        raise _unsupported("attn_mask together with is_causal (eager raises)")
    if scale is not None and (not isinstance(scale, Number) or isinstance(scale, complex)):
        raise _unsupported(f"scale={scale!r}")
    if not isinstance(enable_gqa, bool) or 0 in query.shape or 0 in key.shape:
        raise _unsupported("enable_gqa must be a bool; empty inputs run whole")


def _math_dropout(tensors, attn_mask, dropout_p) -> bool:
    """Whether eager runs this call with dropout on its math backend (NOTE [attention
    dropout]): CPU tensors (the flash kernel refuses dropout there) and `0 < p < 1`."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        return False
    devices = {t.device.type for t in (*tensors, attn_mask) if isinstance(t, torch.Tensor)}
    return devices == {"cpu"} and 0.0 < dropout_p < 1.0


def _grouped(query, key, value, enable_gqa) -> bool:
    """Grouped-query attention as eager takes it (`enable_gqa=True`): key and value have
    `H // k` heads of the query's `H` (dim -3), each shared by `k` query heads."""
    if enable_gqa is not True or min(query.ndim, key.ndim, value.ndim) < 3:
        return False
    heads, groups = _constant(query.shape[-3]), _constant(key.shape[-3])
    return (heads is not None and groups is not None and groups > 0 and heads % groups == 0
            and _constant(value.shape[-3]) == groups
            and query.shape[:-3] == key.shape[:-3] == value.shape[:-3])


def _constant(size) -> int | None:
    """`size` as an int when it is one (a symbolic size whose expression is a number, such
    as the heads of `view(b, s, -1, 8)`, included), else None."""
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return size


def _repeat_heads(t, heads: int):
    """`t.repeat_interleave(heads // t.shape[-3], dim=-3)`, as eager's grouped-query attention
    shares each key/value head among consecutive query heads."""
    *batch, groups, rows, cols = t.shape
    groups = _constant(groups)
    if groups == heads:
        return t
    lead = len(batch)
    wide = prims.broadcast_in_dim(t, (*batch, groups, heads // groups, rows, cols),
                                  (*range(lead + 1), lead + 2, lead + 3))
    return prims.reshape(wide, (*batch, heads, rows, cols))


def _mask_scores(scores, attn_mask, is_causal: bool):
    """Scores with masked positions at -inf (bool/causal) or the float mask added."""
    shape = tuple(scores.shape)
    rows, cols = shape[-2], shape[-1]
    if is_causal:
        row = prims.broadcast_in_dim(prims.iota(rows, 0, 1, torch.int64, scores.device),
                                     (rows, cols), (0,))
        col = prims.broadcast_in_dim(prims.iota(cols, 0, 1, torch.int64, scores.device),
                                     (rows, cols), (1,))
        attn_mask = prims.le(col, row)
    if attn_mask is None:
        return scores
    if not isinstance(attn_mask, torch.Tensor):
        raise _unsupported("attn_mask must be a tensor")
    if broadcast_shapes(shape, attn_mask.shape) != shape:
        raise _unsupported("attn_mask does not broadcast to the scores")
    mask = prims.broadcast_in_dim(attn_mask, shape, tuple(range(len(shape) - attn_mask.ndim,
                                                                 len(shape))))
    if mask.dtype == torch.bool:  # (a number, not a full tensor: nothing allocated or read)
        return prims.where(mask, scores, -math.inf)
    if mask.dtype != scores.dtype:
        raise _unsupported("a floating attn_mask must have the query's dtype")
    return prims.add(scores, mask)


@torch_op(torch._safe_softmax, name="safe_softmax")
def safe_softmax(input, dim, dtype=None):
    """`torch._safe_softmax`, the softmax eager's attention runs: along `dim`, after converting
    to `dtype` if given; rows of all -inf give zeros (NOTE [fully masked rows]).

    Its VJP is softmax's (`y * (g - sum(g * y))`, `rules_composite.py`), as eager's derivative
    of `_safe_softmax`: the backward of attention with dropout, which is differentiated through
    this decomposition (NOTE [attention dropout]), needs one row reduction instead of the
    transposes of the max, exp and sum below."""
    if not isinstance(dim, int) or isinstance(dim, bool) or input.ndim == 0:
        raise _unsupported(f"_safe_softmax with dim={dim!r} on a rank {input.ndim} tensor")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise _unsupported(f"_safe_softmax with dtype={dtype!r}")
        input = to_dtype(input, dtype)
    if input.dtype not in (torch.float32, torch.float64) or input.numel() == 0:
        raise _unsupported("_safe_softmax of a float16/bfloat16, non-float or empty tensor")
    shape, dims = tuple(input.shape), (dim % input.ndim,)
    top = prims.amax(input, dims)
    top = prims.where(prims.eq(top, -math.inf), 0.0, top)
    exps = prims.exp(prims.sub(input, expand_reduced(top, shape, dims)))
    total = prims.sum(exps, dims)
    total = prims.where(prims.eq(total, 0.0), 1.0, total)
    return prims.div(exps, expand_reduced(total, shape, dims))


@torch_op(F.scaled_dot_product_attention)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention`: query (..., L, E), key (..., S, E), value (..., S, Ev)
    -> (..., L, Ev); `scale` defaults to `1 / sqrt(E)`; dropout on CPU as eager draws it (NOTE
    [attention dropout])."""
    _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    heads = _constant(query.shape[-3]) if query.ndim >= 3 else None
    if heads is not None and _constant(key.shape[-3]) != heads:  # grouped-query (`_grouped`)
        key, value = _repeat_heads(key, heads), _repeat_heads(value, heads)
    scores = prims.mul(prims.matmul(query, _transpose_last(key)), scale)
    weights = safe_softmax(_mask_scores(scores, attn_mask, is_causal), -1)
    if dropout_p != 0.0:  # NOTE [attention dropout]
        keep = 1.0 - float(dropout_p)
        noise = prims.bernoulli(tuple(weights.shape), keep, weights.dtype, weights.device, None)
        weights = prims.mul(weights, prims.div(noise, keep))
    return prims.matmul(weights, value)
