"""Floats read at run time (NOTE [floats read at run time] in `ops/host_float.py`) that the
traced code compares with zero: OneCycleLR with `cycle_momentum=True` changes SGD's and
RMSprop's momentum every step, and their `if momentum != 0` made every float a constant again,
so each step compiled anew (8 compiles, then eager). The key now holds the class of each such
float's sign, and comparing it with zero answers from that class: 2 traces over 10 steps, the
values eager's; a float crossing zero traces once more and takes eager's branch."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
import fulmen.jitted


def _one_cycle_loop(jit: bool, make_opt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20,
                                                cycle_momentum=True)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def rmsprop_step(x, y):  # (RMSprop divides by the root of tiny squared gradients: a
        # compiled backward's rounding grows past any tolerance in 10 steps, so the gradients
        # are made outside the compiled call)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        fn_step()
        opt.zero_grad()
        return loss

    fn_step = fulmen.jit(opt.step) if jit else opt.step
    rmsprop = isinstance(opt, torch.optim.RMSprop)
    fn = rmsprop_step if rmsprop else fulmen.jit(step) if jit else step
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(10):
        x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses.append(fn(x, y).detach())
        sched.step()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return losses + [p.detach().clone() for p in model.parameters()] + state, \
        fn_step if rmsprop else fn


# (a compiled RMSprop step differs from eager's by a few ulps with constant floats too, which
# its division by the root of small squared gradients grows over 10 steps)
@pytest.mark.parametrize("make_opt,rtol", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1e-5),
    (lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.9), 1e-4),
], ids=["sgd", "rmsprop"])
def test_one_cycle_momentum_compiles_twice_as_eager(make_opt, rtol, traces):
    want, _ = _one_cycle_loop(False, make_opt)
    traces[0] = 0
    got, fn = _one_cycle_loop(True, make_opt)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol / 10)
    stats = fulmen.compile_stats(fn)
    assert stats.eager_calls <= 1 and stats.cache_hits >= 7, stats
    assert traces[0] <= 2


def _scaled(x, s):
    if s != 0:
        return x * s
    return x + 1.0


def test_a_float_argument_crossing_zero_takes_eagers_branch(traces):
    jfn = fulmen.jit(_scaled)
    x = torch.arange(4.0)
    for s in [0.5, 0.7, 0.9, 0.0, -0.3, -0.4, 0.0, 1.5]:
        torch.testing.assert_close(jfn(x, s), _scaled(x, s))
    assert traces[0] <= 4  # (the first call runs eagerly; then one trace per sign class)


class _Config:
    def __init__(self) -> None:
        self.scale = 0.5


def test_a_float_attribute_crossing_zero_takes_eagers_branch(traces):
    config = _Config()

    def fn(x):
        return _scaled(x, config.scale)

    jfn = fulmen.jit(fn)
    x = torch.arange(4.0)
    for s in [0.5, 0.7, 0.9, 0.0, 0.0, -0.3, 1.5, 0.0]:
        config.scale = s
        torch.testing.assert_close(jfn(x), fn(x))
    assert traces[0] <= 4


def test_a_jitted_sgd_step_whose_momentum_drops_to_zero_keeps_eagers_state(traces):
    def run(jit):
        torch.manual_seed(0)
        params = [torch.randn(3, 4, requires_grad=True)]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        step = fulmen.jit(opt.step) if jit else opt.step
        for i, momentum in enumerate([0.9, 0.8, 0.7, 0.0, 0.0, 0.6]):
            opt.param_groups[0]["momentum"] = momentum
            params[0].grad = torch.full((3, 4), 1.0 + i)
            step()
        return [params[0].detach().clone(), opt.state[params[0]]["momentum_buffer"]]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _adafactor_loop(jit: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    fn = fulmen.jit(step) if jit else step
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(10):
        x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses.append(fn(x, y).detach())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return losses + [p.detach().clone() for p in model.parameters()] + state, fn


def test_adafactor_min_and_max_of_run_time_floats_compile(traces):
    """Adafactor's `min(lr, 1 / step ** 0.5)` and `max(eps2, norm.item() / ...)` are recorded
    (`host_float.pick_function`): its step compiled per step (a graph break with a new answer
    each step, then eager); now 2 traces over 10 steps."""
    want, _ = _adafactor_loop(False)
    traces[0] = 0
    got, fn = _adafactor_loop(True)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    stats = fulmen.compile_stats(fn)
    assert stats.eager_calls <= 1 and stats.cache_hits >= 7, stats
    assert traces[0] <= 2


def _clipped(x, s):
    return x * min(s, 0.5) + max(0.25, s)


def test_min_and_max_of_a_float_argument_pick_as_eager(traces):
    jfn = fulmen.jit(_clipped)
    x = torch.arange(4.0)
    for s in [0.1, 0.2, 0.5, 0.7, 0.25, -1.0, 3.0]:
        torch.testing.assert_close(jfn(x, s), _clipped(x, s), rtol=0, atol=0)
    assert traces[0] <= 3  # (the first call runs eagerly; a trace per sign class)
