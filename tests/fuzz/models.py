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


@dataclass(frozen=True)
class Mlp:
    act: str = "gelu"  # gelu | silu | swiglu | relu
    mult: int = 2
    norm: str = "layer"
    checkpoint: bool = False
    fp32_island: bool = False  # the norm runs under autocast(enabled=False) in float32


@dataclass(frozen=True)
class Moe:
    """Top-k routed experts (Mixtral style): `torch.where(idx == e)` has a data-dependent
    shape, `if tokens.numel() == 0: continue` is a value-dependent branch."""

    experts: int = 3
    top_k: int = 2
    norm: str = "rms"


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
class SeqModel:
    vocab: int = 11
    dim: int = 8
    blocks: tuple = ()
    learned_pos: bool = False
    final_norm: str = "layer"  # layer | rms | none
    head: str = "lm"  # lm | tied | cls
    loss: str = "ce"  # ce | mse | none
    early_exit: bool = False  # eval mode skips the head's last block (a module flag)


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
    loss: str = "ce"  # ce | mse | none


@dataclass(frozen=True)
class Call:
    """One call: batch size, sequence length (or image size), padded tail lengths, and a state
    change made just before it (`train`, `eval`, `flag`: flip a module attribute read by the
    forward, `buffer`: write a buffer in place from outside)."""

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
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        head_dim = dim // spec.heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def core(self, x, mask):
        spec = self.spec
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, spec.heads, d // spec.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
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
        if spec.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            if keep is not None:
                scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
            out = scores.softmax(-1) @ v
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
            h = F.silu(h)
        else:
            h = torch.relu(h)
        return self.down(h)

    def forward(self, x, mask):
        if self.spec.fp32_island:
            with torch.autocast("cpu", enabled=False):
                h = self.norm(x)
        else:
            h = self.norm(x)
        if self.spec.checkpoint and torch.is_grad_enabled():
            h = checkpoint(self.core, h, use_reentrant=False)
        else:
            h = self.core(h)
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


class CustomFn(nn.Module):
    def __init__(self, spec: Custom, dim):
        super().__init__()
        self.spec = spec
        self.register_buffer("scale", torch.tensor(4.0))

    def forward(self, x, mask=None):
        if self.spec.kind == "scale":
            return _ScaleGrad.apply(x)
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


_SEQ_BLOCKS = {Attn: Attention, Mlp: MLP, Moe: MoE, Custom: CustomFn, Stat: Stats}


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
        for block in blocks:
            h = block(h, mask)
        h = self.norm(h)
        if self.spec.head == "cls":  # mean over the unpadded positions
            if mask is None:
                h = h.mean(1)
            else:
                m = mask[..., None].to(h.dtype)
                h = (h * m).sum(1) / m.sum(1)
        logits = self.head(h)
        if self.spec.loss == "none":
            return logits
        if self.spec.loss == "mse":
            return logits, F.mse_loss(logits.float(), torch.zeros_like(logits, dtype=torch.float))
        if self.spec.head == "cls":
            return logits, F.cross_entropy(logits.float(), labels[:, 0] % 3)
        if mask is not None:
            labels = labels.masked_fill(~mask, -100)
        return logits, F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                       ignore_index=-100)


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
    torch.float64 (the reference), else bfloat16 where the context asks for bf16 weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed)
        model = SeqNet(case.model) if isinstance(case.model, SeqModel) else ConvNet(case.model)
    if dtype is None and case.context.bf16_weights:
        dtype = torch.bfloat16
    if dtype is not None:
        model = model.to(dtype)
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
    labels = torch.randint(0, model.classes, (call.batch,), generator=gen)
    return images, labels


def _change_state(model: nn.Module, change: str, index: int) -> None:
    if change == "train":
        model.train()
    elif change == "eval":
        model.eval()
    elif change == "flag":
        for module in model.modules():
            if hasattr(module, "early_exit"):
                module.early_exit = not module.early_exit
    elif change == "buffer":
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if buffer.is_floating_point() and "inv_freq" not in name:
                    buffer.add_(0.25 * (index + 1))


