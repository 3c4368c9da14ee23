"""A call refused before tracing (a module with backward hooks, a DDP the function calls) after
the function's objects were found: the eager run that follows must see the objects as they
were (session 52, lead: the optimizer's state and gradients were left with traced stand-ins, so
momentum was lost and `zero_grad()` did not clear; `jit` of a whole DDP training step differed
from eager by 0.12 after four steps)."""

import copy
import warnings

import torch

import fulmen


def _step_closing_over(model, opt):
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def test_a_step_refused_for_a_backward_hook_runs_eagerly_on_the_real_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    seen = []
    model.register_full_backward_hook(lambda module, gin, gout: seen.append(gout[0].shape))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    jstep = fulmen.jit(_step_closing_over(model, opt))
    eager_step = _step_closing_over(ref, ref_opt)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the eager fallback's warning
            got = jstep(x, y)
        torch.testing.assert_close(got, eager_step(x, y))
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
            assert p.grad is None and q.grad is None
    assert len(seen) == 3
    assert len(opt.state) == len(ref_opt.state) == 4
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   ref_opt.state[q]["momentum_buffer"])
    assert fulmen.compile_stats(jstep).eager_calls == 3
