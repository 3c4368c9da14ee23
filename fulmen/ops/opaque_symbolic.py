"""Outputs of the opaque aten ops that fulmen's own gradient rules call (and of `torch.arange`
over a symbolic range), described without fake tensors where a size or stride is symbolic.

NOTE [opaque aten ops with symbolic sizes]: `run_meta` describes an opaque op with symbolic
sizes by running it on fake tensors of the trace's ShapeEnv, and for `_log_softmax` and
`nll_loss_forward` PyTorch's fake tensors run the op's Python decomposition op by op (tens of
milliseconds each; with the flash attention and embedding backward kernels, about a fifth of
the symbolic retrace of a tiny HF GPT-2 or Llama training step). The rules here state what
PyTorch's meta kernels return for the calls those gradient rules make (shape, dtype, strides,
each a direct function of the arguments' metadata) and answer only where that is known
without recording a guard; every other call (static sizes, other arguments, a check the meta
kernel would make that is not known to hold) goes to `run_meta`, which describes and checks it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from fulmen.ops.elementwise_layout import _row_major_strides
from fulmen.ops.meta import run_meta
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import known_same_shape

aten = torch.ops.aten


def _symbolic(*tensors) -> bool:
    return any(isinstance(v, torch.SymInt) for t in tensors if isinstance(t, torch.Tensor)
               for v in (*t.shape, *t.stride()))


def _proxy(shape, dtype: torch.dtype, device, strides=None) -> TensorProxy:
    """A new output proxy laid out by `strides` (row-major when None), marked as a meta
    kernel's answer (as `run_meta` marks its outputs)."""
    shape = tuple(shape)
    proxy = TensorProxy(None, shape, dtype, device,
                        strides=_row_major_strides(shape) if strides is None else tuple(strides))
    proxy._fulmen_exact_strides = True
    return proxy


def _log_softmax_meta(fn, input, dim, half_to_float, **kwargs):
    """PyTorch's `_log_softmax` meta: the input's shape, row-major, the input's dtype."""
    if kwargs or half_to_float or not _symbolic(input) or type(dim) is not int \
            or not input.dtype.is_floating_point \
            or not -max(input.ndim, 1) <= dim < max(input.ndim, 1):
        return run_meta(fn, input, dim, half_to_float, **kwargs)
    return _proxy(input.shape, input.dtype, input.device)


def _nll_loss_forward_meta(fn, input, target, weight, reduction, ignore_index, **kwargs):
    """PyTorch's `nll_loss_forward` for (C,) or (N, C) log-probabilities: the loss ((N,) for
    `reduction="none"` of (N, C), else a scalar) and the total weight (a scalar), both in the
    input's dtype; only where the meta kernel's checks hold without a guard."""
    args = (input, target, weight, reduction, ignore_index)
    if kwargs or not _symbolic(input, target, weight) or input.ndim not in (1, 2) \
            or not input.dtype.is_floating_point or target.dtype != torch.int64 \
            or target.ndim != input.ndim - 1 or reduction not in (0, 1, 2) \
            or type(ignore_index) is not int:
        return run_meta(fn, *args, **kwargs)
    if input.ndim == 2 and not known_same_shape((input.shape[0],), (target.shape[0],)):
        return run_meta(fn, *args, **kwargs)
    if weight is not None and not (weight.ndim == 1 and weight.dtype == input.dtype
                                   and known_same_shape((weight.shape[0],), (input.shape[-1],))):
        return run_meta(fn, *args, **kwargs)
    shape = (input.shape[0],) if reduction == 0 and input.ndim == 2 else ()
    return _proxy(shape, input.dtype, input.device), _proxy((), input.dtype, input.device)


def _embedding_dense_backward_meta(fn, grad, indices, num_weights, padding_idx,
                                   scale_grad_by_freq, **kwargs):
    """PyTorch's `embedding_dense_backward` meta: `grad.new_empty((num_weights, grad.size(-1)))`."""
    if kwargs or not _symbolic(grad, indices) or grad.ndim < 1 \
            or not isinstance(num_weights, (int, torch.SymInt)):
        return run_meta(fn, grad, indices, num_weights, padding_idx, scale_grad_by_freq,
                        **kwargs)
    return _proxy((num_weights, grad.shape[-1]), grad.dtype, grad.device)


