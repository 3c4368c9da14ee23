"""Writes through a tensor that may or may not alias another one (NOTE [writes through a tensor
that may alias] in `fulmen.tracer.mutation`): compiled when nothing reads the possible base
afterwards (Longformer's `attn.transpose(0, 1).reshape(...).contiguous()` written in place),
a clear error when something does."""

import pytest
import torch

import fulmen
from fulmen import NotYetSupportedError

torch._dynamo  # noqa: B018  (imported: PyTorch's meta kernels then describe more ops)


class _Product(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad * b, grad * a


def _scores(a, b):
    # a custom Function's output strides are not known to be eager's: whether the reshape
    # below views is decided at run time
    return _Product.apply(a, b).transpose(1, 2)


def _write_the_copy(a, b):
    attn = _scores(a, b)
    out = attn.transpose(0, 1).reshape(3, 2, 8).contiguous()
    out[0] = 0.0
    out.add_(1)
    return out.transpose(0, 1) * 2


def _read_the_base(a, b):
    attn = _scores(a, b)
    out = attn.transpose(0, 1).reshape(3, 2, 8).contiguous()
    out[0] = 0.0
    return out, attn


def _write_the_base(a, b):
    attn = _scores(a, b)
    out = attn.transpose(0, 1).reshape(3, 2, 8).contiguous()
    out[0] = 0.0
    attn.zero_()
    return out


def _write_another_view(a, b):
    attn = _scores(a, b)
    first = attn[0]
    out = attn.transpose(0, 1).reshape(3, 2, 8).contiguous()
    out[0] = 0.0
    first.zero_()
    return out


def _inputs():
    torch.manual_seed(0)
    return torch.randn(2, 4, 3, 2, requires_grad=True), torch.randn(2, 4, 3, 2)


def test_write_through_a_maybe_alias_nobody_reads_compiles():
    jitted = fulmen.jit(_write_the_copy, fullgraph=True)
    for _ in range(2):
        (a, b), (c, d) = _inputs(), _inputs()
        expected, actual = _write_the_copy(a, b), jitted(c, d)
        torch.testing.assert_close(actual, expected)
        expected.sum().backward()
        actual.sum().backward()
        torch.testing.assert_close(c.grad, a.grad)


@pytest.mark.parametrize("fn", [_read_the_base, _write_the_base, _write_another_view])
def test_possible_base_used_after_the_write_raises(fn):
    with pytest.raises(NotYetSupportedError, match="may or may not alias"):
        fulmen.jit(fn)(*_inputs())
