"""Session 52's features meeting each other in training steps: `loss.backward()` inside the
jitted step (`fulmen.tracer.backward_in_trace`) with several micro-batches, compared with eager
over calls with changing batch sizes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen


def _three_micro_batch_loop(jit: bool):
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        losses = []
        for xs, ys in zip(x.chunk(3), y.chunk(3)):
            loss = F.mse_loss(model(xs), ys) / 3
            loss.backward()
            losses.append(loss.detach())  # an opaque op on a value requiring grad
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).sum()

    fn = fulmen.jit(step) if jit else step
    generator = torch.Generator().manual_seed(1)
    out = []
    for rows in (6, 9, 6, 12):
        out.append(fn(torch.randn(rows, 6, generator=generator),
                      torch.randn(rows, 3, generator=generator)))
    out += [p.detach().clone() for p in model.parameters()]
    out += [s["momentum_buffer"] for s in opt.state.values()]
    return out, fn


def test_three_backwards_with_a_detached_loss_between_them():
    """Gradient accumulation over three micro-batches, each loss detached after its backward:
    the third backward's autodiff wrapped the second's `autograd_forward` of the detach again
    (a statement no executor runs: AttributeError on the first call)."""
    got, fn = _three_micro_batch_loop(True)
    want, _ = _three_micro_batch_loop(False)
    assert len(got) == len(want) == 8
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    stats = fulmen.compile_stats(fn)
    assert stats.eager_calls == 0 and stats.calls == 4


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(6, 24)

    def forward(self, x):  # under autocast, attention runs as an opaque op
        q, k, v = self.qkv(x).view(x.shape[0], 3, 2, 4).unbind(1)
        return F.scaled_dot_product_attention(q, k, v).flatten(1)


def _two_backward_loop(jit: bool, variant: str):
    torch.manual_seed(0)
    middle = _Attention() if variant == "autocast" else nn.Linear(6, 8)
    model = nn.Sequential(nn.Linear(6, 6), middle, nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model[0].weight

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "autocast"):
            first = F.mse_loss(model(x[:3]).float(), y[:3])
            first.backward()
            second = F.mse_loss(model(x[3:]).float(), y[3:])
        if variant == "grad_read":  # eager: `.grad` is a constant (no graph)
            second = second + (weight.grad * weight).sum()
        second.backward()
        opt.step()
        opt.zero_grad()
        return second.detach()

    fn = fulmen.jit(step) if jit else step
    generator = torch.Generator().manual_seed(1)
    out = []
    for rows in (6, 8, 6, 10):
        out.append(fn(torch.randn(rows, 6, generator=generator),
                      torch.randn(rows, 3, generator=generator)))
    return out + [p.detach().clone() for p in model.parameters()], fn


@pytest.mark.parametrize("variant", ["grad_read", "autocast"])
def test_a_second_backward_does_not_differentiate_the_first(variant):
    """A second `loss.backward()` in the step differentiated the first backward's statements:
    a loss reading `p.grad` got gradients through it (eager's `.grad` has no graph: wrong
    parameters), and under autocast the first backward's `autograd_backward` was wrapped in an
    `autograd_forward` no executor runs (AttributeError)."""
    got, fn = _two_backward_loop(True, variant)
    want, _ = _two_backward_loop(False, variant)
    assert len(got) == len(want) == 10
    tol = 1e-2 if variant == "autocast" else 1e-5
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert fulmen.compile_stats(fn).eager_calls == 0
