"""Calls users make around a training loop, compared with eager: functions of their own that
hold an optimizer, model state changed between calls."""

import torch
import torch.nn as nn

import fulmen


def _loop(jit: bool):
    """Three steps of a loop whose loss function is named `step` and closes over the
    optimizer (it zeroes the gradients itself); the losses, their `requires_grad` and the
    parameters after each step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x):  # the user's training step, named like the optimizer's
        opt.zero_grad()
        return model(x).square().mean()

    fn = fulmen.jit(step) if jit else step
    records = []
    for _ in range(3):
        loss = fn(torch.randn(5, 4))
        records.append((loss.detach(), loss.requires_grad))
        loss.backward()
        opt.step()
        records += [(p.detach().clone(), p.requires_grad) for p in model.parameters()]
    return records


def test_a_users_function_named_step_holding_an_optimizer_keeps_the_grad_mode():
    # Only `optimizer.step` itself (or an LR scheduler's wrapper of it) runs without grad;
    # a function of the user's named `step` that closes over the optimizer was traced under
    # no_grad, so its loss did not require grad and `loss.backward()` raised
    expected, actual = _loop(False), _loop(True)
    assert [flag for _, flag in actual] == [flag for _, flag in expected]
    for (e, _), (a, _) in zip(expected, actual):
        torch.testing.assert_close(a, e)