def _dense_strides(tensor) -> tuple | None:
    """`tensor`'s strides where it is known without a guard to be a permutation of a row-major
    layout (non-overlapping and dense: `torch.empty_like` then keeps its strides), else None."""
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    for order in itertools.permutations(range(len(shape))):  # innermost dim last
        expected = 1
        for d in reversed(order):
            if not known_same_shape((strides[d],), (expected,)):
                break
            expected = expected * shape[d]
        else:
            return strides
    return None


def _flash_forward_meta(fn, query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None,
                        scale=None, **kwargs):
    """PyTorch's `_scaled_dot_product_flash_attention_for_cpu` meta: the output is
    `empty_like(query)` (the query's strides for a dense query), the log-sum-exp a
    `(batch, length, heads)` tensor in the computation dtype, transposed to
    `(batch, heads, length)`."""
    args = (query, key, value, dropout_p, is_causal)
    kwargs = {**kwargs, "attn_mask": attn_mask, "scale": scale}  # keyword-only in the schema
    strides = _dense_strides(query) if isinstance(query, TensorProxy) and query.ndim == 4 \
        else None
    if len(kwargs) > 2 or strides is None or not _symbolic(query, key, value, attn_mask) \
            or not all(isinstance(t, TensorProxy) and t.ndim == 4 for t in (key, value)):
        return run_meta(fn, *args, **kwargs)
    batch, heads, length = query.shape[:3]
    lse_strides = _row_major_strides((batch, length, heads))
    dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    return (_proxy(query.shape, query.dtype, query.device, strides),
            _proxy((batch, heads, length), dtype, query.device,
                   (lse_strides[0], lse_strides[2], lse_strides[1])))


def _flash_backward_meta(fn, grad, query, key, value, out, logsumexp, dropout_p, is_causal,
                         attn_mask=None, scale=None, **kwargs):
    """PyTorch's `_scaled_dot_product_flash_attention_for_cpu_backward` meta: each gradient
    has its primal's shape and dtype, laid out `(batch, length, heads, width)` and permuted
    to `(batch, heads, length, width)`."""
    args = (grad, query, key, value, out, logsumexp, dropout_p, is_causal)
    kwargs = {**kwargs, "attn_mask": attn_mask, "scale": scale}  # keyword-only in the schema
    qkv = (query, key, value)
    if len(kwargs) > 2 or not _symbolic(grad, *qkv, out, logsumexp, attn_mask) \
            or not all(isinstance(t, TensorProxy) and t.ndim == 4 for t in qkv):
        return run_meta(fn, *args, **kwargs)
    grads = []
    for t in qkv:
        b, h, n, w = t.shape
        physical = _row_major_strides((b, n, h, w))
        grads.append(_proxy(t.shape, t.dtype, t.device,
                            (physical[0], physical[2], physical[1], physical[3])))
    return tuple(grads)


def _arange_meta(fn, *args, **kwargs):
    """`torch.arange(end)` / `torch.arange(start, end)` of integers, one of them symbolic
    (HF's `cache_position`, `arange(past, past + length)`): `end - start` int64 elements,
    where that is known positive without a guard; other calls go to the meta kernel."""
    if not 1 <= len(args) <= 2 or not set(kwargs) <= {"device", "dtype"} \
            or kwargs.get("dtype") not in (None, torch.int64) \
            or not all(type(v) is int or isinstance(v, torch.SymInt) for v in args) \
            or not any(isinstance(v, torch.SymInt) for v in args):
        return run_meta(fn, *args, **kwargs)
    start, end = (0, *args) if len(args) == 1 else args
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    length = end - start
    if not statically_known_true(length >= 1):
        return run_meta(fn, *args, **kwargs)
    device = kwargs.get("device")
    device = torch.get_default_device() if device is None else torch.device(device)
    return _proxy((length,), torch.int64, device)


# op -> its description with symbolic sizes (`opaque._META_OVERRIDES` merges these)
SYMBOLIC_METAS: dict[Callable, Callable] = {
    torch.arange: _arange_meta,
    aten._log_softmax.default: _log_softmax_meta,
    aten.nll_loss_forward.default: _nll_loss_forward_meta,
    aten.embedding_dense_backward.default: _embedding_dense_backward_meta,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_forward_meta,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_backward_meta,
}
