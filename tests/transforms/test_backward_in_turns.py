"""Outputs of one compiled call backpropagated in turns without `retain_graph` (NOTE [outputs
backpropagated in turns] in `fulmen/autograd_bridge.py`): eager gives each output its own
graph, so `d_loss.backward()` then `g_loss.backward()` works; the one node of a compiled call
freed every output's residuals at the first backward, and the second raised "Trying to
backward through the graph a second time"."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fulmen


def _two_sums(a, b):
    return (a * 2).sum(), b.sin().sum()


def test_independent_outputs_backpropagated_in_turns_give_eagers_gradients():
    jfn = fulmen.jit(_two_sums)
    grads = []
    for fn in (_two_sums, jfn):
        a, b = (torch.linspace(-1, 1, 3, requires_grad=True) for _ in range(2))
        r, s = fn(a, b)
        (ga,) = torch.autograd.grad(r, a)
        s.backward()
        grads.append((ga, b.grad))
    torch.testing.assert_close(grads[1], grads[0])


def _gan(make):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3))
    disc = nn.Sequential(nn.Linear(3, 4), nn.LeakyReLU(0.2), nn.Linear(4, 1))

    def losses(z, real):
        fake = gen(z)
        d_loss = F.softplus(disc(fake.detach())).mean() + F.softplus(-disc(real)).mean()
        g_loss = F.softplus(-disc(fake)).mean()
        return d_loss, g_loss

    return gen, disc, make(losses)


def test_a_gans_two_losses_backpropagated_in_turns_train_as_eager():
    """Both losses read the discriminator's weights (kept), and each backward reads the other
    loss's activations where its unused cotangent does not fold away (the second recomputes
    the forward)."""
    runs = []
    for make in (lambda f: f, fulmen.jit):
        gen, disc, losses = _gan(make)
        opt_g = torch.optim.SGD(gen.parameters(), lr=0.1)
        opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
        seen = []
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            d_loss, g_loss = losses(torch.randn(5, 2, generator=g), torch.randn(5, 3, generator=g))
            opt_d.zero_grad()
            d_loss.backward()
            seen.append([p.grad.clone() for p in disc.parameters()])
            opt_g.zero_grad()
            g_loss.backward()  # (the discriminator's grads accumulate, as in eager)
            seen.append([p.grad.clone() for p in (*gen.parameters(), *disc.parameters())])
            opt_g.step()
            opt_d.step()
        runs.append(seen)
    torch.testing.assert_close(runs[1], runs[0])


def _one_output_twice(fn):
    a, b = (torch.linspace(-1, 1, 3, requires_grad=True) for _ in range(2))
    r, s = fn(a, b)
    r.backward()
    s.backward()
    s.backward()


def _updated_between_turns(fn):
    a, b = (torch.linspace(-1, 1, 3, requires_grad=True) for _ in range(2))
    b2 = b * 1
    r, s = fn(a, b2)
    r.backward()
    with torch.no_grad():
        b2.add_(1)
    s.backward()


@pytest.mark.parametrize("case, match", [(_one_output_twice, "a second time"),
                                         (_updated_between_turns, "inplace operation")])
def test_what_eager_refuses_between_turns_raises(case, match):
    with pytest.raises(RuntimeError, match=match):
        case(_two_sums)
    with pytest.raises(RuntimeError, match=match):
        case(fulmen.jit(_two_sums))
