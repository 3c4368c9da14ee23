"""The VJP of `F.scaled_dot_product_attention`: eager's own attention backward.

Without a rule, the backward of attention recomputes the op's decomposition (`q k^T`, the mask
as a `-inf` fill, a softmax) and transposes every prim: a chain of matmuls, full-size
`(..., L, S)` temporaries and row reductions per layer. Eager instead runs one fused backward
kernel (on CPU `_scaled_dot_product_flash_attention_for_cpu_backward`, which walks the scores
block by block and never materialises them) from the forward's output and log-sum-exp.

Where eager picks that flash kernel (CPU, no mask requiring grad; asked of PyTorch's own
backend choice), the saving forward below runs the very op eager's `F.scaled_dot_product_attention`
runs, `_scaled_dot_product_flash_attention_for_cpu` (a boolean mask converted to `0`/`-inf` as
eager converts it), and keeps its output and log-sum-exp (`(..., L)` floats, 1/E of the output)
for the backward, which calls the flash backward op directly: forward values and gradients are
eager's bit for bit, and the forward is not recomputed. Other call sites (CUDA, masks requiring
grad, backends other than flash) run the op whole in the forward; their rule below runs eager's
op under `torch.autograd` in the backward: it recomputes the forward with eager's kernel and
calls eager's backward, so gradients are eager's for every backend eager picks (fully masked
rows included). Either way the residuals are the op's inputs (query, key, value, mask), never
the `(..., L, S)` weights. Calls with `dropout_p > 0` never reach these: on CPU the autodiff
transform differentiates their decomposition, which draws eager's dropout mask (NOTE [attention
dropout] in `ops/torch/attention.py`); elsewhere the op runs opaquely with its autograd graph
kept from the forward.
"""

from __future__ import annotations

import math

import torch

from fulmen.ops import ltorch, prims
from fulmen.ops.opaque import opaque_symbol
from fulmen.ops.torch_autograd import AUTOGRAD_VJP, _per_argument, _primal_leaves
from fulmen.proxies.tensor import size_hints
from fulmen.transforms.autodiff.registry import bound_arguments, saving_forward, vjp_rule

FLASH_FORWARD = opaque_symbol(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
FLASH_BACKWARD = opaque_symbol(
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


@vjp_rule(ltorch.scaled_dot_product_attention)
def _scaled_dot_product_attention_vjp(grad, out, query, key, value, attn_mask, dropout_p,
                                      is_causal, scale, enable_gqa):
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    kwargs = {"scale": scale, "enable_gqa": enable_gqa}  # keyword-only in F's signature
    grads = AUTOGRAD_VJP(ltorch.scaled_dot_product_attention, args, kwargs, grad)
    return tuple(_per_argument([*args, scale, enable_gqa], _primal_leaves(args, kwargs), grads))


def _stand_in(proxy, requires: set[str]) -> torch.Tensor:
    """An uninitialised CPU tensor with `proxy`'s metadata (backend choice reads no values);
    symbolic sizes take the traced call's values (a choice made without a guard: either
    backend computes the same attention)."""
    tensor = torch.empty_strided(size_hints(proxy.shape), size_hints(proxy.stride()),
                                 dtype=proxy.dtype)
    return tensor.requires_grad_(proxy.name in requires and proxy.dtype.is_floating_point)


def eager_picks_flash(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      requires: set[str]) -> bool:
    """Whether eager's `F.scaled_dot_product_attention` runs the CPU flash kernel for this call
    (PyTorch's own choice, asked on stand-ins with the same metadata and requires_grad)."""
    tensors = [t for t in (query, key, value, attn_mask) if t is not None]
    if any(t.device.type != "cpu" for t in tensors) or query.ndim != 4 or dropout_p != 0.0:
        return False
    if attn_mask is not None and attn_mask.name in requires:
        return False  # eager takes the math backend
    q, k, v = (_stand_in(t, requires) for t in (query, key, value))
    mask = _stand_in(attn_mask, requires) if attn_mask is not None else None
    choice = torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale,
                                     enable_gqa=enable_gqa)
    return choice == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


@saving_forward(ltorch.scaled_dot_product_attention)
def _scaled_dot_product_attention_saving(bsym, requires: set[str]):
    """The flash forward keeping its log-sum-exp, and a backward calling the flash backward
    (module docstring)."""
    values = bound_arguments(bsym.sym, bsym.args, bsym.kwargs)
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = values
    if not eager_picks_flash(query, key, value, attn_mask, dropout_p, is_causal, scale,
                             enable_gqa, requires):
        return None
    mask = attn_mask
    if mask is not None and mask.dtype == torch.bool:  # as eager's convert_boolean_attn_mask
        zeros = prims.full(tuple(mask.shape), 0.0, query.dtype, mask.device)
        mask = prims.where(mask, zeros, -math.inf)
    out, logsumexp = FLASH_FORWARD(query, key, value, 0.0, is_causal, attn_mask=mask,
                                   scale=scale)

    def backward(grad, output):
        grads = FLASH_BACKWARD(grad, query, key, value, output, logsumexp, 0.0, is_causal,
                               attn_mask=mask, scale=scale)
        return (*grads, None, None, None, None, None)

    return out, backward
