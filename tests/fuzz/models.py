"""Random models for model-level differential fuzzing (`test_models.py`).

A `Case` is a model description (`SeqModel` of transformer-style blocks, or `ConvModel` of
convolution stages) plus a calling context (`Context`: train/eval, grad/no-grad, autocast,
bf16 weights, gradient accumulation) and a list of `Call`s (shapes, padding, state changes
between calls). Everything is a frozen dataclass whose `repr` is valid Python, so a failing case
prints as a standalone repro:

    from tests.fuzz.models import *
    run_case(Case(...), ["torch"])   # raises Mismatch when fulmen and eager disagree

`build(case)` makes the module deterministically from the description; `run_sequence` runs the
calls on it (eager, jitted, or in float64) and records every output, buffer and gradient.
`cases()` is the hypothesis strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
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
class Memory:
    """State carried between calls: a buffer reassigned each call with one more row (kept to
    the last 3), read by the forward (a KV-cache-like store that changes shape)."""


@dataclass(frozen=True)
class SeqModel:
    vocab: int = 11
    dim: int = 8
    blocks: tuple = ()
    learned_pos: bool = False
    final_norm: str = "layer"  # layer | rms | none
    head: str = "lm"  # lm | tied | cls
    loss: str = "ce"  # ce | ce_tokens (sum / tokens counted by .item()) | mse | none
    early_exit: bool = False  # eval mode skips the head's last block (a module flag)
    dict_output: bool = False  # HF-style output: {"logits", "loss", "hidden_states": [...]}
    inplace_labels: bool = False  # padded labels set to -100 in place in the caller's tensor
    shared: bool = False  # the blocks are applied twice (weights shared across depth)


@dataclass(frozen=True)
class ConvStage:
    channels: int = 4
    kernel: int = 3
    norm: str = "batch"  # batch | group | none
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
    loss: str = "ce"  # ce | mse | none


@dataclass(frozen=True)
class Call:
    """One call: batch size, sequence length (or image size), padded tail lengths, and a state
    change made just before it (`train`, `eval`, `flag`: flip a module attribute read by the
    forward, `buffer`: write a buffer in place from outside, `freeze`: flip requires_grad of
    the first parameters, `temperature`: change a float attribute read by the forward, `grad`
    and `autocast`: flip grad mode or autocast for this and later calls, `hook`: a forward hook
    on the first submodule, `grad_hook`: a gradient hook on the first parameter)."""

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
    if kind == "rms":
        return RMSNorm(dim)
    if kind == "layer":
        return nn.LayerNorm(dim)
    return nn.Identity()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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

    def core(self, x, mask):
        spec = self.spec
        b, t, d = x.shape
        hd, kv = d // spec.heads, self.kv_heads
        q, k, v = self.qkv(x).split([d, kv * hd, kv * hd], dim=-1)
        q = q.view(b, t, spec.heads, hd).transpose(1, 2)
        k, v = k.view(b, t, kv, hd).transpose(1, 2), v.view(b, t, kv, hd).transpose(1, 2)
        if kv != spec.heads:  # HF repeat_kv: expand, then reshape (a copy)
            k = k[:, :, None].expand(b, kv, spec.heads // kv, t, hd).reshape(b, -1, t, hd)
            v = v[:, :, None].expand(b, kv, spec.heads // kv, t, hd).reshape(b, -1, t, hd)
        if spec.rotary:
            freqs = torch.outer(torch.arange(t, device=x.device).float(), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        keep = None  # [b, 1, t, t] bool: which keys each query may see
        if spec.causal:
            keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]
        if mask is not None and (not spec.mask_if or not mask.all()):
            padding = mask[:, None, None, :]
            keep = padding if keep is None else keep & padding
        scale = 1.0 / (math.sqrt(q.shape[-1]) * self.temperature)
        dropout = 0.1 if spec.dropout and self.training else 0.0
        if spec.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout,
                                                 scale=scale)
        else:
            scores = q @ k.transpose(-1, -2) * scale
            if keep is not None:
                scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
            out = F.dropout(scores.softmax(-1), dropout, self.training) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))

    def forward(self, x, mask):
        h = self.norm(x)
        if self.spec.autocast_inside:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.core(h, mask)
            h = h.to(x.dtype)
        elif self.spec.checkpoint and torch.is_grad_enabled():
            h = checkpoint(self.core, h, mask, use_reentrant=False)
        else:
            h = self.core(h, mask)
        return x + h


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
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tokens, slot = torch.where(chosen == e)
            if tokens.numel() == 0:
                continue
            y = expert(h[tokens]) * weights[tokens, slot, None]
            out = out.index_add(0, tokens, y.to(out.dtype))
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


class MemoryBlock(nn.Module):
    def __init__(self, spec: Memory, dim):
        super().__init__()
        self.register_buffer("memory", torch.zeros(0, dim))

    def forward(self, x, mask=None):
        summary = x.detach().reshape(-1, x.shape[-1]).mean(0, keepdim=True)
        self.memory = torch.cat([self.memory, summary.to(self.memory.dtype)])[-3:]
        return x + 0.5 * self.memory.mean(0).to(x.dtype)


_SEQ_BLOCKS = {Attn: Attention, Mlp: MLP, Moe: MoE, Custom: CustomFn, Stat: Stats,
               Memory: MemoryBlock}


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

    def forward(self, ids, mask, labels):
        h = self.embed(ids)
        if self.pos is not None:
            h = h + self.pos[: ids.shape[1]]
        blocks = list(self.blocks)
        if self.early_exit and not self.training and blocks:
            blocks = blocks[:-1]
        hidden = []
        for block in blocks * (2 if self.spec.shared else 1):
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
            return F.cross_entropy(logits.float(), labels[:, 0] % 3)
        if mask is not None:
            if self.spec.inplace_labels:
                labels.masked_fill_(~mask, -100)
            else:
                labels = labels.masked_fill(~mask, -100)
        if self.spec.loss == "ce_tokens":  # a value read by Python: a graph break
            tokens = int((labels != -100).sum().item())
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                   ignore_index=-100, reduction="sum") / max(tokens, 1)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


class Stage(nn.Module):
    def __init__(self, spec: ConvStage, channels_in):
        super().__init__()
        self.spec = spec
        self.conv = nn.Conv2d(channels_in, spec.channels, spec.kernel, padding=spec.kernel // 2)
        if spec.norm == "batch":
            self.norm = nn.BatchNorm2d(spec.channels)
        elif spec.norm == "group":
            self.norm = nn.GroupNorm(2, spec.channels)
        else:
            self.norm = nn.Identity()
        self.act = {"relu": nn.ReLU(), "silu": nn.SiLU(), "gelu": nn.GELU()}[spec.act]
        self.skip = spec.residual and channels_in == spec.channels

    def core(self, x):
        return self.act(self.norm(self.conv(x)))

    def forward(self, x):
        # excluded: batch norm's running stats in a checkpointed region. Eager's recomputation
        # in backward updates them a second time (num_batches_tracked += 2), fulmen once
        # (reported as a divergence from eager, see the report of issue 18)
        recomputes_stats = self.spec.norm == "batch" and self.training
        if self.spec.checkpoint and torch.is_grad_enabled() and not recomputes_stats:
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
        return logits, F.cross_entropy(logits.float(), labels % self.spec.classes)


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


# ---------------------------------------------------------------------------------------------
# running a case


def make_inputs(case: Case, index: int, dtype) -> tuple:
    """The inputs of call `index`, generated from the case's seed."""
    call = case.calls[index]
    gen = torch.Generator().manual_seed(case.seed * 1000 + index)
    model = case.model
    if isinstance(model, SeqModel):
        ids = torch.randint(0, model.vocab, (call.batch, call.length), generator=gen)
        labels = torch.randint(0, model.vocab, (call.batch, call.length), generator=gen)
        mask = None
        if call.padding:
            pads = [min(call.padding[i % len(call.padding)], call.length - 1)
                    for i in range(call.batch)]
            mask = torch.arange(call.length)[None, :] < torch.tensor(
                [call.length - p for p in pads])[:, None]
        return ids, mask, labels
    images = torch.randn(call.batch, model.in_channels, call.length, call.length,
                         generator=gen).to(dtype)
    if model.channels_last:
        images = images.to(memory_format=torch.channels_last)
    labels = torch.randint(0, model.classes, (call.batch,), generator=gen)
    return images, labels


