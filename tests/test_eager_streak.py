"""Calls that keep running eagerly with a new cache key each time are not traced each time
(`fulmen.eager_streak`), and stay equal to eager."""

import copy
import warnings

import torch

import fulmen
from tests.spies import count_traces


def _train_step(model, optimizer, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # traced inside the function (`fulmen.tracer.backward_in_trace`)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _run_steps(monkeypatch, hooked: bool):
    """40 steps of `_train_step` jitted beside eager, a StepLR changing the learning rate (part
    of the key) on every call; a hook on a parameter (`hooked`) makes each call run eagerly."""
    torch.manual_seed(0)
    eager_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = copy.deepcopy(eager_model)
    if hooked:
        model[0].weight.register_hook(lambda grad: grad)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (eager_model, model)]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.9) for o in optimizers]
    step = fulmen.jit(_train_step)
    traces = count_traces(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(40):
            x, y = torch.randn(3, 4), torch.randn(3, 2)
            expected = _train_step(eager_model, optimizers[0], x, y)
            torch.testing.assert_close(step(model, optimizers[1], x, y), expected)
            for scheduler in schedulers:
                scheduler.step()
    for a, b in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b)
    return fulmen.compile_stats(step), traces


def test_a_whole_training_step_with_a_scheduler_compiles_once(monkeypatch):
    stats, traces = _run_steps(monkeypatch, hooked=False)
    assert stats.eager_calls == 0
    assert len(traces) <= 2  # static, then the batch's size... both read the lr at run time


def test_an_eager_training_step_with_a_scheduler_is_not_traced_on_every_call(monkeypatch):
    stats, traces = _run_steps(monkeypatch, hooked=True)  # a parameter hook: eager calls
    assert stats.eager_calls == 40
    assert len(traces) <= 8  # 2, then one every 4th, 8th, 16th skipped miss


def test_a_call_that_can_compile_again_is_compiled_after_a_streak(monkeypatch):
    def f(x, scale, backward):
        y = (x * scale).sin().sum()
        if backward:
            y.backward()
        return y.detach() * 2

    jf = fulmen.jit(f)
    x = torch.randn(5, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(6):
            jf(x, 1.0 + i, True)
        for _ in range(40):
            torch.testing.assert_close(jf(x, 0.5, False), f(x, 0.5, False))
    stats = fulmen.compile_stats(jf)
    assert stats.cache_hits >= 30  # traced again within a few calls, then served compiled


def test_an_optimizer_state_key_is_named_by_shape_not_by_values():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(opt):
        opt.step()

    jstep = fulmen.jit(step)
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        jstep(optimizer)
    reasons = " ".join(" ".join(r) for r in fulmen.compile_stats(jstep).recompile_reasons)
    assert "Parameter containing" not in reasons
    assert "opt.state[<" in reasons and " (2, 3) at 0x" in reasons


def _tagged_step(model, optimizer, x, y, tag: str):
    return _train_step(model, optimizer, x, y)


def test_a_streak_of_eager_calls_with_a_new_key_each_time_skips_most_traces(monkeypatch):
    """A string argument that changes on every call (a step's log tag) is part of the cache key,
    so every call misses; after two misses that ran eagerly for one reason, most run eagerly
    untraced (the learning rate of the test above is now a traced input and no longer changes
    the key; a hook on a parameter keeps the step with its backward eager)."""
    torch.manual_seed(0)
    eager_model = torch.nn.Linear(4, 2)
    model = copy.deepcopy(eager_model)
    model.weight.register_hook(lambda grad: grad)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager_model, model)]
    step = fulmen.jit(_tagged_step)
    traces = count_traces(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(40):
            x, y = torch.randn(3, 4), torch.randn(3, 2)
            expected = _tagged_step(eager_model, optimizers[0], x, y, f"step {i}")
            torch.testing.assert_close(step(model, optimizers[1], x, y, f"step {i}"), expected)
    for a, b in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b)
    assert fulmen.compile_stats(step).eager_calls == 40
    assert len(traces) <= 8  # 2, then one every 4th, 8th, 16th skipped miss