def run_sequence(case: Case, model: nn.Module, fn, reference: bool = False) -> list:
    """Run the case's calls through `fn` (the model itself or its jitted form); return the
    records [(what, tensor)] of every output, buffer and gradient, in order. `reference`: the
    float64 run (no autocast, float64 inputs)."""
    ctx = case.context
    dtype = torch.float64 if reference else (
        torch.bfloat16 if ctx.bf16_weights else torch.float32)
    records = []
    for index, call in enumerate(case.calls):
        _change_state(model, call.change, index)
        if not ctx.accumulate:
            for p in model.parameters():
                p.grad = None
        inputs = make_inputs(case, index, dtype)
        grad_mode = torch.enable_grad() if ctx.grad else torch.no_grad()
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if ctx.autocast
                    else contextlib.nullcontext())
        with grad_mode, autocast:
            out = fn(*inputs)
        logits, loss = out if isinstance(out, tuple) else (out, None)
        records.append((f"call {index} output", logits))
        if loss is not None:
            records.append((f"call {index} loss", loss))
        for name, buffer in model.named_buffers():
            records.append((f"call {index} buffer {name}", buffer))
        if ctx.grad:
            target = loss if loss is not None else logits.float().square().mean()
            if target.requires_grad:
                target.backward()
                for name, p in model.named_parameters():
                    records.append((f"call {index} grad {name}", p.grad))
    return [(what, None if t is None else t.detach().clone()) for what, t in records]


# ---------------------------------------------------------------------------------------------
# strategies

_norms = st.sampled_from(["layer", "rms"])