def _halve_output(module, args, output):
    return output * 0.5


def _double(grad):
    return grad * 2


def _change_state(model: nn.Module, change: str, index: int) -> None:
    if change == "train":
        model.train()
    elif change == "eval":
        model.eval()
    elif change == "flag":
        for module in model.modules():
            if hasattr(module, "early_exit"):
                module.early_exit = not module.early_exit
    elif change == "hook":  # a forward hook on the first submodule with parameters
        first = next(m for m in model.modules() if m is not model and m._parameters)
        first.register_forward_hook(_halve_output)
    elif change == "grad_hook":
        first = next(model.parameters())
        if first.requires_grad:
            first.register_hook(_double)
    elif change == "freeze":
        first = next(model.parameters())
        for p in list(model.parameters())[:2]:
            p.requires_grad_(not first.requires_grad)
    elif change == "temperature":
        for module in model.modules():
            if hasattr(module, "temperature"):
                module.temperature = 0.5 * (index + 1)
    elif change == "buffer":
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if buffer.is_floating_point() and "inv_freq" not in name and buffer.numel():
                    buffer.add_(0.25 * (index + 1))


def run_sequence(case: Case, model: nn.Module, fn, reference: bool = False) -> list:
    """Run the case's calls through `fn` (the model itself or its jitted form); return the
    records [(what, tensor)] of every output, buffer and gradient, in order. `reference`: the
    float64 run (no autocast, float64 inputs)."""
    ctx = case.context
    dtype = torch.float64 if reference else (
        ctx.half if ctx.bf16_weights else torch.float32)
    records = []

    def record(what, tensor):
        records.append((what, None if tensor is None else tensor.detach().clone()))

    torch.manual_seed(case.seed)  # dropout draws the same masks in every run
    grad, use_autocast = ctx.grad, ctx.autocast
    for index, call in enumerate(case.calls):
        _change_state(model, call.change, index)
        if call.change == "grad":  # the ambient state changes between calls
            grad = not grad
        elif call.change == "autocast" and not ctx.bf16_weights:
            use_autocast = not use_autocast
        if not ctx.accumulate:
            for p in model.parameters():
                p.grad = None
        inputs = make_inputs(case, index, dtype)
        if ctx.input_grad and isinstance(case.model, ConvModel):
            inputs[0].requires_grad_()
        grad_mode = torch.enable_grad() if grad else torch.no_grad()
        autocast = (torch.autocast("cpu", dtype=ctx.half) if use_autocast
                    else contextlib.nullcontext())
        with grad_mode, autocast:
            out = fn(*inputs)
        if isinstance(out, dict):
            logits, loss = out["logits"], out["loss"]
            for i, h in enumerate(out["hidden_states"]):
                record(f"call {index} output hidden_states[{i}]", h)
        else:
            logits, loss = out if isinstance(out, tuple) else (out, None)
        record(f"call {index} output", logits)
        if loss is not None:
            record(f"call {index} loss", loss)
        for name, tensor in (("output", logits), ("loss", loss)):
            if tensor is not None:  # requires_grad and layout as eager's
                record(f"call {index} layout {name}",
                       torch.tensor([tensor.requires_grad, *tensor.stride()]))
        for i, tensor in enumerate(inputs):
            if tensor is not None:
                record(f"call {index} input {i}", tensor)
        for name, buffer in model.named_buffers():
            record(f"call {index} buffer {name}", buffer)
        if grad:
            target = loss if loss is not None else logits.float().square().mean()
            if target.requires_grad:
                target.backward()
                for name, p in model.named_parameters():
                    record(f"call {index} grad {name}", p.grad)
                if ctx.input_grad and isinstance(case.model, ConvModel):
                    record(f"call {index} grad input", inputs[0].grad)
    return records


