"""Training steps that still run eagerly run so cleanly: eager's values, and at most 3 traces
over 10 steps (not a trace per step). A graph break after `loss.backward()` (`print(loss.item())`
after the optimizer step; RAdam's `if rho_t > 5` on its step count) and a D-then-G GAN step
(the generator's loss reads the discriminator's parameters its `opt_d.step()` just updated:
`NoGradUpdate`) are refused at the first trace and remembered (`_Jitted._eager_keys`,
`fulmen.eager_streak`)."""

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen
import fulmen.jitted


def _printing_step(model, opt):
    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"loss {loss.item():.4f}", file=sys.stderr)
        return loss
    return step


def _radam_step(model, _):
    opt = torch.optim.RAdam(model.parameters(), lr=0.01)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def _gan_step(model, _):
    generator, critic = model[0], nn.Linear(12, 1)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(critic.parameters(), lr=1e-2)

    def step(x, y):
        real = F.pad(y, (0, 9))
        loss_d = F.softplus(-critic(real)).mean() + F.softplus(critic(generator(x).detach())).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        loss_g = F.softplus(-critic(generator(x))).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        return loss_g
    return step


def _loop(jit: bool, make_step):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = make_step(model, opt)
    fn = fulmen.jit(step) if jit else step
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(10):
        x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses.append(fn(x, y).detach())
    return losses + [p.detach().clone() for p in model.parameters()], fn


@pytest.mark.parametrize("make_step", [_printing_step, _radam_step, _gan_step],
                         ids=["print_after_step", "radam", "gan_d_then_g"])
def test_a_step_that_runs_eagerly_is_traced_at_most_three_times(make_step, traces):
    want, _ = _loop(False, make_step)
    traces[0] = 0
    got, fn = _loop(True, make_step)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # (eager's own calls)
    stats = fulmen.compile_stats(fn)
    assert stats.calls == 10 and stats.eager_calls + stats.cache_hits == 10
    assert traces[0] <= 3
