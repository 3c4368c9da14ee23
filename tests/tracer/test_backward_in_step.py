"""Training steps with their bookkeeping inside the jitted function: `model.zero_grad()` of a
closed-over model, `optimizer.zero_grad(set_to_none=False)` and a step closing over both the
model and its optimizer (`clip_grad_norm_(model.parameters())`) compile (they ran eagerly),
with the parameters, gradients (None-ness too) and optimizer state of eager's loop.

A whole training step with `loss.backward()` inside (`fulmen.tracer.backward_in_trace`)
compiles to one trace: the losses, every `.grad` (None-ness too), the parameters and the
optimizer state equal eager's over repeated calls with changing data; what it does not trace
runs eagerly, with eager's results."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _batches(count: int = 3):
    generator = torch.Generator().manual_seed(1)
    # changing batch sizes: 5, 7, 5
    return [(torch.randn(5 + 2 * (i % 2), 6, generator=generator),
             torch.randn(5 + 2 * (i % 2), 3, generator=generator)) for i in range(count)]


def _same(got, want) -> None:
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert a.stride() == b.stride()  # (a gradient laid out as eager's)


def _state(model, opt=None) -> list:
    out = [p.detach().clone() for p in model.parameters()]
    out += [None if p.grad is None else p.grad.detach() for p in model.parameters()]
    if opt is not None:
        out += [value for per_param in opt.state.values() for value in per_param.values()
                if isinstance(value, torch.Tensor)]
    return out


def _zero_grad_then_loss_loop(jit: bool):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(x, y):
        model.zero_grad()  # set_to_none=True on a model the function closes over
        return F.mse_loss(model(x), y)

    fn = fulmen.jit(loss_fn) if jit else loss_fn
    losses = []
    for x, y in _batches(4):
        loss = fn(x, y)
        losses.append(loss.detach())
        loss.backward()
        opt.step()
    return losses + _state(model), fn


def test_model_zero_grad_of_a_closed_over_model_compiles():
    """`p.grad = None` on a closed-over model's parameters is replayed after each call (it
    ran eagerly: 'setting the .grad of captured0'); without the replay the gradients would
    accumulate over the steps."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, fn = _zero_grad_then_loss_loop(True)
    want, _ = _zero_grad_then_loss_loop(False)
    _same(got, want)
    assert fulmen.compile_stats(fn).eager_calls == 0


def test_model_zero_grad_in_a_function_with_a_graph_break_runs_eagerly():
    """With graph breaks the module stores are settled by replaying them while tracing, which
    a gradient's clear cannot undo: such calls run eagerly, with eager's gradients."""
    def loop(jit: bool):
        model = _model()

        def loss_fn(x, y):
            model.zero_grad()
            out = model(x)
            return F.mse_loss(out if out.sum() > 0 else -out, y)

        fn = fulmen.jit(loss_fn) if jit else loss_fn
        for x, y in _batches(3):
            fn(x, y).backward()
        return _state(model), fn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, fn = loop(True)
    want, _ = loop(False)
    _same(got, want)
    assert fulmen.compile_stats(fn).eager_calls >= 1


def _optimizer_step_loop(make_opt, jit: bool, set_to_none: bool):
    model = _model()
    opt = make_opt(model.parameters())

    def step():
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)

    fn = fulmen.jit(step) if jit else step
    for x, y in _batches(4):
        F.mse_loss(model(x), y).backward()
        fn()
    return _state(model, opt), fn


@pytest.mark.parametrize("make_opt,set_to_none", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), False),
    (lambda ps: torch.optim.Adam(ps, lr=0.01), True),
    (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), False),
], ids=["sgd", "adam", "adamw"])
def test_optimizer_step_and_zero_grad_compile(make_opt, set_to_none):
    """`opt.zero_grad(set_to_none=False)` calls `p.grad.requires_grad_(False)` on gradients
    that already have it False: a no-op (it ran the call eagerly: 'in-place changes of tensor
    metadata'); the gradients end zeroed in place (not None), as in eager."""
    got, fn = _optimizer_step_loop(make_opt, True, set_to_none)
    want, _ = _optimizer_step_loop(make_opt, False, set_to_none)
    _same(got, want)
    stats = fulmen.compile_stats(fn)
    assert stats.eager_calls == 0 and stats.calls == 4


