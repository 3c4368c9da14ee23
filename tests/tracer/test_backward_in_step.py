"""Training steps with their bookkeeping inside the jitted function: `model.zero_grad()` of a
closed-over model, `optimizer.zero_grad(set_to_none=False)` and a step closing over both the
model and its optimizer (`clip_grad_norm_(model.parameters())`) compile (they ran eagerly),
with the parameters, gradients (None-ness too) and optimizer state of eager's loop.

(`loss.backward()` inside the jitted function still runs the call eagerly: `BackwardInTrace`,
checked last.)"""

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


def _state(model, opt=None) -> list:
    out = [p.detach().clone() for p in model.parameters()]
    out += [None if p.grad is None else p.grad.clone() for p in model.parameters()]
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


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
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


def test_backward_inside_the_step_runs_eagerly_with_eager_results():
    """`loss.backward()` inside the jitted step: the call runs eagerly (BackwardInTrace), with
    eager's losses, gradients and parameters."""
    def loop(jit: bool):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        fn = fulmen.jit(step) if jit else step
        losses = [fn(x, y) for x, y in _batches()]
        assert all(loss.requires_grad for loss in losses)
        return [loss.detach() for loss in losses] + _state(model), fn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, fn = loop(True)
    want, _ = loop(False)
    _same(got, want)
    assert fulmen.compile_stats(fn).eager_calls == 3
