"""`fulmen.jit(Fn.apply)`: a custom autograd.Function's `apply` jitted directly.

`Fn.apply` bound before the trace replaced `Function.apply` ran the Function's forward under its
no_grad on proxies: the compiled output did not require grad, and a loss that also read the
input got only the other term's gradient (silently wrong).
"""

import torch

import fulmen


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * grad * x


def test_a_functions_apply_jitted_directly_keeps_its_gradient():
    x = torch.randn(5, requires_grad=True)
    jfn = fulmen.jit(_Square.apply)
    out = jfn(x)
    assert out.requires_grad
    torch.testing.assert_close(out, x * x)
    (grad,) = torch.autograd.grad(out.sum() + (x * 2).sum(), x)
    torch.testing.assert_close(grad, 2 * x.detach() + 2)
    assert fulmen.compile_stats(jfn).eager_calls == 0