def _clip_step_loop(variant: str, jit: bool):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():  # closes over both the model and its optimizer
        if variant == "clip":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            norm = sum(p.grad.square().sum() for p in model.parameters())
        opt.step()
        model.zero_grad()
        return norm

    fn = fulmen.jit(step) if jit else step
    norms = []
    for x, y in _batches(4):
        F.mse_loss(model(x), y).backward()
        norms.append(fn())
    return norms + _state(model, opt), fn


@pytest.mark.parametrize("variant", ["clip", "read"])
def test_a_step_closing_over_the_model_and_its_optimizer_compiles(variant):
    """The model's parameters and gradients, reached through the closed-over model
    (`clip_grad_norm_(model.parameters())`, `model.zero_grad()`), are the optimizer's inputs,
    not second inputs aliasing them (the call ran eagerly: 'may share memory, and input 9 is
    modified in place'); the clipping scales the gradients the optimizer steps with."""
    got, fn = _clip_step_loop(variant, True)
    want, _ = _clip_step_loop(variant, False)
    _same(got, want)
    assert fulmen.compile_stats(fn).eager_calls == 0


_OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def _train(body, jit: bool, make_opt=_OPTIMIZERS["sgd"], model_fn=_model, calls: int = 3,
           batches=None, outside=None):
    """`calls` calls of the step `body(model, opt, x, y)` (jitted or not) on a fresh model and
    optimizer; returns the losses, the parameters, gradients and optimizer state, and the
    callable."""
    model = model_fn()
    opt = make_opt(model.parameters())

    def step(x, y):  # closes over the model and its optimizer, as users write it
        return body(model, opt, x, y)

    fn = fulmen.jit(step) if jit else step
    losses = []
    for index, (x, y) in enumerate(batches or _batches(calls)):
        torch.manual_seed(index)
        loss = fn(x, y)
        losses.append(None if loss is None else loss.detach())
        if outside is not None:
            outside(opt, index)
    return losses + _state(model, opt), fn


def _check(body, **options):
    got, fn = _train(body, True, **options)
    want, _ = _train(body, False, **options)
    _same(got, want)
    return fulmen.compile_stats(fn)


def _plain_step(set_to_none):
    def body(model, opt, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss
    return body


@pytest.mark.parametrize("optimizer,set_to_none", [("sgd", True), ("adam", False),
                                                   ("adamw", True)])
def test_a_training_step_with_backward_inside_compiles(optimizer, set_to_none):
    """forward, `loss.backward()`, `opt.step()`, `opt.zero_grad()` in one compiled trace (the
    call ran eagerly: BackwardInTrace), on batches of changing sizes."""
    stats = _check(_plain_step(set_to_none), make_opt=_OPTIMIZERS[optimizer])
    assert stats.eager_calls == 0 and stats.calls == 3


def _accumulating_step(model, opt, x, y):
    """Two micro-batches, each with its backward, then one optimizer step."""
    half = x.shape[0] // 2
    first = F.mse_loss(model(x[:half]), y[:half])
    first.backward()
    second = F.mse_loss(model(x[half:]), y[half:])
    second.backward()
    opt.step()
    opt.zero_grad()
    return first + second


def _step_without_zero_grad(model, opt, x, y):
    """The gradients accumulate across calls (into the .grad the last call left, in place)."""
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("body", [_accumulating_step, _step_without_zero_grad],
                         ids=["within_a_call", "across_calls"])
def test_gradient_accumulation(body):
    stats = _check(body, make_opt=_OPTIMIZERS["adam"])
    assert stats.eager_calls == 0


def _clipping_step(model, opt, x, y):
    opt.zero_grad()  # before the backward: the gradients start from None
    loss = F.cross_entropy(model(x), y.argmax(dim=1))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    opt.step()
    return loss + 0 * norm


def test_grad_clipping_between_backward_and_step_and_a_scheduler_outside():
    """`clip_grad_norm_(model.parameters())` reads the gradients the backward made (through
    the model, not the optimizer) and scales them in place; an LR scheduler steps outside."""
    schedulers = {}

    def outside(opt, index):
        schedulers.setdefault(id(opt), torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)).step()

    stats = _check(_clipping_step, outside=outside)
    assert stats.eager_calls == 0