# ---------------------------------------------------------------------------------------------
# strategies

# FULMEN_FUZZ_KNOWN_BUGS=1 also generates the patterns excluded for open bugs:
# - `Memory`: a tensor stored on the module (`self.memory = torch.cat([...])`, buffer or plain
#   attribute) leaks a TensorProxy into the module and later calls are wrong (issue 18 report)
KNOWN_BUGS = os.environ.get("FULMEN_FUZZ_KNOWN_BUGS") == "1"
_norms = st.sampled_from(["layer", "rms"])
_often = st.sampled_from([True, True, False])
_sometimes = st.sampled_from([False, False, True])
_rarely = st.sampled_from([False, False, False, True])


@st.composite
def _attn(draw, dim):
    heads = draw(st.sampled_from([h for h in (1, 2, 4) if dim % h == 0 and (dim // h) % 2 == 0]))
    kv_heads = draw(st.sampled_from([0] + [k for k in (1, 2) if k < heads and heads % k == 0]))
    return draw(st.builds(Attn, heads=st.just(heads), kv_heads=st.just(kv_heads), causal=st.booleans(), rotary=st.booleans(),
                     sdpa=st.booleans(), norm=_norms, mask_if=st.booleans(),
                     checkpoint=st.booleans(), autocast_inside=_sometimes, dropout=_sometimes))


_mlp = st.builds(Mlp, act=st.sampled_from(["gelu", "silu", "swiglu", "relu"]),
                 mult=st.integers(1, 3), norm=_norms, checkpoint=st.booleans(),
                 fp32_island=_sometimes, inplace=st.booleans(), dropout=_sometimes,
                 unpad=_sometimes)
_moe = st.builds(Moe, experts=st.integers(2, 4), top_k=st.integers(1, 2), norm=_norms,
                 checkpoint=_sometimes)
_custom = st.builds(Custom, kind=st.sampled_from(["scale", "ste", "linear"]))
_stat = st.just(Stat())


@st.composite
def seq_models(draw):
    dim = draw(st.sampled_from([8, 12, 16]))
    kinds = [_attn(dim), _attn(dim), _attn(dim), _mlp, _mlp, _moe, _moe, _custom, _stat]  # weights
    if KNOWN_BUGS:
        kinds.append(st.just(Memory()))
    block = st.one_of(*kinds)
    blocks = tuple(draw(st.lists(block, min_size=1, max_size=4)))
    head = draw(st.sampled_from(["lm", "tied", "cls"]))
    return SeqModel(vocab=draw(st.integers(5, 20)), dim=dim, blocks=blocks,
                    learned_pos=draw(st.booleans()),
                    final_norm=draw(st.sampled_from(["layer", "rms", "none"])), head=head,
                    loss=draw(st.sampled_from(["ce", "ce_tokens", "mse", "none"])),
                    early_exit=draw(st.booleans()), dict_output=draw(st.booleans()),
                    inplace_labels=draw(st.booleans()), shared=draw(_sometimes))


_stage = st.builds(ConvStage, channels=st.sampled_from([4, 6]), kernel=st.sampled_from([1, 3]),
                   norm=st.sampled_from(["batch", "group", "none"]),
                   act=st.sampled_from(["relu", "silu", "gelu"]),
                   pool=st.sampled_from(["max", "avg", "none"]), residual=st.booleans(),
                   checkpoint=st.booleans())
conv_models = st.builds(
    ConvModel, in_channels=st.integers(1, 3), stages=st.lists(_stage, min_size=1, max_size=3)
    .map(tuple), classes=st.integers(2, 6),
    extra=st.lists(st.one_of(_custom, _stat), max_size=2).map(tuple),
    loss=st.sampled_from(["ce", "mse", "none"]), channels_last=_sometimes)


@st.composite
def cases(draw):
    model = draw(st.one_of(seq_models(), seq_models(), conv_models))
    seq = isinstance(model, SeqModel)
    # bf16 hides small errors in its rounding: most cases run in float32
    context = draw(st.builds(Context, training=_often, grad=_often, autocast=_sometimes,
                             bf16_weights=_rarely, accumulate=st.booleans(),
                             input_grad=st.booleans(), fp16=_sometimes))
    if context.bf16_weights and context.autocast:
        context = dataclasses.replace(context, autocast=False)
    n_calls = draw(st.integers(1, 3))
    calls = []
    for i in range(n_calls):
        length = draw(st.integers(2, 7) if seq else st.integers(3, 8))
        padding = tuple(draw(st.lists(st.integers(0, 3), max_size=3))) if seq else ()
        change = draw(st.sampled_from(["none", "none", "none", "train", "eval", "flag", "buffer",
                                       "freeze", "temperature", "grad", "autocast", "hook",
                                       "grad_hook"])
                      if i else st.just("none"))
        # batch norm in training needs more than one value per channel after pooling
        batch = draw(st.integers(1 if seq else 2, 3))
        calls.append(Call(batch=batch, length=length, padding=padding,
                          change=change))
    return Case(model=model, context=context, calls=tuple(calls),
                seed=draw(st.integers(0, 2**16)))


def smaller(case: Case):
    """Candidate simplifications of `case`, simplest first: fewer calls, blocks, contexts."""
    model, ctx = case.model, case.context
    for i in range(len(case.calls)):
        if len(case.calls) > 1:
            yield dataclasses.replace(case, calls=case.calls[:i] + case.calls[i + 1:])
    field = "blocks" if isinstance(model, SeqModel) else "stages"
    parts = getattr(model, field)
    for i in range(len(parts)):
        if len(parts) > 1 or field == "blocks":
            yield dataclasses.replace(case, model=dataclasses.replace(
                model, **{field: parts[:i] + parts[i + 1:]}))
    if isinstance(model, ConvModel):
        for i in range(len(model.extra)):
            yield dataclasses.replace(case, model=dataclasses.replace(
                model, extra=model.extra[:i] + model.extra[i + 1:]))
    for name in ("autocast", "bf16_weights", "accumulate", "input_grad", "fp16"):
        if getattr(ctx, name):
            yield dataclasses.replace(case, context=dataclasses.replace(ctx, **{name: False}))
    for index, call in enumerate(case.calls):
        simpler = [dataclasses.replace(call, change="none"), dataclasses.replace(call, padding=()),
                   dataclasses.replace(call, batch=max(1, call.batch - 1)),
                   dataclasses.replace(call, length=max(2, call.length - 1))]
        for new in simpler:
            if new != call:
                calls = case.calls[:index] + (new,) + case.calls[index + 1:]
                yield dataclasses.replace(case, calls=calls)
    # simplify each block's own flags
    for i, part in enumerate(parts):
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if value is True or type(value) is int and value > 1:  # flags off, sizes down
                new = dataclasses.replace(part, **{f.name: False if value is True else value - 1})
                yield dataclasses.replace(case, model=dataclasses.replace(
                    model, **{field: parts[:i] + (new,) + parts[i + 1:]}))
    if isinstance(model, SeqModel):
        for name, plain in (("learned_pos", False), ("early_exit", False),
                            ("dict_output", False), ("inplace_labels", False), ("shared", False),
                            ("final_norm", "none"), ("loss", "none"), ("head", "lm")):
            if getattr(model, name) != plain:
                yield dataclasses.replace(case, model=dataclasses.replace(model, **{name: plain}))


# ---------------------------------------------------------------------------------------------
# checking a case against eager


class Mismatch(AssertionError):
    """fulmen and eager disagree; `kind` groups failures for the minimizer ("value: grad",
    "error: RuntimeError", ...)."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class InvalidCase(Exception):
    """Eager itself fails on the case: a bug of the generator, not of fulmen."""


_TIGHT = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
          torch.float16: (1e-3, 1e-5),
          torch.float64: (1e-7, 1e-7)}
# the fp64 rule: fulmen's error vs float64 may be at most MULTIPLIER x eager's, plus a floor
# relative to the reference's magnitude
_MULTIPLIER = {torch.float32: 2.0, torch.bfloat16: 3.0, torch.float16: 3.0}
_FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def _rms(t):
    return float(t.double().square().mean().sqrt()) if t.numel() else 0.0


def _tight(a, e) -> bool:
    if not e.is_floating_point():
        return torch.equal(a, e)
    rtol, atol = _TIGHT[e.dtype]
    return torch.allclose(a.double(), e.double(), rtol=rtol, atol=atol, equal_nan=True)


def _accurate(a, e, ref, low_precision: bool, noise: float = 0.0) -> tuple[bool, str]:
    """The float64 accuracy rule (torch._dynamo's): |fulmen - fp64| <= k |eager - fp64| + floor,
    as root mean squares; k = 2 for float32, 3 where bf16 took part. `noise`: eager's mean error
    over the tensor's group (the call's gradients, say) stands in for a tensor's own when that
    is smaller: a value that cancels to ~0 (a conv bias before batch norm) can have an eager
    error far below its terms' rounding by luck."""
    if ref is None or ref.shape != e.shape or not torch.isfinite(ref).all():
        return False, "no finite float64 reference"
    if not (torch.isfinite(a) == torch.isfinite(e)).all():
        return False, "non-finite values differ"
    dtype = torch.bfloat16 if low_precision or e.dtype != torch.float32 else torch.float32
    ref = ref.double()
    a_err, e_err = _rms(a.double() - ref), _rms(e.double() - ref)
    bound = _MULTIPLIER[dtype] * max(e_err, noise) + _FLOOR[dtype] * _rms(ref) + 1e-7
    return a_err <= bound, f"rms error vs fp64 {a_err:.3g}, eager's {e_err:.3g}, bound {bound:.3g}"


def _group_noise(expected, reference, what) -> float:
    """Eager's mean rms error vs float64 over the records of `what`'s call and kind."""
    group = what.split()[:3]
    errors = [_rms(e.double() - r.double()) for (w, e), (_, r) in zip(expected, reference)
              if w.split()[:3] == group and e is not None and r is not None
              and e.is_floating_point() and e.shape == r.shape and torch.isfinite(r).all()]
    return sum(errors) / len(errors) if errors else 0.0


def run_eager(case: Case) -> list:
    model = build(case)
    return run_sequence(case, model, model)


def run_fulmen(case: Case, executors) -> list:
    import fulmen

    model = build(case)
    jitted = fulmen.jit(model, executors=executors)
    return run_sequence(case, model, jitted)


def run_reference(case: Case) -> list:
    model = build(case, torch.float64)
    return run_sequence(case, model, model, reference=True)


def check_case(case: Case, executors=("torch",)) -> None:
    """Run `case` eagerly and through fulmen.jit; raise `Mismatch` where outputs, buffers or
    gradients disagree beyond the tight tolerance and the float64 rule."""
    try:
        expected = run_eager(case)
    except Exception as error:  # noqa: BLE001
        raise InvalidCase(f"eager fails: {type(error).__name__}: {error}") from error
    try:
        actual = run_fulmen(case, list(executors))
    except Exception as error:  # noqa: BLE001 - any error of fulmen's is a finding
        raise Mismatch(f"error: {type(error).__name__}", str(error)[:2000]) from error
    if [w for w, _ in actual] != [w for w, _ in expected]:
        raise Mismatch("structure", f"{[w for w, _ in actual]} vs {[w for w, _ in expected]}")
    reference = None
    low_precision = case.context.autocast or case.context.bf16_weights or any(
        call.change == "autocast" for call in case.calls) or any(
        getattr(b, "autocast_inside", False) for b in getattr(case.model, "blocks", ()))
    for index, ((what, e), (_, a)) in enumerate(zip(expected, actual)):
        kind = what.split()[2]
        if e is None or a is None:
            if (e is None) != (a is None) and not (
                    (a if e is None else e).count_nonzero() == 0):
                raise Mismatch("missing grad", f"{what}: eager {e is None and 'None'}, "
                                               f"fulmen {a is None and 'None'}")
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            raise Mismatch(f"metadata: {kind}", f"{what}: {a.dtype}{list(a.shape)} vs "
                                                 f"{e.dtype}{list(e.shape)}")
        if _tight(a, e):
            continue
        if not e.is_floating_point():
            raise Mismatch(f"value: {kind}", f"{what}: {a.tolist()} vs {e.tolist()}")
        if reference is None:
            reference = run_reference(case)
        ok, detail = _accurate(a, e, reference[index][1], low_precision,
                               _group_noise(expected, reference, what))
        if not ok:
            raise Mismatch(f"value: {kind}", f"{what}: max |fulmen - eager| "
                                             f"{float((a.double() - e.double()).abs().max()):.3g}; "
                                             f"{detail}")


def failure_of(case: Case, executors) -> Mismatch | None:
    try:
        check_case(case, executors)
    except Mismatch as mismatch:
        return mismatch
    return None


def minimize(case: Case, executors, kind: str, attempts: int = 80) -> Case:
    """Greedily apply `smaller` while the failure keeps its kind (at most `attempts` runs)."""
    progress = True
    while progress and attempts > 0:
        progress = False
        for candidate in smaller(case):
            attempts -= 1
            try:
                failure = failure_of(candidate, executors)
            except InvalidCase:  # the simplification made a case eager rejects
                continue
            if failure is not None and failure.kind == kind:
                case, progress = candidate, True
                break
            if attempts <= 0:
                break
    return case


def repro(case: Case, executors) -> str:
    """A standalone script reproducing `case`'s failure (run from the repository root)."""
    policy = ""
    if "codegen" in executors:
        policy = ("from fulmen.executors.codegen import set_compile_policy\n"
                  "set_compile_policy('eager')\n")
    return ("import torch\n" + policy + "from tests.fuzz.models import *  # noqa\n\n"
            f"case = {case!r}\ncheck_case(case, {list(executors)!r})\n")


# ---------------------------------------------------------------------------------------------
# every pattern at least once: explicit examples that `make test` always runs

PATTERNS = (
    # LM training in float32: causal + padding masks, rotary, checkpoint, SwiGLU, MoE top-2,
    # custom autograd.Function, buffer updates, dropout; shapes change, a buffer written from
    # outside, gradients accumulated over the calls
    Case(SeqModel(vocab=13, dim=8, blocks=(
        Attn(heads=2, causal=True, rotary=True, sdpa=False, norm="rms", mask_if=True,
             dropout=True, kv_heads=1),
        Mlp(act="swiglu", checkpoint=True, dropout=True), Moe(experts=3, top_k=2, checkpoint=True),
        Custom("scale"), Custom("linear"), Stat()), learned_pos=True, final_norm="rms",
        head="lm", loss="ce_tokens"),
        Context(training=True, grad=True, accumulate=True),
        (Call(2, 5, (0, 2)), Call(3, 7, ()), Call(2, 5, (1,), change="buffer")), seed=1),
    # HF-style dict output, labels masked in place in the caller's tensor, a KV-cache-like
    # memory growing over the calls, in-place activation and residual, frozen parameters and
    # a float attribute changed between calls
    Case(SeqModel(vocab=10, dim=8, blocks=(
        *((Memory(),) if KNOWN_BUGS else ()), Attn(heads=2, causal=True, sdpa=True),
        Mlp(act="relu", inplace=True, unpad=True)),
        head="lm", loss="ce", dict_output=True, inplace_labels=True, shared=True),
        Context(training=True, grad=True),
        (Call(2, 4, (1,)), Call(2, 4, (2,), change="temperature"), Call(2, 5, (0, 1),
                                                                         change="freeze"),
         Call(2, 4, (1,), change="freeze"), Call(2, 4, (1,), change="hook"),
         Call(2, 4, (), change="grad_hook")), seed=7),
    # evaluation without grad: mask-dependent `if` takes both answers, early exit by a flag
    # flipped between calls, train/eval switches
    Case(SeqModel(vocab=9, dim=12, blocks=(
        Attn(heads=2, causal=False, sdpa=True, mask_if=True), Moe(experts=2, top_k=1),
        Mlp(act="gelu", mult=3, unpad=True)), head="cls", loss="ce", early_exit=True),
        Context(training=False, grad=False),
        (Call(2, 4, (0,)), Call(2, 4, (1, 0)), Call(2, 6, (), change="flag"),
         Call(1, 3, (), change="train")), seed=2),
    # autocast(bf16) around training; an autocast(enabled=False) float32 island inside
    Case(SeqModel(vocab=11, dim=16, blocks=(
        Attn(heads=4, causal=True, rotary=True, sdpa=True, checkpoint=True),
        Mlp(act="gelu", fp32_island=True), Custom("ste")), head="tied", loss="ce"),
        Context(training=True, grad=True, autocast=True),
        (Call(2, 5, (1,)), Call(2, 6, ())), seed=3),
    # bf16 weights; autocast inside the model
    Case(SeqModel(vocab=7, dim=8, blocks=(
        Attn(heads=1, causal=True, sdpa=False, autocast_inside=True), Mlp(act="silu"),
        Stat()), final_norm="layer", head="lm", loss="mse"),
        Context(training=True, grad=True, bf16_weights=True), (Call(2, 4, (1,)),), seed=4),
    # conv stages: batch norm running stats, group norm, residual, checkpoint, max/avg pool;
    # image size and train/eval change between calls
    Case(ConvModel(in_channels=3, stages=(
        ConvStage(channels=4, kernel=3, norm="batch", act="relu", pool="max"),
        ConvStage(channels=4, kernel=3, norm="group", act="silu", residual=True, checkpoint=True),
        ConvStage(channels=6, kernel=1, norm="batch", act="gelu", pool="avg")),
        extra=(Custom("ste"), Stat()), classes=4, loss="ce", channels_last=True),
        Context(training=True, grad=True, accumulate=True, input_grad=True),
        (Call(2, 6), Call(3, 8), Call(2, 6, change="eval"), Call(2, 6, change="autocast"),
         Call(2, 6, change="grad")), seed=5),
    # conv under autocast(float16)
    Case(ConvModel(in_channels=2, stages=(
        ConvStage(channels=4, kernel=3, norm="batch", act="silu", pool="avg"),), classes=3,
        loss="mse"), Context(training=True, grad=True, autocast=True, fp16=True),
        (Call(2, 5),), seed=6),
)
