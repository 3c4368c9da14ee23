"""Grouped-query attention with its key and value heads read in place.

HF models (`repeat_kv`: `k[:, :, None].expand(b, g, r, s, d).reshape(b, g * r, s, d)`) and
litgpt (`k.repeat_interleave(r, dim=1)`) repeat each key/value head for the `r` query heads
sharing it before calling `F.scaled_dot_product_attention` (HF passes `enable_gqa=True` only
when there is no mask). Each repeat copies the keys and values (the reshape merges a
broadcast), in the forward and again where the backward recomputes it, and the backward sums
the repeated heads' gradients back. PyTorch's CPU flash kernels (`_scaled_dot_product_flash_
attention_for_cpu` and its backward) take grouped heads natively.

`grouped_attention` rewrites such a call as `F.scaled_dot_product_attention(q, k, v, ...,
enable_gqa=True)` on the un-repeated `k` and `v`: the same attention (eager defines
`enable_gqa` as this repeat), computed without the copies. The repeat is recognised by what
it computes, not by its spelling: the chain of view statements from a 4-d tensor `x` of `g`
heads to the key is run on `arange(x.numel()).reshape(x.shape)`, and must give exactly that
tensor's `repeat_interleave(h // g, dim=1)`. Only CPU calls without dropout, of static sizes,
are rewritten (on CUDA only the flash backend takes grouped heads). The forward is eager's
bit for bit; the key and value gradients sum the grouped heads inside the kernel, which may
round differently from eager's separate sum (an ulp).
"""

from __future__ import annotations

import torch

from fulmen.core import BoundSymbol, FulmenError, Trace, TraceCtx, tracing
from fulmen.core.names import NameAllocator
from fulmen.core.proxy import Proxy
from fulmen.core.trace import not_tracing, reserved_names
from fulmen.ops import ltorch
from fulmen.proxies.tensor import TensorProxy
from fulmen.transforms.autodiff.registry import bound_arguments
from fulmen.transforms.base import transform

__all__ = ["grouped_attention", "standing_in_for"]

# torch-level ops a head repeat is spelled with: each takes one tensor and views or copies it
_REPEAT_STEPS = frozenset({"getitem", "unsqueeze", "expand", "broadcast_to", "reshape", "view",
                           "flatten", "repeat_interleave"})
_MAX_STEPS = 6


def _static(proxy) -> bool:
    return isinstance(proxy, TensorProxy) and all(type(s) is int for s in proxy.shape)


def _repeated_heads(key: TensorProxy, heads: int, producers: dict) -> TensorProxy | None:
    """The 4-d tensor `x` of fewer heads whose head repeat (`repeat_interleave(heads //
    groups, dim=1)`) `key` is, or None (module docstring)."""
    chain: list[BoundSymbol] = []
    value = key
    while len(chain) < _MAX_STEPS:
        bsym = producers.get(value.name)
        if bsym is None or bsym.sym.name not in _REPEAT_STEPS or len(bsym.proxy_outputs) != 1:
            return None
        inputs = bsym.read_proxies
        if len(inputs) != 1 or not bsym.args or bsym.args[0] is not inputs[0]:
            return None
        chain.append(bsym)
        value = inputs[0]
        if not _static(value) or value.dtype != key.dtype:
            return None
        if value.ndim == 4 and value.shape[1] < heads and heads % value.shape[1] == 0 \
                and value.shape[0] == key.shape[0] and value.shape[2:] == key.shape[2:]:
            return value if _repeats(chain, value, key, heads) else None
    return None


def _repeats(chain: list[BoundSymbol], x: TensorProxy, key: TensorProxy, heads: int) -> bool:
    """Whether running `chain` (last statement first) on the positions of `x` gives `x`'s
    heads each repeated `heads // groups` times in a row, as `key`'s shape."""
    positions = torch.arange(x.numel(), device="cpu").reshape(tuple(x.shape))
    value = positions
    try:
        with not_tracing(), torch.no_grad():
            for bsym in reversed(chain):
                value = bsym.sym.torch_fn(value, *bsym.args[1:], **bsym.kwargs)
    except Exception:  # an argument only the traced call could take: no rewrite
        return False
    expected = positions.repeat_interleave(heads // x.shape[1], dim=1)
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(key.shape) \
        and torch.equal(value, expected)


def _grouped_call(bsym: BoundSymbol, producers: dict, names: NameAllocator):
    """`bsym` (an attention call) on the un-repeated key and value, or None."""
    query, key, value, mask, dropout_p, is_causal, scale, enable_gqa = \
        bound_arguments(bsym.sym, bsym.args, bsym.kwargs)
    tensors = [t for t in (query, key, value, mask) if isinstance(t, torch.Tensor)]
    if enable_gqa is not False or type(dropout_p) not in (int, float) or dropout_p != 0.0 \
            or not all(map(_static, (query, key, value))) or query.ndim != 4 \
            or any(t.device.type != "cpu" for t in tensors):
        return None
    heads = query.shape[1]
    grouped_key = _repeated_heads(key, heads, producers)
    grouped_value = _repeated_heads(value, heads, producers)
    if grouped_key is None or grouped_value is None \
            or grouped_key.shape[1] != grouped_value.shape[1]:
        return None
    ctx = TraceCtx("grouped attention")
    ctx.names = names
    try:
        with tracing(ctx):
            output = ltorch.scaled_dot_product_attention(
                query, grouped_key, grouped_value, attn_mask=mask, dropout_p=dropout_p,
                is_causal=is_causal, scale=scale, enable_gqa=True)
    except FulmenError:  # a call the grouped form does not take: the repeats stay
        return None
    (call,) = ctx.bsyms
    return standing_in_for(call, output, bsym)


def standing_in_for(call: BoundSymbol, output: Proxy, bsym: BoundSymbol) -> BoundSymbol:
    """`call`, recorded anew in a trace context of its own with the output `output`, made to
    stand where `bsym` stood: writing `bsym`'s output, with `bsym`'s source line and tags."""
    renamed = {output.name: bsym.output}
    call = call.renamed(lambda p: renamed.get(p.name, p), outputs=True)
    return call.replace(source=bsym.source, tags=bsym.tags)


@transform("grouped attention")
def grouped_attention(trace: Trace) -> Trace:
    """`trace` with each CPU attention call on repeated key/value heads called on the heads
    themselves with `enable_gqa=True` (module docstring); the repeats, now unread, are left
    for dce. Returns `trace` itself when there is none."""
    calls = [b for b in trace.bsyms if b.sym is ltorch.scaled_dot_product_attention]
    if not calls:
        return trace
    producers = {p.name: b for b in trace.bsyms for p in b.proxy_outputs
                 if isinstance(p, Proxy)}
    names = reserved_names(trace.args, trace.bsyms)
    replaced = {}
    for bsym in calls:
        call = _grouped_call(bsym, producers, names)
        if call is not None:
            replaced[id(bsym)] = call
    if not replaced:
        return trace
    return trace.replace(bsyms=tuple(replaced.get(id(b), b) for b in trace.bsyms))
