"""`Tensor.contiguous` (recorded opaquely when it copies) has a VJP rule: it passes its cotangent
on, so the forward runs the copy itself instead of under torch.autograd with a kept graph."""

import torch

import fulmen


def test_contiguous_passes_its_cotangent_on():
    x = torch.randn(4, 3, requires_grad=True)

    def fn(x):
        return (x.exp().t().contiguous() * torch.arange(4.0)).sum()

    jfn = fulmen.jit(fn)
    (expected,) = torch.autograd.grad(fn(x), x)
    (actual,) = torch.autograd.grad(jfn(x), x)
    torch.testing.assert_close(actual, expected)
    forward = str(fulmen.last_traces(jfn)[-1])
    assert "torch.Tensor.contiguous(" in forward and "autograd_forward" not in forward
    assert "autograd" not in str(fulmen.last_backward_traces(jfn)[-1])
