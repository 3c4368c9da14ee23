"""Running and generating model cases (`tests/fuzz/models.py` describes and builds them):
`run_sequence` runs a case's calls and records every output, input, buffer and gradient;
`cases()` is the hypothesis strategy, `smaller` the minimizer's simplifications and `PATTERNS`
one explicit case per pattern of issue 18."""

import contextlib
import dataclasses
import weakref

import torch
from hypothesis import strategies as st
from torch import nn

from tests.fuzz.models import (
    Attn,
    Call,
    Case,
    Context,
    ConvModel,
    ConvStage,
    Custom,
    Ema,
    Layout,
    Memory,
    Mlp,
    Moe,
    SeqModel,
    Stat,
    cache_tensors,
)

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
        if call.change == "unlabeled":  # every label ignored: eager's mean loss is NaN (0 / 0)
            labels.fill_(-100)
        mask = None
        if call.padding:
            pads = [min(call.padding[i % len(call.padding)], call.length - 1)
                    for i in range(call.batch)]
            mask = torch.arange(call.length)[None, :] < torch.tensor(
                [call.length - p for p in pads])[:, None]
            if model.left_pad:
                mask = mask.flip(-1)
        return ids, mask, labels
    images = torch.randn(call.batch, model.in_channels, call.length, call.length,
                         generator=gen).to(dtype)
    if model.channels_last:
        images = images.to(memory_format=torch.channels_last)
    labels = torch.randint(0, model.classes, (call.batch,), generator=gen)
    return images, labels


_HOOK_SCALES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> [scale]


def _scaled_by(scale: list):
    def hook(module, args, output):
        return output * scale[0]

    return hook


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
    elif change == "hook":  # a forward hook on the first submodule with parameters, scaling
        # by a value in its closure; the next "hook" change changes that value
        first = next(m for m in model.modules() if m is not model and m._parameters)
        if first not in _HOOK_SCALES:
            _HOOK_SCALES[first] = scale = [0.5]
            first.register_forward_hook(_scaled_by(scale))
        _HOOK_SCALES[first][0] = 0.5 * (index + 1)
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


def _new_cache(kind: str):
    if kind == "dynamic":
        import transformers

        return transformers.DynamicCache()
    return [] if kind == "list" else None


def run_sequence(case: Case, model: nn.Module, fn, reference: bool = False,
                 compile_step=None) -> list:
    """Run the case's calls through `fn` (the model itself or its jitted form); return the
    records [(what, tensor)] of every output, buffer, gradient, KV-cache entry and (with an
    optimizer) parameter, in order. `reference`: the float64 run (no autocast, float64 inputs).
    `compile_step(opt.step)`: how the optimizer step is called (`fulmen.jit`; else eagerly)."""
    ctx = case.context
    dtype = torch.float64 if reference else (
        ctx.half if ctx.bf16_weights else torch.float32)
    records = []

    def record(what, tensor):
        records.append((what, None if tensor is None else tensor.detach().clone()))

    cache = _new_cache(ctx.cache) if isinstance(case.model, SeqModel) else None
    step = scheduler = None
    if ctx.optimizer != "none":
        params = list(model.parameters())
        # eps=1e-3: AdamW's first step divides by |g| + eps, so with the default 1e-8 a
        # gradient of 1e-12 (a top-1 router's) turns a 1e-9 gradient difference the rule
        # accepts into an update difference of order lr (tests/fuzz/SUMMARY.md)
        optimizer = (torch.optim.SGD(params, lr=0.1, momentum=0.9) if ctx.optimizer == "sgd"
                     else torch.optim.AdamW(params, lr=0.01, eps=1e-3))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
        step = compile_step(optimizer.step) if compile_step else optimizer.step
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
            out = fn(*inputs) if cache is None else fn(*inputs, cache)
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
        for i, tensor in enumerate(cache_tensors(cache)):
            record(f"call {index} cache {i}", tensor)
        if grad:
            target = loss if loss is not None else logits.float().square().mean()
            if target.requires_grad:
                target.backward()
                for name, p in model.named_parameters():
                    record(f"call {index} grad {name}", p.grad)
                if ctx.input_grad and isinstance(case.model, ConvModel):
                    record(f"call {index} grad input", inputs[0].grad)
                if step is not None:
                    with torch.no_grad():
                        step()
                    scheduler.step()
                    for name, p in model.named_parameters():
                        record(f"call {index} param {name}", p)
    return records


