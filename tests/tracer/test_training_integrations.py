"""Calls users make in training loops, compared with eager over several steps: module
methods that touch gradients inside a jitted function, and module state changed between
calls."""

import pytest
import torch

import fulmen


@pytest.mark.parametrize("dynamic", [None, True])
def test_module_zero_grad_keeping_the_tensors_zeroes_each_calls_gradients(dynamic):
    """`fulmen.jit(lambda: model.zero_grad(set_to_none=False))`: `Module.zero_grad` reads each
    parameter's `.grad`, which no trace takes as an input (each backward makes a new one); its
    reads were let through as those of `Module._apply` (the same file), so the trace zeroed
    the gradients of the first call only (and not even those: a grad only its parameter
    holds looks like a tensor the call made, so the trace zeroed a copy of it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    zero = fulmen.jit(lambda: model.zero_grad(set_to_none=False), dynamic=dynamic)
    for _ in range(3):
        model(torch.randn(3, 4)).square().sum().backward()
        # (no reference to the grads kept here: that changes what the tracer sees)
        assert all(p.grad.abs().sum() > 0 for p in model.parameters())
        addresses = [p.grad.data_ptr() for p in model.parameters()]
        zero()
        assert [p.grad.data_ptr() for p in model.parameters()] == addresses
        for p in model.parameters():
            torch.testing.assert_close(p.grad, torch.zeros_like(p))
