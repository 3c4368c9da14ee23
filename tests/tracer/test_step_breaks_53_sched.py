"""`scheduler.step()` inside a jitted training step: the scheduler computes the next learning
rate from the current one, a float read at run time, and stores it into the optimizer's
`param_groups` (and its own `_last_lr`). Such a store raised `FloatDecided` and every float
became a constant again, so each step compiled anew (8 compiles, then eager). The epilogue now
stores the value the compiled program computes: at most 3 traces over 10 steps, the losses,
parameters, optimizer state and scheduler state (learning rates as Python floats) eager's.

A rate computed from the scheduler's `last_epoch` traced as a symbolic integer (LinearLR's) is
a SymFloat, whose stored expression failed with a NameError (`torch` missing from the
epilogue's number function) and would not round as eager's arithmetic: such a store keeps the
integers constant (a trace per step, eager's values). OneCycleLR inside the step (its phases
computed from `last_epoch`) still compiles per step: its rates are exact, so it is left out."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
import fulmen.jitted

_SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.9),
    "exponential": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, 0.8),
    "warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda epoch: min(1.0, (epoch + 1) / 3)),
}


def _loop(jit: bool, make_sched, steps: int = 10):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = make_sched(opt)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        return loss

    fn = fulmen.jit(step) if jit else step
    generator = torch.Generator().manual_seed(1)
    values, rates = [], []
    for _ in range(steps):
        x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values.append(fn(x, y).detach())
        group = opt.param_groups[0]
        rates.append((group["lr"], group["momentum"], *sched.get_last_lr(), sched.last_epoch))
    values += [p.detach().clone() for p in model.parameters()]
    values += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return values, rates, fn


@pytest.mark.parametrize("name", sorted(_SCHEDULERS))
def test_scheduler_step_inside_the_step_compiles_as_eager(name, traces):
    want, want_rates, _ = _loop(False, _SCHEDULERS[name])
    traces[0] = 0
    got, got_rates, fn = _loop(True, _SCHEDULERS[name])
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got_rates == want_rates  # (exactly: the same Python floats and integers)
    assert all(type(r) is float for rates in got_rates for r in rates[:-1])
    stats = fulmen.compile_stats(fn)
    assert stats.eager_calls <= 1 and stats.cache_hits >= 6, stats
    assert traces[0] <= 3


def test_linear_lr_inside_the_step_stores_eagers_rates():
    make = lambda opt: torch.optim.lr_scheduler.LinearLR(opt, 0.5, 1.0, 5)  # noqa: E731
    want, want_rates, _ = _loop(False, make, 6)  # (the rate stops changing after 5 steps)
    got, got_rates, fn = _loop(True, make, 6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got_rates == want_rates
    assert fulmen.compile_stats(fn).calls == 6
