"""Random models for model-level differential fuzzing (`test_models.py`).

A `Case` is a model description (`SeqModel` of transformer-style blocks, or `ConvModel` of
convolution stages) plus a calling context (`Context`: train/eval, grad/no-grad, autocast,
bf16 weights, gradient accumulation) and a list of `Call`s (shapes, padding, state changes
between calls). Everything is a frozen dataclass whose `repr` is valid Python, so a failing case
prints as a standalone repro:

    from tests.fuzz.models import *
    from tests.fuzz.model_check import check_case
    check_case(Case(...), ["torch"])   # raises Mismatch when fulmen and eager disagree

`build(case)` makes the module deterministically from the description. Running, generating
and minimizing cases: `model_cases.py`; checking them against eager: `model_check.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# ---------------------------------------------------------------------------------------------
# descriptions


@dataclass(frozen=True)
class Attn:
    """Pre-norm self-attention with a residual; `mask_if`: padding applied only when some
    position is padded (`if not mask.all()`: a value-dependent branch)."""

    heads: int = 2
    causal: bool = True
    rotary: bool = False
    sdpa: bool = True
    norm: str = "layer"  # layer | rms
    mask_if: bool = True
    checkpoint: bool = False
    autocast_inside: bool = False  # the attention core under autocast(bf16) inside the model
    dropout: bool = False  # on the attention probabilities (p=0.1, training only)
    kv_heads: int = 0  # grouped-query attention: fewer key/value heads, repeated (HF repeat_kv)
    positions_from_mask: bool = False  # rotary positions counted over unpadded tokens (HF:
    #                                    mask.cumsum(-1) - 1), per row: left padding's positions
    mask: str = "bool"  # bool | float (additive: 0 or finfo.min) | bert ((1 - m) * -1e4 + causal)
    #                     | vmap (bool, built as HF's masks with an or/and function: four nested
    #                     torch.vmap of an index function, `padding[b, kv]` indexed inside)
    # how the heads' outputs are merged before the projection: transpose (b, t, h, hd) as HF,
    # or permute to (b, t, hd, h): a view chain that moves the head dim innermost
    merge: str = "transpose"  # transpose | permute


@dataclass(frozen=True)
class Mlp:
    act: str = "gelu"  # gelu | silu | swiglu | relu
    mult: int = 2
    norm: str = "layer"
    checkpoint: bool = False
    fp32_island: bool = False  # the norm runs under autocast(enabled=False) in float32
    inplace: bool = False  # in-place activation and residual (`relu_`, `h += x`)
    dropout: bool = False
    unpad: bool = False  # only unpadded tokens, gathered by nonzero and scattered back


@dataclass(frozen=True)
class Moe:
    """Top-k routed experts (Mixtral style): `torch.where(idx == e)` has a data-dependent
    shape, `if tokens.numel() == 0: continue` is a value-dependent branch."""

    experts: int = 3
    top_k: int = 2
    norm: str = "rms"
    checkpoint: bool = False  # the routing (with its graph breaks) inside checkpoint
    combine: str = "index_add"  # index_add | scatter_add (both per expert, graph breaks) |
    #                             gather (every expert on every token, top-k gathered) |
    #                             scatter (top-k weights scattered into a dense [N, E] matrix)


@dataclass(frozen=True)
class Custom:
    """A custom autograd.Function inside the model (`scale`: gradient scaled by 0.5 in
    backward, `ste`: straight-through rounding)."""

    kind: str = "scale"


@dataclass(frozen=True)
class Stat:
    """In-place buffer updates in training: a running mean (read by the forward) and a step
    counter."""


@dataclass(frozen=True)
class Ema:
    """An EMA copy of a weight kept as a buffer: updated in place (`lerp_`) in every training
    call, used instead of the weight in eval mode; a float step counter."""


@dataclass(frozen=True)
class Memory:
    """State carried between calls: a buffer reassigned each call with one more row (kept to
    the last 3), read by the forward (a KV-cache-like store that changes shape)."""


@dataclass(frozen=True)
class Layout:
    """A view on an intermediate (HF Swin's window partition): a transposed view, an elementwise
    op (eager keeps its input's strides), then `.view` back, which is legal only with eager's
    strides; `strides`: Python also reads `is_contiguous()` and `stride()` of the intermediate."""

    kind: str = "view"  # view | view_broadcast | strides


@dataclass(frozen=True)
class SeqModel:
    vocab: int = 11
    dim: int = 8
    blocks: tuple = ()
    learned_pos: bool = False
    final_norm: str = "layer"  # layer | rms | none
    head: str = "lm"  # lm | tied | cls
    loss: str = "ce"  # ce | ce_tokens (sum / tokens counted by .item()) | ce_smooth
    #                   (label_smoothing, class weights) | nll (log_softmax + nll_loss) | mse | none
    early_exit: bool = False  # eval mode skips the head's last block (a module flag)
    dict_output: bool = False  # HF-style output: {"logits", "loss", "hidden_states": [...]}
    inplace_labels: bool = False  # padded labels set to -100 in place in the caller's tensor
    shared: bool = False  # the blocks are applied twice (weights shared across depth)
    left_pad: bool = False  # padding at the start of each row (HF generation's padding side)
    embed_scale: float = 1.0  # 0.02: small activations (GPT-2's init scale), where a norm's eps
    #                           matters


@dataclass(frozen=True)
class ConvStage:
    channels: int = 4
    kernel: int = 3
    norm: str = "batch"  # batch | batch_plain (no affine) | batch_cumulative (momentum=None)
    #                      | batch_nostats (track_running_stats=False) | group | group_plain
    #                      | instance | none
    act: str = "relu"  # relu | silu | gelu
    pool: str = "none"  # max | avg | none
    residual: bool = False
    checkpoint: bool = False


@dataclass(frozen=True)
class ConvModel:
    in_channels: int = 3
    stages: tuple = ()
    classes: int = 5
    extra: tuple = ()  # Custom / Stat blocks applied to the pooled features
    channels_last: bool = False  # weights and images in channels-last layout
    loss: str = "ce"  # ce | ce_smooth | nll | mse | none


@dataclass(frozen=True)
class Call:
    """One call: batch size, sequence length (or image size), padded tail lengths, and a state
    change made just before it (`train`, `eval`, `flag`: flip a module attribute read by the
    forward, `buffer`: write a buffer in place from outside, `freeze`: flip requires_grad of
    the first parameters, `temperature`: change a float attribute read by the forward, `grad`
    and `autocast`: flip grad mode or autocast for this and later calls, `hook`: a forward hook
    on the first submodule, `grad_hook`: a gradient hook on the first parameter, `unlabeled`:
    every label of this call is -100)."""

    batch: int = 2
    length: int = 5
    padding: tuple = ()  # per row: how many trailing positions are padding (sequence models)
    change: str = "none"


@dataclass(frozen=True)
class Context:
    training: bool = True
    grad: bool = True
    autocast: bool = False  # torch.autocast("cpu", bfloat16) around every call
    bf16_weights: bool = False
    accumulate: bool = False  # gradients accumulate over the calls (else zeroed before each)
    input_grad: bool = False  # the images require grad (conv models): their gradient compared
    fp16: bool = False  # float16 instead of bfloat16 for autocast and low-precision weights
    optimizer: str = "none"  # sgd | adamw: a jitted `optimizer.step` after each backward,
    #                          then an LR scheduler's step (StepLR halving the rate)
    ddp: bool = False  # fulmen.jit(DDP(model)) (odd seeds) or DDP(fulmen.jit(model)) runs
    #                    (a single-process gloo group, find_unused_parameters)
    cache: str = "none"  # list | dynamic: a KV cache (plain list, or transformers.DynamicCache)
    #                      passed to every call and grown by the attention blocks
    call: str = "module"  # module: fulmen.jit(model); argument: fulmen.jit(loss_fn)(model,
    #                       *inputs), a jitted function given the model as an argument

    @property
    def half(self):
        return torch.float16 if self.fp16 else torch.bfloat16


@dataclass(frozen=True)
class Case:
    model: SeqModel | ConvModel
    context: Context = Context()
    calls: tuple = (Call(),)
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# modules


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _norm(kind, dim):
    """layer | layer_plain (no affine) | layer_nobias | rms (hand-written) | rms_torch
    (nn.RMSNorm) | rms_plain (nn.RMSNorm, no affine) | none"""
    if kind == "rms":
        return RMSNorm(dim)
    if kind == "rms_torch":
        return nn.RMSNorm(dim, eps=1e-6)
    if kind == "rms_plain":
        return nn.RMSNorm(dim, elementwise_affine=False)
    if kind == "layer":
        return nn.LayerNorm(dim)
    if kind == "layer_plain":
        return nn.LayerNorm(dim, elementwise_affine=False)
    if kind == "layer_nobias":
        return nn.LayerNorm(dim, bias=False)
    return nn.Identity()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _vmapped_keep(b, t, s, past, causal, mask, device):
    """`[b, 1, t, s]` bool: which keys each query may see, built as HF's `sdpa_mask(...,
    use_vmap=True)` builds it (an index function vmapped over batch, head, query and key)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    def allowed(bi, hi, qi, ki):
        ok = qi.new_ones((), dtype=torch.bool)
        if causal:
            ok = ok & (ki <= qi + past)
        if mask is not None:
            ok = ok & mask[bi, ki].bool()
        return ok

    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None),
                 (0, None, None, None)):
        allowed = torch.vmap(allowed, in_dims=dims)
    with TransformGetItemToIndex():
        return allowed(torch.arange(b, device=device), torch.arange(1, device=device),
                       torch.arange(t, device=device), torch.arange(s, device=device))


class Attention(nn.Module):
    def __init__(self, spec: Attn, dim):
        super().__init__()
        self.spec = spec
        self.norm = _norm(spec.norm, dim)
        self.kv_heads = spec.kv_heads or spec.heads
        self.qkv = nn.Linear(dim, dim + 2 * self.kv_heads * (dim // spec.heads))
        self.proj = nn.Linear(dim, dim, bias=False)
        head_dim = dim // spec.heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.temperature = 1.0

    def core(self, x, mask, cache=None, layer=0):
        spec = self.spec
        b, t, d = x.shape
        hd, kv = d // spec.heads, self.kv_heads
        q, k, v = self.qkv(x).split([d, kv * hd, kv * hd], dim=-1)
        q = q.view(b, t, spec.heads, hd).transpose(1, 2)
        k, v = k.view(b, t, kv, hd).transpose(1, 2), v.view(b, t, kv, hd).transpose(1, 2)
        past = _cache_length(cache, layer)
        if spec.rotary:
            if spec.positions_from_mask and mask is not None:  # [b, 1, t, hd]: per row
                positions = (mask.long().cumsum(-1) - 1).clamp(min=0).float()
                freqs = (positions[..., None] * self.inv_freq)[:, None]
            else:
                positions = torch.arange(past, past + t, device=x.device).float()
                freqs = torch.outer(positions, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = _cache_update(cache, layer, k, v)
        s = k.shape[2]  # keys: past + new
        if kv != spec.heads:  # HF repeat_kv: expand, then reshape (a copy)
            k = k[:, :, None].expand(b, kv, spec.heads // kv, s, hd).reshape(b, -1, s, hd)
            v = v[:, :, None].expand(b, kv, spec.heads // kv, s, hd).reshape(b, -1, s, hd)
        keep = None  # [b, 1, t, s] bool: which keys each query may see
        if spec.mask == "vmap" and (spec.causal or mask is not None):
            keep = _vmapped_keep(b, t, s, past, spec.causal, mask, x.device)
        elif spec.causal:
            keep = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(past)[None, None]
        if mask is not None and spec.mask != "vmap" and (not spec.mask_if or not mask.all()):
            padding = mask[:, None, None, :]
            keep = padding if keep is None else keep & padding
        if spec.mask == "bert" and mask is not None:  # HF BERT's extended attention mask
            additive = (1.0 - mask[:, None, None, :].to(q.dtype)) * -10000.0
            if spec.causal:
                additive = additive.masked_fill(~keep, torch.finfo(q.dtype).min)
            keep = additive
        elif spec.mask not in ("bool", "vmap") and keep is not None:  # additive float mask
            keep = torch.zeros(keep.shape, dtype=q.dtype, device=x.device).masked_fill(
                ~keep, torch.finfo(q.dtype).min)
        scale = 1.0 / (math.sqrt(q.shape[-1]) * self.temperature)
        dropout = 0.1 if spec.dropout and self.training else 0.0
        if spec.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout,
                                                 scale=scale)
        else:
            scores = q @ k.transpose(-1, -2) * scale
            if keep is not None and keep.dtype == torch.bool:
                scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
            elif keep is not None:
                scores = scores + keep
            out = F.dropout(scores.softmax(-1), dropout, self.training) @ v
        merged = out.transpose(1, 2) if spec.merge == "transpose" else out.permute(0, 2, 3, 1)
        return self.proj(merged.reshape(b, t, d))

    def forward(self, x, mask, cache=None, layer=0):
        h = self.norm(x)
        if self.spec.autocast_inside:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.core(h, mask, cache, layer)
            h = h.to(x.dtype)
        elif self.spec.checkpoint and torch.is_grad_enabled() and cache is None:
            h = checkpoint(self.core, h, mask, use_reentrant=False)
        else:
            h = self.core(h, mask, cache, layer)
        return x + h


def _cache_length(cache, layer: int) -> int:
    """Positions already in `cache` (a list of (k, v) per layer, or a DynamicCache)."""
    if cache is None:
        return 0
    if isinstance(cache, list):
        return cache[layer][0].shape[2] if layer < len(cache) else 0
    return cache.get_seq_length(layer)


def _cache_update(cache, layer: int, k, v):
    """Append this call's keys and values to the layer's; return all of them."""
    if not isinstance(cache, list):
        return cache.update(k, v, layer)
    if layer < len(cache):
        past_k, past_v = cache[layer]
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        cache[layer] = (k, v)
    else:
        cache.append((k, v))
    return k, v


def cache_tensors(cache) -> list:
    """Every tensor a cache holds, in order (for comparison with eager's)."""
    if cache is None:
        return []
    if isinstance(cache, list):
        return [t for pair in cache for t in pair]
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


class MLP(nn.Module):
    def __init__(self, spec: Mlp, dim):
        super().__init__()
        self.spec = spec
        self.norm = _norm(spec.norm, dim)
        hidden = dim * spec.mult
        self.up = nn.Linear(dim, 2 * hidden if spec.act == "swiglu" else hidden)
        self.down = nn.Linear(hidden, dim)

    def core(self, h):
        h = self.up(h)
        if self.spec.act == "swiglu":
            gate, h = h.chunk(2, dim=-1)
            h = F.silu(gate) * h
        elif self.spec.act == "gelu":
            h = F.gelu(h, approximate="tanh" if h.shape[-1] % 2 else "none")
        elif self.spec.act == "silu":
            h = F.silu(h, inplace=self.spec.inplace)
        elif self.spec.inplace:
            h.relu_()
        else:
            h = torch.relu(h)
        if self.spec.dropout:
            h = F.dropout(h, 0.1, self.training)
        return self.down(h)

    def forward(self, x, mask):
        if self.spec.fp32_island:
            with torch.autocast("cpu", enabled=False):
                h = self.norm(x)
        else:
            h = self.norm(x)
        if self.spec.unpad and mask is not None:  # varlen style: a data-dependent shape
            b, t, d = h.shape
            index = torch.nonzero(mask.flatten()).flatten()
            tokens = self.core(h.reshape(b * t, d)[index])
            h = torch.zeros(b * t, tokens.shape[-1], dtype=tokens.dtype, device=tokens.device)
            h[index] = tokens
            h = h.view(b, t, -1)
        elif self.spec.checkpoint and torch.is_grad_enabled():
            h = checkpoint(self.core, h, use_reentrant=False)
        else:
            h = self.core(h)
        if self.spec.inplace:
            h = h.to(x.dtype)
            h += x
            return h
        return x + h.to(x.dtype)


class MoE(nn.Module):
    def __init__(self, spec: Moe, dim):
        super().__init__()
        self.spec = spec
        self.norm = _norm(spec.norm, dim)
        self.router = nn.Linear(dim, spec.experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
            for _ in range(spec.experts))

    def forward(self, x, mask):
        if self.spec.checkpoint and torch.is_grad_enabled():
            return checkpoint(self.route, x, use_reentrant=False)
        return self.route(x)

    def route(self, x):
        b, t, d = x.shape
        h = self.norm(x).reshape(b * t, d)
        probs = self.router(h).softmax(-1, dtype=torch.float)
        weights, chosen = probs.topk(self.spec.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
        combine = self.spec.combine
        if combine == "gather":  # every expert on every token, the top-k gathered
            every = torch.stack([expert(h) for expert in self.experts], dim=1)  # [N, E, d]
            picked = every.gather(1, chosen[..., None].expand(-1, -1, d))  # [N, k, d]
            return x + (picked * weights[..., None]).sum(1).view(b, t, d)
        if combine == "scatter":  # dense [N, E] combine weights, zero off the top-k
            dense = torch.zeros(b * t, len(self.experts), dtype=h.dtype, device=h.device)
            dense = dense.scatter(1, chosen, weights)
            out = sum(dense[:, e, None] * expert(h) for e, expert in enumerate(self.experts))
            return x + out.view(b, t, d)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tokens, slot = torch.where(chosen == e)
            if tokens.numel() == 0:
                continue
            y = (expert(h[tokens]) * weights[tokens, slot, None]).to(out.dtype)
            if combine == "scatter_add":
                out.scatter_add_(0, tokens[:, None].expand(-1, d), y)
            else:
                out = out.index_add(0, tokens, y)
        return x + out.view(b, t, d)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(scale)
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad, None


class _Linear(torch.autograd.Function):
    """A linear layer with a hand-written backward (needs_input_grad, two outputs, one of them
    non-differentiable), as custom kernels are wrapped."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        y = x @ weight.t() + bias
        peak = y.detach().abs().amax(-1, keepdim=True)
        ctx.mark_non_differentiable(peak)
        return y, peak

    @staticmethod
    def backward(ctx, grad, _):
        x, weight = ctx.saved_tensors
        gx = grad @ weight if ctx.needs_input_grad[0] else None
        gw = grad.flatten(0, -2).t() @ x.flatten(0, -2) if ctx.needs_input_grad[1] else None
        gb = grad.flatten(0, -2).sum(0) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


class CustomFn(nn.Module):
    def __init__(self, spec: Custom, dim):
        super().__init__()
        self.spec = spec
        self.register_buffer("scale", torch.tensor(4.0))
        if spec.kind == "linear":
            self.weight = nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim))
            self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x, mask=None):
        if self.spec.kind == "scale":
            return _ScaleGrad.apply(x)
        if self.spec.kind == "linear":
            y, peak = _Linear.apply(x, self.weight.to(x.dtype), self.bias.to(x.dtype))
            return x + y / (1 + peak)
        return _StraightThrough.apply(x, self.scale.to(x.dtype))


class Stats(nn.Module):
    def __init__(self, spec: Stat, dim):
        super().__init__()
        self.register_buffer("running", torch.zeros(dim))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x, mask=None):
        if self.training:
            with torch.no_grad():
                mean = x.detach().float().reshape(-1, x.shape[-1]).mean(0)
                self.running.mul_(0.9).add_(mean.to(self.running.dtype), alpha=0.1)
                self.steps += 1
        return x - 0.1 * self.running.to(x.dtype)


class EmaBlock(nn.Module):
    def __init__(self, spec: Ema, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.register_buffer("shadow", self.weight.detach().clone())
        self.register_buffer("updates", torch.zeros(()))

    def forward(self, x, mask=None):
        if self.training:
            with torch.no_grad():
                self.updates.add_(1)
                self.shadow.lerp_(self.weight.to(self.shadow.dtype), 1.0 / (1 + self.updates))
            return x * self.weight
        return x * self.shadow


class LayoutBlock(nn.Module):
    def __init__(self, spec: Layout, dim):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim // 2))

    def forward(self, x, mask=None):
        shape, half = x.shape, x.shape[-1] // 2
        h = x.view(*shape[:-1], 2, half).transpose(-1, -2)  # [..., half, 2], strided
        if self.spec.kind == "view":
            h = torch.tanh(h) * 1.5  # eager: the output keeps h's strides
        else:  # with a broadcast operand (eager: still h's strides)
            h = torch.tanh(h * self.weight[:, None])
        if self.spec.kind == "strides":
            if not h.is_contiguous():  # eager: not contiguous
                h = h * 0.5
            h = h + 0.01 * h.stride(-1)  # eager: half
        h = h.transpose(-1, -2).view(shape)  # fails unless h has eager's strides
        return x + h * self.weight.repeat(2)


class MemoryBlock(nn.Module):
    def __init__(self, spec: Memory, dim):
        super().__init__()
        self.register_buffer("memory", torch.zeros(0, dim))

    def forward(self, x, mask=None):
        summary = x.detach().reshape(-1, x.shape[-1]).mean(0, keepdim=True)
        self.memory = torch.cat([self.memory, summary.to(self.memory.dtype)])[-3:]
        return x + 0.5 * self.memory.mean(0).to(x.dtype)


_SEQ_BLOCKS = {Attn: Attention, Mlp: MLP, Moe: MoE, Custom: CustomFn, Stat: Stats,
               Memory: MemoryBlock, Layout: LayoutBlock, Ema: EmaBlock}


class SeqNet(nn.Module):
    def __init__(self, spec: SeqModel):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.dim)
        self.pos = nn.Parameter(torch.randn(16, spec.dim) * 0.1) if spec.learned_pos else None
        self.blocks = nn.ModuleList(_SEQ_BLOCKS[type(b)](b, spec.dim) for b in spec.blocks)
        self.norm = _norm(spec.final_norm, spec.dim)
        out = 3 if spec.head == "cls" else spec.vocab
        self.head = nn.Linear(spec.dim, out, bias=spec.head == "cls")
        if spec.head == "tied":
            self.head.weight = self.embed.weight
        self.early_exit = spec.early_exit

    def forward(self, ids, mask, labels, cache=None):
        h = self.embed(ids)
        if self.spec.embed_scale != 1.0:
            h = h * self.spec.embed_scale
        if self.pos is not None:
            h = h + self.pos[: ids.shape[1]]
        blocks = list(self.blocks)
        if self.early_exit and not self.training and blocks:
            blocks = blocks[:-1]
        hidden = []
        layer = 0  # each attention applied gets its own cache entry
        for block in blocks * (2 if self.spec.shared else 1):
            if isinstance(block, Attention):
                h = block(h, mask, cache, layer)
                layer += 1
            else:
                h = block(h, mask)
            hidden.append(h)
        h = self.norm(h)
        if self.spec.head == "cls":  # mean over the unpadded positions
            if mask is None:
                h = h.mean(1)
            else:
                m = mask[..., None].to(h.dtype)
                h = (h * m).sum(1) / m.sum(1)
        logits = self.head(h)
        loss = self.loss(logits, mask, labels)
        if self.spec.dict_output:
            return {"logits": logits, "loss": loss, "hidden_states": hidden}
        return logits if loss is None else (logits, loss)

    def loss(self, logits, mask, labels):
        if self.spec.loss == "none":
            return None
        if self.spec.loss == "mse":
            return F.mse_loss(logits.float(), torch.zeros_like(logits, dtype=torch.float))
        if self.spec.head == "cls":
            return _classification_loss(self.spec.loss, logits, labels[:, 0] % 3)
        if mask is not None:
            if self.spec.inplace_labels:
                labels.masked_fill_(~mask, -100)
            else:
                labels = labels.masked_fill(~mask, -100)
        if self.spec.loss == "ce_tokens":  # a value read by Python: a graph break
            tokens = int((labels != -100).sum().item())
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                   ignore_index=-100, reduction="sum") / max(tokens, 1)
        return _classification_loss(self.spec.loss, logits.flatten(0, 1), labels.flatten())


def _classification_loss(kind, logits, labels):
    """ce | ce_smooth (label smoothing and class weights) | nll; labels of -100 are ignored."""
    logits = logits.float()
    if kind == "nll":
        return F.nll_loss(logits.log_softmax(-1), labels, ignore_index=-100)
    if kind == "ce_smooth":
        weight = torch.linspace(0.5, 1.5, logits.shape[-1], device=logits.device)
        return F.cross_entropy(logits, labels, weight=weight, ignore_index=-100,
                               label_smoothing=0.1)
    return F.cross_entropy(logits, labels, ignore_index=-100)


class Stage(nn.Module):
    def __init__(self, spec: ConvStage, channels_in):
        super().__init__()
        self.spec = spec
        self.conv = nn.Conv2d(channels_in, spec.channels, spec.kernel, padding=spec.kernel // 2)
        self.norm = {
            "batch": lambda c: nn.BatchNorm2d(c),
            "batch_plain": lambda c: nn.BatchNorm2d(c, affine=False),
            "batch_cumulative": lambda c: nn.BatchNorm2d(c, momentum=None),
            "batch_nostats": lambda c: nn.BatchNorm2d(c, track_running_stats=False),
            "group": lambda c: nn.GroupNorm(2, c),
            "group_plain": lambda c: nn.GroupNorm(2, c, affine=False),
            "instance": lambda c: nn.InstanceNorm2d(c, affine=True),
            "none": lambda c: nn.Identity(),
        }[spec.norm](spec.channels)
        self.act = {"relu": nn.ReLU(), "silu": nn.SiLU(), "gelu": nn.GELU()}[spec.act]
        self.skip = spec.residual and channels_in == spec.channels

    def core(self, x):
        return self.act(self.norm(self.conv(x)))

    def forward(self, x):
        # batch norm's running stats in a checkpointed region: eager's recomputation in
        # backward updates them a second time (num_batches_tracked += 2); such calls run
        # eagerly (`tracer/mutation.py` CheckpointedUpdate)
        if self.spec.checkpoint and torch.is_grad_enabled():
            h = checkpoint(self.core, x, use_reentrant=False)
        else:
            h = self.core(x)
        if self.skip:
            h = h + x
        if self.spec.pool == "max" and min(h.shape[-2:]) >= 2:
            h = F.max_pool2d(h, 2)
        elif self.spec.pool == "avg" and min(h.shape[-2:]) >= 2:
            h = F.avg_pool2d(h, 2)
        return h


class ConvNet(nn.Module):
    def __init__(self, spec: ConvModel):
        super().__init__()
        self.spec = spec
        stages, channels = [], spec.in_channels
        for stage in spec.stages:
            stages.append(Stage(stage, channels))
            channels = stage.channels
        self.stages = nn.ModuleList(stages)
        self.extra = nn.ModuleList(_SEQ_BLOCKS[type(b)](b, channels) for b in spec.extra)
        self.head = nn.Linear(channels, spec.classes)
        self.early_exit = False

    def forward(self, images, labels):
        h = images
        for stage in self.stages:
            h = stage(h)
        h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        for block in self.extra:
            h = block(h)
        logits = self.head(h)
        if self.spec.loss == "none":
            return logits
        if self.spec.loss == "mse":
            return logits, F.mse_loss(logits.float(), torch.zeros_like(logits, dtype=torch.float))
        return logits, _classification_loss(self.spec.loss, logits, labels % self.spec.classes)


def build(case: Case, dtype=None) -> nn.Module:
    """The module described by `case`, initialised from `case.seed`; float64 when `dtype` is
    torch.float64 (the reference), else bfloat16/float16 where the context asks for
    low-precision weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed)
        model = SeqNet(case.model) if isinstance(case.model, SeqModel) else ConvNet(case.model)
    if dtype is None and case.context.bf16_weights:
        dtype = case.context.half
    if dtype is not None:
        model = model.to(dtype)
    if isinstance(case.model, ConvModel) and case.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train(case.context.training)
    return model