def _dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.3), nn.GELU(), nn.Linear(12, 3))


def test_a_model_with_dropout():
    """Seeded before each call, the compiled step draws eager's dropout masks."""
    stats = _check(_plain_step(True), model_fn=_dropout_model)
    assert stats.eager_calls == 0


@pytest.mark.slow
def test_a_tiny_llama_train_step():
    T = pytest.importorskip("transformers")

    def llama():
        torch.manual_seed(0)
        return T.LlamaForCausalLM(T.LlamaConfig(
            num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=96, max_position_embeddings=64, pad_token_id=0))

    def body(model, opt, ids, labels):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    generator = torch.Generator().manual_seed(2)
    batches = [(ids, ids.clone()) for ids in
               (torch.randint(3, 96, (2, 8), generator=generator) for _ in range(2))]
    got, fn = _train(body, True, make_opt=_OPTIMIZERS["adamw"], model_fn=llama, batches=batches)
    want, _ = _train(body, False, make_opt=_OPTIMIZERS["adamw"], model_fn=llama,
                     batches=batches)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            assert a.stride() == b.stride()
    assert fulmen.compile_stats(fn).eager_calls == 0


def test_the_returned_loss_requires_grad_through_a_spent_graph():
    """Eager's loss requires grad, its graph spent by the step's backward: backward through it
    raises. So does the compiled step's; a returned value computed without grad does not
    require it."""
    def outputs(jit: bool):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            return _plain_step(True)(model, opt, x, y), y * 2

        fn = fulmen.jit(step) if jit else step
        return fn(*_batches(1)[0]), fn

    (loss, doubled), fn = outputs(True)
    (eager_loss, eager_doubled), _ = outputs(False)
    assert fulmen.compile_stats(fn).eager_calls == 0
    assert (loss.requires_grad, doubled.requires_grad) == (eager_loss.requires_grad,
                                                           eager_doubled.requires_grad)
    assert loss.grad_fn is not None
    torch.testing.assert_close(loss.detach(), eager_loss.detach())
    for value in (loss, eager_loss):
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            value.backward()


def _hooked_model():
    model = _model()
    model[0].weight.register_hook(lambda grad: grad * 2)
    return model


def _retaining_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    opt.step()
    opt.zero_grad()
    return loss


def _input_grad_step(model, opt, x, y):
    x = x.clone().requires_grad_(True)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _autograd_grad_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    opt.step()
    return loss


def _live_output_step(model, opt, x, y):
    """The value returned is computed with grad after the step: eager gives it a live graph."""
    _plain_step(True)(model, opt, x, y)
    return F.mse_loss(model(x), y)


def _two_steps(model, opt, x, y):
    """Two optimizer steps in one call: the second loss reads the updated parameters."""
    total = 0
    for half in (slice(0, 2), slice(2, None)):
        loss = F.mse_loss(model(x[half]), y[half])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = total + loss
    return total


@pytest.mark.parametrize("case", ["hook", "retain_graph", "fresh_leaf", "autograd_grad",
                                  "two_steps", "live_output"])
def test_what_is_not_traced_runs_eagerly_with_eager_results(case):
    """(`two_steps`: the second loss reads parameters updated in place under no_grad, which
    the trace's autodiff would see as computed values, not leaves: refused.)"""
    body = {"hook": _plain_step(True), "retain_graph": _retaining_step,
            "fresh_leaf": _input_grad_step, "autograd_grad": _autograd_grad_step,
            "two_steps": _two_steps, "live_output": _live_output_step}[case]
    model_fn = _hooked_model if case == "hook" else _model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = _check(body, model_fn=model_fn, calls=3)
    assert stats.eager_calls >= 1