# ---------------------------------------------------------------------------------------------
# strategies

# (`Memory`, a buffer the forward replaces, is replayed, and refused with graph breaks;
# `Layout("view_broadcast")`, `Layout("strides")` and `Context(cache="list")`, once open bugs
# (tests/fuzz/test_found_bugs.py), are generated always)
_norms = st.sampled_from(["layer", "rms", "layer", "rms", "layer_plain", "layer_nobias",
                          "rms_torch", "rms_plain"])
_often = st.sampled_from([True, True, False])
_sometimes = st.sampled_from([False, False, True])
_rarely = st.sampled_from([False, False, False, True])


@st.composite
def _attn(draw, dim):
    heads = draw(st.sampled_from([h for h in (1, 2, 4) if dim % h == 0 and (dim // h) % 2 == 0]))
    kv_heads = draw(st.sampled_from([0] + [k for k in (1, 2) if k < heads and heads % k == 0]))
    return draw(st.builds(Attn, heads=st.just(heads), kv_heads=st.just(kv_heads), causal=st.booleans(), rotary=st.booleans(),
                     sdpa=st.booleans(), norm=_norms, mask_if=st.booleans(),
                     checkpoint=st.booleans(), autocast_inside=_sometimes, dropout=_sometimes,
                     mask=st.sampled_from(["bool", "bool", "float", "bert", "vmap"]),
                     positions_from_mask=st.booleans(),
                     merge=st.sampled_from(["transpose", "transpose", "permute"])))


_mlp = st.builds(Mlp, act=st.sampled_from(["gelu", "silu", "swiglu", "relu"]),
                 mult=st.integers(1, 3), norm=_norms, checkpoint=st.booleans(),
                 fp32_island=_sometimes, inplace=st.booleans(), dropout=_sometimes,
                 unpad=_sometimes)
_moe = st.builds(Moe, experts=st.integers(2, 4), top_k=st.integers(1, 2), norm=_norms,
                 checkpoint=_sometimes, combine=st.sampled_from(
                     ["index_add", "scatter_add", "gather", "scatter"]))
_custom = st.builds(Custom, kind=st.sampled_from(["scale", "ste", "linear"]))
_stat = st.sampled_from([Stat(), Ema()])
_layout = st.builds(Layout, kind=st.sampled_from(
    ["view", "view_broadcast", "strides"]))


@st.composite
def seq_models(draw):
    dim = draw(st.sampled_from([8, 12, 16]))
    kinds = [_attn(dim), _attn(dim), _attn(dim), _mlp, _mlp, _moe, _moe, _custom, _stat,
             _layout]  # repeats weight the draw
    if draw(st.integers(0, 19)) == 0:  # rarely: a store on the module, which must be refused
        kinds.append(st.just(Memory()))
    block = st.one_of(*kinds)
    blocks = tuple(draw(st.lists(block, min_size=1, max_size=4)))
    head = draw(st.sampled_from(["lm", "tied", "cls"]))
    return SeqModel(vocab=draw(st.integers(5, 20)), dim=dim, blocks=blocks,
                    learned_pos=draw(st.booleans()),
                    final_norm=draw(st.sampled_from(["layer", "rms", "none"])), head=head,
                    loss=draw(st.sampled_from(["ce", "ce_tokens", "ce_smooth", "nll", "mse",
                                               "none"])),
                    early_exit=draw(st.booleans()), dict_output=draw(st.booleans()),
                    inplace_labels=draw(st.booleans()), shared=draw(_sometimes),
                    left_pad=draw(_sometimes), embed_scale=draw(st.sampled_from([1.0, 1.0, 0.02])))


_stage = st.builds(ConvStage, channels=st.sampled_from([4, 6]), kernel=st.sampled_from([1, 3]),
                   norm=st.sampled_from(["batch", "batch", "batch_plain", "batch_cumulative",
                                         "batch_nostats", "group", "group_plain", "instance",
                                         "none"]),
                   act=st.sampled_from(["relu", "silu", "gelu"]),
                   pool=st.sampled_from(["max", "avg", "none"]), residual=st.booleans(),
                   checkpoint=st.booleans())
conv_models = st.builds(
    ConvModel, in_channels=st.integers(1, 3), stages=st.lists(_stage, min_size=1, max_size=3)
    .map(tuple), classes=st.integers(2, 6),
    extra=st.lists(st.one_of(_custom, _stat, _layout), max_size=2).map(tuple),
    loss=st.sampled_from(["ce", "ce_smooth", "nll", "mse", "none"]), channels_last=_sometimes)


@st.composite
def cases(draw, min_calls: int = 1):
    """A random case; `min_calls`: at least that many calls (shapes change between calls; 2
    for symbolic sizes, so a trace is reused at other sizes)."""
    model = draw(st.one_of(seq_models(), seq_models(), conv_models))
    seq = isinstance(model, SeqModel)
    # bf16 hides small errors in its rounding: most cases run in float32
    context = draw(st.builds(Context, training=_often, grad=_often, autocast=_sometimes,
                             bf16_weights=_rarely, accumulate=st.booleans(),
                             input_grad=st.booleans(), fp16=_sometimes,
                             optimizer=st.sampled_from(["none", "none", "none", "sgd", "adamw"]),
                             ddp=_rarely, call=st.sampled_from(["module", "module", "argument"]),
                             cache=st.sampled_from(
                                 ["none", "none", "none", "dynamic", "list"]
                                 if seq else ["none"])))
    if context.bf16_weights and context.autocast:
        context = dataclasses.replace(context, autocast=False)
    if context.cache != "none":  # a decode loop: no grad through earlier calls' keys
        context = dataclasses.replace(context, grad=False)
    changes = ["none", "none", "none", "train", "eval", "flag", "buffer", "freeze",
               "temperature", "grad", "autocast", "hook", "grad_hook", "unlabeled"]
    if context.cache != "none":
        changes.remove("grad")
    n_calls = draw(st.integers(min_calls, max(3, min_calls)))
    if context.optimizer != "none" and (context.autocast or context.bf16_weights):
        # half-precision training diverges from eager's after a step (a ReLU input near zero
        # changes sign): later calls are compared at other parameters, so one call
        n_calls = 1
    calls = []
    for i in range(n_calls):
        length = draw(st.integers(2, 7) if seq else st.integers(3, 8))
        padding = tuple(draw(st.lists(st.integers(0, 3), max_size=3))) if seq else ()
        if context.cache != "none":
            length, padding = draw(st.integers(1, 4)), ()
        change = draw(st.sampled_from(changes) if i else st.just("none"))
        # batch norm in training needs more than one value per channel after pooling
        batch = draw(st.integers(1 if seq else 2, 3))
        if context.cache != "none" and calls:
            batch = calls[0].batch  # the cache's batch
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
    for name in ("autocast", "bf16_weights", "accumulate", "input_grad", "fp16", "ddp"):
        if getattr(ctx, name):
            yield dataclasses.replace(case, context=dataclasses.replace(ctx, **{name: False}))
    for name in ("optimizer", "cache"):
        if getattr(ctx, name) != "none":
            yield dataclasses.replace(case, context=dataclasses.replace(ctx, **{name: "none"}))
    if ctx.call != "module":
        yield dataclasses.replace(case, context=dataclasses.replace(ctx, call="module"))
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
                            ("left_pad", False), ("embed_scale", 1.0),
                            ("final_norm", "none"), ("loss", "none"), ("head", "lm")):
            if getattr(model, name) != plain:
                yield dataclasses.replace(case, model=dataclasses.replace(model, **{name: plain}))


# ---------------------------------------------------------------------------------------------
# every pattern at least once: explicit examples that `make test` always runs

PATTERNS = (
    # HF-style masks built with nested torch.vmap (an or/and mask function): causal with
    # padding, and padding alone; lengths change (symbolic sizes), training with gradients
    Case(SeqModel(vocab=11, dim=8, blocks=(
        Attn(heads=2, causal=True, rotary=True, sdpa=True, mask="vmap", mask_if=False),
        Attn(heads=2, causal=False, sdpa=False, mask="vmap", mask_if=False),
        Mlp(act="silu")), head="lm", loss="ce_tokens"),
        Context(training=True, grad=True),
        (Call(2, 5, (0,)), Call(2, 7, (1,)), Call(3, 6, ())), seed=3),
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
        Attn(heads=2, causal=True, sdpa=True),
        Mlp(act="relu", inplace=True, unpad=True)),
        head="lm", loss="ce", dict_output=True, inplace_labels=True, shared=True),
        Context(training=True, grad=True),
        (Call(2, 4, (1,)), Call(2, 4, (2,), change="temperature"), Call(2, 5, (0, 1),
                                                                         change="freeze"),
         Call(2, 4, (1,), change="freeze"), Call(2, 4, (1,), change="hook"),
         Call(2, 4, (), change="grad_hook"), Call(2, 4, (1,), change="hook")), seed=7),
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
    # conv stages: batch norm running stats (one stage checkpointed: eager's backward updates
    # them again), group norm, residual, checkpoint, max/avg pool;
    # image size and train/eval change between calls
    Case(ConvModel(in_channels=3, stages=(
        ConvStage(channels=4, kernel=3, norm="batch", act="relu", pool="max", checkpoint=True),
        ConvStage(channels=4, kernel=3, norm="group", act="silu", residual=True, checkpoint=True),
        ConvStage(channels=6, kernel=1, norm="batch", act="gelu", pool="avg")),
        extra=(Custom("ste"), Stat()), classes=4, loss="ce", channels_last=True),
        Context(training=True, grad=True, accumulate=True, input_grad=True),
        (Call(2, 6), Call(3, 8), Call(2, 6, change="eval"), Call(2, 6, change="autocast"),
         Call(2, 6, change="grad")), seed=5),
    # a KV cache carried between calls: plain list (prefill, then decode steps) with rotary,
    # grouped-query attention and the blocks applied twice; transformers.DynamicCache likewise
    Case(SeqModel(vocab=12, dim=8, blocks=(
        Attn(heads=2, causal=True, rotary=True, kv_heads=1), Mlp(act="swiglu")),
        head="lm", loss="ce", shared=True),
        Context(training=False, grad=False, cache="list"),
        (Call(2, 4), Call(2, 1), Call(2, 2), Call(2, 1, change="temperature")), seed=8),
    Case(SeqModel(vocab=12, dim=8, blocks=(Attn(heads=2, causal=True, sdpa=False),
                                           Attn(heads=1, rotary=True))),
         Context(training=False, grad=False, cache="dynamic", autocast=True),
         (Call(1, 3), Call(1, 1), Call(1, 1)), seed=9),
    # a jitted optimizer step with an LR scheduler (SGD with momentum; AdamW with its state
    # created at the first step), views on strided intermediates and strides read by Python
    Case(SeqModel(vocab=9, dim=8, blocks=(
        Layout("view"), Attn(heads=2), Layout("strides"), Layout("view_broadcast"),
        Mlp(act="gelu")), head="lm", loss="ce"),
         Context(training=True, grad=True, optimizer="sgd", accumulate=True),
         (Call(2, 4, (1,)), Call(2, 4), Call(2, 5, change="freeze")), seed=10),
    Case(ConvModel(in_channels=2, stages=(ConvStage(channels=4, norm="batch", pool="max"),),
                   extra=(Layout("view"),), classes=3),
         Context(training=True, grad=True, optimizer="adamw"), (Call(2, 5), Call(2, 6)), seed=11),
    # DDP(jit(model)) (even seeds) and jit(DDP(model)) (odd) train as eager (gloo, 1 rank);
    # a forward replacing a buffer with a traced tensor: the store is made by every call
    Case(SeqModel(vocab=8, dim=8, blocks=(Attn(heads=2), Moe(experts=2, top_k=1)), loss="ce"),
         Context(training=True, grad=True, ddp=True, optimizer="sgd"),
         (Call(2, 4), Call(2, 4, (1,))), seed=12),
    # attention's output merged through a permutation that moves the head dim innermost: its
    # backward must not read the output back from that view (a wrong q/k gradient before)
    Case(SeqModel(vocab=8, dim=8, blocks=(Attn(heads=2, merge="permute"), Mlp()), loss="ce"),
         Context(training=True, grad=True), (Call(2, 4), Call(2, 4, (1,))), seed=16),
    Case(SeqModel(vocab=8, dim=8, blocks=(Memory(), Mlp())), Context(training=True, grad=True),
         (Call(2, 3), Call(2, 3), Call(3, 3), Call(2, 3)), seed=13),
    # fulmen.jit(loss_fn)(model, batch) with a jitted AdamW step: the model is an argument
    Case(SeqModel(vocab=8, dim=8, blocks=(Attn(heads=2), Mlp(act="gelu"), Stat()), loss="ce"),
         Context(training=True, grad=True, optimizer="adamw", call="argument"),
         (Call(2, 4), Call(2, 4, (1,)), Call(3, 5, change="eval")), seed=15),
    # left padding with rotary positions counted per row, float and BERT-style additive masks,
    # norms without affine, MoE combined by gather and by scatter, an EMA weight
    # buffer used in eval, cross-entropy with label smoothing and class weights
    Case(SeqModel(vocab=10, dim=8, blocks=(
        Attn(heads=2, rotary=True, positions_from_mask=True, mask="float", norm="rms_torch"),
        Attn(heads=2, causal=False, sdpa=False, mask="bert", norm="layer_plain"),
        Moe(experts=3, top_k=2, combine="gather", norm="layer_nobias"),
        Moe(experts=2, top_k=1, combine="scatter", norm="rms_plain"), Ema()),
        final_norm="layer", head="tied", loss="ce_smooth", left_pad=True),
        Context(training=True, grad=True, accumulate=True),
        (Call(2, 5, (1, 2)), Call(2, 5, (2,), change="eval")), seed=14),
    # batch norm without affine, with momentum=None, without running stats; group norm and
    # instance norm without affine; nll loss; a float32 model under autocast(bf16)
    Case(ConvModel(in_channels=2, stages=(
        ConvStage(channels=4, norm="batch_plain", pool="max"),
        ConvStage(channels=4, norm="batch_cumulative", residual=True),
        ConvStage(channels=4, kernel=1, norm="batch_nostats"),
        ConvStage(channels=4, norm="group_plain"), ConvStage(channels=4, norm="instance")),
        classes=3, loss="nll"), Context(training=True, grad=True, autocast=True),
        (Call(2, 6), Call(3, 6), Call(2, 6, change="eval")), seed=15),
    # small activations (GPT-2's init scale) into nn.RMSNorm with bf16 weights: eps matters
    Case(SeqModel(vocab=9, dim=8, blocks=(Mlp(norm="rms_torch"), Attn(heads=2, norm="rms_plain")),
                  final_norm="none", loss="ce", embed_scale=0.02),
         Context(training=True, grad=True, bf16_weights=True), (Call(2, 5),), seed=3),
    # a call whose labels are all ignored (NaN mean loss, zero gradients) between two others
    Case(SeqModel(vocab=9, dim=8, blocks=(Mlp(),), loss="ce_smooth"),
         Context(training=True, grad=True, accumulate=True),
         (Call(2, 4), Call(2, 4, change="unlabeled"), Call(2, 4)), seed=5),
    # conv under autocast(float16)
    Case(ConvModel(in_channels=2, stages=(
        ConvStage(channels=4, kernel=3, norm="batch", act="silu", pool="avg"),), classes=3,
        loss="mse"), Context(training=True, grad=True, autocast=True, fp16=True),
        (Call(2, 5),), seed=6),
)