def _attn(dim):
    heads = st.sampled_from([h for h in (1, 2, 4) if dim % h == 0 and (dim // h) % 2 == 0])
    return st.builds(Attn, heads=heads, causal=st.booleans(), rotary=st.booleans(),
                     sdpa=st.booleans(), norm=_norms, mask_if=st.booleans(),
                     checkpoint=st.booleans(), autocast_inside=st.booleans())


_mlp = st.builds(Mlp, act=st.sampled_from(["gelu", "silu", "swiglu", "relu"]),
                 mult=st.integers(1, 3), norm=_norms, checkpoint=st.booleans(),
                 fp32_island=st.booleans())
_moe = st.builds(Moe, experts=st.integers(2, 4), top_k=st.integers(1, 2), norm=_norms)
_custom = st.builds(Custom, kind=st.sampled_from(["scale", "ste"]))
_stat = st.just(Stat())


@st.composite
def seq_models(draw):
    dim = draw(st.sampled_from([8, 12, 16]))
    block = st.one_of(_attn(dim), _mlp, _moe, _custom, _stat)
    blocks = tuple(draw(st.lists(block, min_size=1, max_size=4)))
    head = draw(st.sampled_from(["lm", "tied", "cls"]))
    return SeqModel(vocab=draw(st.integers(5, 20)), dim=dim, blocks=blocks,
                    learned_pos=draw(st.booleans()),
                    final_norm=draw(st.sampled_from(["layer", "rms", "none"])), head=head,
                    loss=draw(st.sampled_from(["ce", "mse", "none"])),
                    early_exit=draw(st.booleans()))


_stage = st.builds(ConvStage, channels=st.sampled_from([4, 6]), kernel=st.sampled_from([1, 3]),
                   norm=st.sampled_from(["batch", "group", "none"]),
                   act=st.sampled_from(["relu", "silu", "gelu"]),
                   pool=st.sampled_from(["max", "avg", "none"]), residual=st.booleans(),
                   checkpoint=st.booleans())
conv_models = st.builds(
    ConvModel, in_channels=st.integers(1, 3), stages=st.lists(_stage, min_size=1, max_size=3)
    .map(tuple), classes=st.integers(2, 6),
    extra=st.lists(st.one_of(_custom, _stat), max_size=2).map(tuple),
    loss=st.sampled_from(["ce", "mse", "none"]))


@st.composite
def cases(draw):
    model = draw(st.one_of(seq_models(), conv_models))
    seq = isinstance(model, SeqModel)
    context = draw(st.builds(Context, training=st.booleans(), grad=st.booleans(),
                             autocast=st.booleans(), bf16_weights=st.booleans(),
                             accumulate=st.booleans()))
    if context.bf16_weights and context.autocast:
        context = dataclasses.replace(context, autocast=False)
    n_calls = draw(st.integers(1, 3))
    calls = []
    for i in range(n_calls):
        length = draw(st.integers(2, 7) if seq else st.integers(3, 8))
        padding = tuple(draw(st.lists(st.integers(0, 3), max_size=3))) if seq else ()
        change = draw(st.sampled_from(["none", "none", "train", "eval", "flag", "buffer"])
                      if i else st.just("none"))
        calls.append(Call(batch=draw(st.integers(1, 3)), length=length, padding=padding,
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
    for name in ("autocast", "bf16_weights", "accumulate"):
        if getattr(ctx, name):
            yield dataclasses.replace(case, context=dataclasses.replace(ctx, **{name: False}))
    for index, call in enumerate(case.calls):
        simpler = [dataclasses.replace(call, change="none"), dataclasses.replace(call, padding=())]
        for new in simpler:
            if new != call:
                calls = case.calls[:index] + (new,) + case.calls[index + 1:]
                yield dataclasses.replace(case, calls=calls)
    # simplify each block's own flags
    for i, part in enumerate(parts):
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if value is True:
                new = dataclasses.replace(part, **{f.name: False})
                yield dataclasses.replace(case, model=dataclasses.replace(
                    model, **{field: parts[:i] + (new,) + parts[i + 1:]}))
    if isinstance(model, SeqModel):
        for name, plain in (("learned_pos", False), ("early_exit", False),
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


_TIGHT = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
          torch.float64: (1e-7, 1e-7)}
# the fp64 rule: fulmen's error vs float64 may be at most MULTIPLIER x eager's, plus a floor
# relative to the reference's magnitude
_MULTIPLIER = {torch.float32: 2.0, torch.bfloat16: 3.0}
_FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3}


def _rms(t):
    return float(t.double().square().mean().sqrt()) if t.numel() else 0.0


def _tight(a, e) -> bool:
    if not e.is_floating_point():
        return torch.equal(a, e)
    rtol, atol = _TIGHT[e.dtype]
    return torch.allclose(a.double(), e.double(), rtol=rtol, atol=atol, equal_nan=True)


def _accurate(a, e, ref, low_precision: bool) -> tuple[bool, str]:
    """The float64 accuracy rule (torch._dynamo's): |fulmen - fp64| <= k |eager - fp64| + floor,
    as root mean squares; k = 2 for float32, 3 where bf16 took part."""
    if ref is None or ref.shape != e.shape or not torch.isfinite(ref).all():
        return False, "no finite float64 reference"
    if not (torch.isfinite(a) == torch.isfinite(e)).all():
        return False, "non-finite values differ"
    dtype = torch.bfloat16 if low_precision or e.dtype == torch.bfloat16 else torch.float32
    ref = ref.double()
    a_err, e_err = _rms(a.double() - ref), _rms(e.double() - ref)
    bound = _MULTIPLIER[dtype] * e_err + _FLOOR[dtype] * _rms(ref) + 1e-7
    return a_err <= bound, f"rms error vs fp64 {a_err:.3g}, eager's {e_err:.3g}, bound {bound:.3g}"


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
    expected = run_eager(case)
    try:
        actual = run_fulmen(case, list(executors))
    except Exception as error:  # noqa: BLE001 - any error of fulmen's is a finding
        raise Mismatch(f"error: {type(error).__name__}", str(error)[:2000]) from error
    if [w for w, _ in actual] != [w for w, _ in expected]:
        raise Mismatch("structure", f"{[w for w, _ in actual]} vs {[w for w, _ in expected]}")
    reference = None
    low_precision = case.context.autocast or case.context.bf16_weights or any(
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
        ok, detail = _accurate(a, e, reference[index][1], low_precision)
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
            failure = failure_of(candidate, executors)
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
