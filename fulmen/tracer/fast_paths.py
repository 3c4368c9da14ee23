"""Eager results of PyTorch's inference fast paths that a trace cannot take.

`nn.TransformerEncoder` in eval mode, called with a key padding mask and without grad, runs
its layers on a nested tensor and pads the result back with zeros: every position the mask pads
holds 0 (the final norm, if any, then sees those zeros). Traced with proxies its `forward` takes
the regular path (a proxy has `__torch_function__`, which the fast path refuses), and that path
computes the padded positions like any other row, so the compiled result differed from eager
there (torch.compile differs the same way). While tracing, a global forward hook (each encoder
the traced module or function calls) replaces those positions as eager's fast path leaves them, under the conditions of PyTorch's own
`TransformerEncoder.forward` (its `why_not_sparsity_fast_path` checks).

`nn.MultiheadAttention` with `batch_first=True` differs in layout: its fast path
(`torch._native_multi_head_attention`) returns a new row-major (batch, seq, embed) tensor, the
regular path a transposed view of a (seq, batch, embed) one, so user code that views the
attention output (`out.view(-1, embed)`) worked in eager and raised when traced. A forward
hook gives the output eager's row-major layout under the fast path's conditions
(`_mha_takes_fast_path`). On CPU both fast paths (`torch._native_multi_head_attention` without
weights, `torch._transformer_encoder_layer_fwd`) give NaN on a query row whose keys are all
masked (left padding under a causal mask, a sequence all padding), where the regular path
computes numbers; the hooks put NaN there (`_fully_masked_rows`). Elsewhere the regular path's
values and layouts are eager's, and nothing is changed.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

import torch

_DEVICES = ("cpu", "cuda", "xpu")


def _argument(args: tuple, kwargs: dict, position: int, name: str):
    return args[position] if len(args) > position else kwargs.get(name)


def _takes_nested_path(encoder: torch.nn.TransformerEncoder, src, mask, padded) -> bool:
    """Whether eager's `encoder.forward(src, mask, src_key_padding_mask=...)` converts `src` to
    a nested tensor, `padded` being the positions that mask pads (PyTorch 2.x's conditions, in
    its order; the left-alignment check reads the mask's values, a graph break with a guard
    when traced)."""
    first = encoder.layers[0]
    if not (torch.backends.mha.get_fastpath_enabled() and getattr(encoder, "use_nested_tensor",
                                                                  False)):
        return False
    if first.training or src.dim() != 3 or padded is None or mask is not None:
        return False
    if torch.is_autocast_enabled() or src.device.type not in _DEVICES:
        return False
    weights = (first.self_attn.in_proj_weight, first.self_attn.in_proj_bias,
               first.self_attn.out_proj.weight, first.self_attn.out_proj.bias,
               first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
               first.linear1.weight, first.linear1.bias, first.linear2.weight,
               first.linear2.bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (src, *weights)):
        return False
    if getattr(encoder, "mask_check", True):
        return bool(torch._nested_tensor_from_mask_left_aligned(src, padded.logical_not()))
    return True


def _padded(padding: torch.Tensor) -> torch.Tensor:
    """The positions a key padding mask pads (True, or a nonzero additive value)."""
    return padding if padding.dtype == torch.bool else padding != 0


def _zero_padded_positions(encoder, args, kwargs, output):
    src = _argument(args, kwargs, 0, "src")
    mask = _argument(args, kwargs, 1, "mask")
    padding = _argument(args, kwargs, 2, "src_key_padding_mask")
    padded = _padded(padding) if padding is not None else None
    if not isinstance(output, torch.Tensor) or not _takes_nested_path(encoder, src, mask,
                                                                       padded):
        return None
    filler = output.new_zeros(output.shape[-1])
    if encoder.norm is not None:
        filler = encoder.norm(filler)
    return torch.where(padded.unsqueeze(-1), filler, output)


def _mha_takes_fast_path(attention: torch.nn.MultiheadAttention, args, kwargs) -> bool:
    """Whether eager's `attention(query, key, value, ...)` returns the result of
    `torch._native_multi_head_attention` (PyTorch 2.x's `why_not_fast_path` checks, in its
    order; a proxy's `__torch_function__`, which makes eager's own check refuse, left out)."""
    query = _argument(args, kwargs, 0, "query")
    key = _argument(args, kwargs, 1, "key")
    value = _argument(args, kwargs, 2, "value")
    weight, bias = attention.in_proj_weight, attention.in_proj_bias
    masks = (_argument(args, kwargs, 5, "attn_mask"),
             _argument(args, kwargs, 3, "key_padding_mask"))
    if any(isinstance(mask, torch.Tensor) and mask.is_floating_point() for mask in masks):
        return False
    if not (torch.backends.mha.get_fastpath_enabled() and isinstance(query, torch.Tensor)):
        return False
    if query.dim() != 3 or query is not key or key is not value:
        return False
    if weight is None or bias is None or query.dtype != weight.dtype or query.dtype != bias.dtype:
        return False
    if attention.training or attention.num_heads % 2 or not attention.batch_first:
        return False
    if attention.bias_k is not None or attention.bias_v is not None or attention.add_zero_attn:
        return False
    if not attention._qkv_same_embed_dim or query.is_nested or torch.is_autocast_enabled():
        return False
    tensors = (query, weight, bias, attention.out_proj.weight, attention.out_proj.bias)
    if any(t is not None and t.device.type not in _DEVICES for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                for t in tensors))


def _fully_masked_rows(attention, query, attn_mask, padding):
    """(batch, query position): True where some head's every key is masked (by the key padding
    mask or the boolean attention mask), None without masks."""
    batch, length = query.shape[0], query.shape[1]
    masked = None
    if padding is not None:
        masked = padding.reshape(batch, 1, 1, padding.shape[-1])
    if attn_mask is not None:
        heads = (1, 1) if attn_mask.dim() == 2 else (batch, attention.num_heads)
        mask = attn_mask.reshape(*heads, length, attn_mask.shape[-1])
        masked = mask if masked is None else masked | mask
    return None if masked is None else masked.all(-1).any(1)


def _fast_path_attention(attention, args, kwargs, output):
    """Eager's fast-path result of `nn.MultiheadAttention`: row-major, and on CPU without
    weights NaN on every row whose keys some head masks all (its softmax of -inf alone),
    where the regular path's attention gives zeros."""
    if not (isinstance(output, tuple) and len(output) == 2
            and isinstance(output[0], torch.Tensor)
            and _mha_takes_fast_path(attention, args, kwargs)):
        return None
    out = output[0].contiguous()
    need_weights = _argument(args, kwargs, 4, "need_weights")
    if out.device.type == "cpu" and need_weights is False:
        rows = _fully_masked_rows(attention, out, _argument(args, kwargs, 5, "attn_mask"),
                                  _argument(args, kwargs, 3, "key_padding_mask"))
        if rows is not None:
            out = torch.where(rows.unsqueeze(-1), float("nan"), out)
    return out, output[1]


