"""Boolean attention masks made additive once, where eager would convert them per call.

Given a boolean `attn_mask`, eager's `F.scaled_dot_product_attention` first converts it to an
additive mask of the query's dtype (`convert_boolean_attn_mask`: `where(mask, 0, -inf)`, two
`scalar_tensor`s and a `where` over the whole `(B, 1, L, S)` mask) and then runs its kernel on
that. An HF decoder builds one boolean mask and passes it to every layer, so eager (and a
trace that calls the op whole) converts the same mask once per layer: at 32 layers of 2,048
tokens that is 32 passes over 4M elements per forward.

`additive_attention_masks` converts the mask in the trace instead, `where(mask, full(0), -inf)`
in the query's dtype (the conversion the flash saving forward already spells,
`transforms/autodiff/rules_attention.py`), and passes the result to the call. The statements
are the same for every call on that mask and dtype, so cse keeps one conversion for all
layers, and a fusing executor may fuse it with the mask's producers.

Only calls where eager runs the CPU flash kernel are rewritten (`eager_picks_flash`: CPU, 4-d,
no dropout, the backend PyTorch would choose): the kernel then receives exactly the mask eager
would have passed it, so outputs and gradients are eager's bit for bit (fully masked rows
included). Elsewhere the boolean mask stays: eager's math backend treats a boolean mask
itself, not its conversion.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fulmen.core import BoundSymbol, Trace, TraceCtx, tracing
from fulmen.core.names import NameAllocator
from fulmen.core.trace import reserved_names
from fulmen.ops import ltorch, prims
from fulmen.ops.kernel_layouts import attention_arguments
from fulmen.ops.opaque import opaque_symbol
from fulmen.proxies.tensor import TensorProxy, requires_grad_of
from fulmen.transforms.autodiff.rules_attention import eager_picks_flash
from fulmen.transforms.base import transform
from fulmen.transforms.grouped_attention import standing_in_for

__all__ = ["additive_attention_masks"]


def _attention_symbols() -> tuple:
    """The symbols an attention call is recorded as: the torch-level op (float32/float64,
    static sizes) and the opaque op run whole (bfloat16, float16, symbolic head counts)."""
    return ltorch.scaled_dot_product_attention, opaque_symbol(F.scaled_dot_product_attention)


def _converted_call(bsym: BoundSymbol, requires: set[str],
                    names: NameAllocator) -> list[BoundSymbol] | None:
    """The statements converting `bsym`'s boolean mask followed by `bsym` recorded anew on
    the converted mask, or None when the call is not rewritten (module docstring)."""
    bound = attention_arguments(bsym.args, bsym.kwargs)
    query, key, value, mask = (bound.get(name) for name in ("query", "key", "value",
                                                              "attn_mask"))
    dropout_p, is_causal = bound.get("dropout_p", 0.0), bound.get("is_causal", False)
    if not isinstance(mask, TensorProxy) or mask.dtype != torch.bool or is_causal is not False \
            or not all(isinstance(t, TensorProxy) for t in (query, key, value)) \
            or not query.dtype.is_floating_point \
            or type(dropout_p) not in (int, float) or dropout_p != 0.0:
        return None
    if not eager_picks_flash(query, key, value, mask, dropout_p, is_causal,
                             bound.get("scale"), bound.get("enable_gqa", False), requires):
        return None
    ctx = TraceCtx("additive attention mask")
    ctx.names = names
    with tracing(ctx):
        zeros = prims.full(tuple(mask.shape), 0.0, query.dtype, mask.device)
        additive = prims.where(mask, zeros, -math.inf)
        bound["attn_mask"] = additive
        tensors = [bound.pop(name) for name in ("query", "key", "value")]
        output = bsym.sym(*tensors, **bound)
    *conversion, call = ctx.bsyms
    return [*(b.replace(source=bsym.source) for b in conversion),
            standing_in_for(call, output, bsym)]


@transform("additive attention masks")
def additive_attention_masks(trace: Trace) -> Trace:
    """`trace` with the boolean mask of each CPU flash attention call converted to an additive
    mask by statements of the trace (module docstring). Returns `trace` itself when no call
    is rewritten."""
    symbols = _attention_symbols()
    calls = [b for b in trace.bsyms if b.sym in symbols]
    if not calls:
        return trace
    requires = {p.name for b in trace.bsyms for p in b.proxy_outputs
                if isinstance(p, TensorProxy) and requires_grad_of(p)}
    requires |= {p.name for p in trace.args if isinstance(p, TensorProxy) and requires_grad_of(p)}
    names = reserved_names(trace.args, trace.bsyms)
    rewritten: dict[int, list[BoundSymbol]] = {}
    for bsym in calls:
        statements = _converted_call(bsym, requires, names)
        if statements is not None:
            rewritten[id(bsym)] = statements
    if not rewritten:
        return trace
    bsyms = []
    for bsym in trace.bsyms:
        bsyms.extend(rewritten.get(id(bsym), (bsym,)))
    return trace.replace(bsyms=tuple(bsyms))
