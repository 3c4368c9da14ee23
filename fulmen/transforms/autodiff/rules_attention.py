"""The VJP of `F.scaled_dot_product_attention`: eager's own attention backward.

Without a rule, the backward of attention recomputes the op's decomposition (`q k^T`, the mask
as a `-inf` fill, a softmax) and transposes every prim: a chain of matmuls, full-size
`(..., L, S)` temporaries and row reductions per layer. Eager instead runs one fused backward
kernel (on CPU `_scaled_dot_product_flash_attention_for_cpu_backward`, which walks the scores
block by block and never materialises them). The rule below runs eager's op under
`torch.autograd` in the backward: it recomputes the forward with eager's kernel (which also
yields the log-sum-exp the fused backward needs) and calls eager's backward, so gradients are
eager's for every backend eager picks (flash, or math where flash declines: a mask that requires
grad, unusual shapes), fully masked rows included.

The forward still runs the op whole (eager's kernel), so the forward values are eager's too;
the residuals are the op's inputs (query, key, value, mask), not the `(..., L, S)` weights.
Calls with `dropout_p > 0` never reach this rule: their decomposition is refused, and the op
runs opaquely with its autograd graph kept from the forward.
"""

from __future__ import annotations

from fulmen.ops import ltorch
from fulmen.transforms.autodiff.registry import vjp_rule
from fulmen.transforms.autodiff.rules import AUTOGRAD_VJP, _per_argument, _primal_leaves


@vjp_rule(ltorch.scaled_dot_product_attention)
def _scaled_dot_product_attention_vjp(grad, out, query, key, value, attn_mask, dropout_p,
                                      is_causal, scale, enable_gqa):
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    kwargs = {"scale": scale, "enable_gqa": enable_gqa}  # keyword-only in F's signature
    grads = AUTOGRAD_VJP(ltorch.scaled_dot_product_attention, args, kwargs, grad)
    return tuple(_per_argument([*args, scale, enable_gqa], _primal_leaves(args, kwargs), grads))