def _layer_takes_fast_path(layer: torch.nn.TransformerEncoderLayer, src) -> bool:
    """Whether eager's `layer(src, ...)` returns `torch._transformer_encoder_layer_fwd`'s
    result (PyTorch 2.x's `why_not_sparsity_fast_path` checks; a proxy's
    `__torch_function__` left out)."""
    attention = layer.self_attn
    if not (torch.backends.mha.get_fastpath_enabled() and isinstance(src, torch.Tensor)):
        return False
    if src.dim() != 3 or src.is_nested or layer.training or not attention.batch_first:
        return False
    if attention.in_proj_bias is None or not attention._qkv_same_embed_dim:
        return False
    if not layer.activation_relu_or_gelu or layer.norm1.eps != layer.norm2.eps:
        return False
    if attention.num_heads % 2 or torch.is_autocast_enabled():
        return False
    if any(sub._forward_hooks or sub._forward_pre_hooks for sub in layer.modules()):
        return False
    tensors = (src, *(t for sub in (attention, attention.out_proj, layer.norm1, layer.norm2,
                                    layer.linear1, layer.linear2)
                      for t in sub.parameters(recurse=False)))
    if any(t.device.type not in _DEVICES for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _masked(mask):
    """The positions a boolean or additive mask masks (True, or -inf)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask == float("-inf")


def _fast_path_layer(layer, args, kwargs, output):
    """Eager's fast-path result of `nn.TransformerEncoderLayer` on CPU: NaN on every row whose
    keys some head masks all, where the regular path's attention gives numbers."""
    src = _argument(args, kwargs, 0, "src")
    if not (isinstance(output, torch.Tensor) and output.device.type == "cpu"
            and _layer_takes_fast_path(layer, src)):
        return None
    rows = _fully_masked_rows(layer.self_attn, output,
                              _masked(_argument(args, kwargs, 1, "src_mask")),
                              _masked(_argument(args, kwargs, 2, "src_key_padding_mask")))
    return None if rows is None else torch.where(rows.unsqueeze(-1), float("nan"), output)


_HOOKS = ((torch.nn.TransformerEncoder, _zero_padded_positions),
          (torch.nn.MultiheadAttention, _fast_path_attention),
          (torch.nn.TransformerEncoderLayer, _fast_path_layer))

_TRACING = contextvars.ContextVar("fulmen_eager_fast_paths", default=False)
_KEY = "fulmen.eager_fast_paths"  # the hook's key in PyTorch's global hook dicts (no handle)
_USERS = [0]  # traces inside `eager_fast_paths`, in every thread
_LOCK = threading.Lock()
_MODULE = torch.nn.modules.module


def _eager_result(module, args, kwargs, output):
    """The global forward hook: eager's fast-path result for a module called while this
    thread traces (None, the output unchanged, elsewhere)."""
    if not _TRACING.get():
        return None
    for kind, hook in _HOOKS:
        if isinstance(module, kind):
            return hook(module, args, kwargs, output)
    return None


@contextlib.contextmanager
def eager_fast_paths() -> Iterator[None]:
    """While tracing: each `nn.TransformerEncoder` called gives eager's fast-path result (zeros
    where the key padding mask pads), each `nn.MultiheadAttention` its fast path's row-major
    output, each `nn.TransformerEncoderLayer` its NaN rows. A global forward hook, so a module
    a jitted *function* calls is covered as well as the jitted module's own (hooks on the
    jitted module's submodules missed `fulmen.jit(lambda x: encoder(x, ...))`, whose padded
    positions differed from eager). It is put into PyTorch's global hook dict directly and
    taken out after (no handle), so hook watchers see no change; other threads' calls are
    left alone."""
    token = _TRACING.set(True)
    with _LOCK:
        _USERS[0] += 1
        _MODULE._global_forward_hooks[_KEY] = _eager_result
        _MODULE._global_forward_hooks_with_kwargs[_KEY] = True
    try:
        yield
    finally:
        _TRACING.reset(token)
        with _LOCK:
            _USERS[0] -= 1
            if not _USERS[0]:
                _MODULE._global_forward_hooks.pop(_KEY, None)
                _MODULE._global_forward_hooks_with_kwargs.pop(_KEY, None)
