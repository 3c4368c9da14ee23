"""Session 52's features meeting each other in training steps: `loss.backward()` inside the
jitted step (`fulmen.tracer.backward_in_trace`) with several micro-batches, compared with eager
over calls with changing batch sizes."""

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
