"""executors/torch/onednn_linear.py: large float32 CPU linears run on oneDNN, with eager's
values, gradients and fallbacks."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.executors.torch.onednn_linear import MIN_MULTIPLY_ADDS, ONEDNN_LINEAR

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch build has no oneDNN")

# 2 x 64 rows, K = 128, N = 1024: 2^24 multiply-adds, the threshold
LARGE = ((2, 64, 128), (1024, 128))


def _last_trace(jfn) -> str:
    return str(fulmen.last_traces(jfn)[-1])


def _large(requires_grad=False):
    torch.manual_seed(0)
    x = torch.randn(*LARGE[0])
    w = torch.randn(*LARGE[1], requires_grad=requires_grad)
    b = torch.randn(LARGE[1][0], requires_grad=requires_grad)
    return x, w, b


def test_a_large_float32_linear_runs_on_onednn_with_eagers_values():
    assert 2 * 64 * 128 * 1024 == MIN_MULTIPLY_ADDS
    x, w, b = _large()
    jfn = fulmen.jit(lambda x, w, b: F.linear(x, w, b).relu())
    out = jfn(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b).relu())
    assert out.shape == (2, 64, 1024) and out.is_contiguous()
    assert "torchex.onednn_linear(" in _last_trace(jfn)


def test_small_and_non_float32_linears_keep_eagers_call():
    """Below the threshold, and in bfloat16 (which eager already runs on oneDNN), the
    statement stays `F.linear`."""
    x, w, b = _large()
    jfn = fulmen.jit(lambda x, w: F.linear(x, w))
    jfn(x[:, :32], w)  # half the threshold
    assert "torchex.onednn_linear(" not in _last_trace(jfn)
    jfn(x.bfloat16(), w.bfloat16())
    assert "torchex.onednn_linear(" not in _last_trace(jfn)


def test_training_forward_takes_onednn_and_gradients_are_eagers():
    """The forward runs outside autograd (the bridge computes the backward), so it takes the
    oneDNN call; the gradients come from fulmen's backward, as eager's."""
    x, w, b = _large(requires_grad=True)
    jfn = fulmen.jit(lambda x, w, b: F.linear(x, w, b).tanh().sum())
    expected = torch.autograd.grad(F.linear(x, w, b).tanh().sum(), (w, b))
    actual = torch.autograd.grad(jfn(x, w, b), (w, b))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    assert "torchex.onednn_linear(" in _last_trace(jfn)


def test_under_recorded_grad_the_operator_is_eagers_linear():
    """oneDNN's linear has no autograd formula: where grad is recorded (a graph-break segment
    in the caller's grad mode) the operator must run `F.linear`, or `w.grad` would silently
    stay None."""
    x, w, b = _large(requires_grad=True)
    out = ONEDNN_LINEAR.impl(x, w, b)
    assert out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(w.grad, x.reshape(-1, 128).sum(0).expand(1024, 128))
    torch.testing.assert_close(b.grad, torch.full((1024,), 128.0))


def test_non_contiguous_operands_and_disabled_onednn_give_eagers_values():
    x, w, b = _large()
    weight_t = torch.randn(128, 1024)  # the weight is its transpose: not contiguous
    wide = torch.randn(2, 64, 256)[..., :128]  # an input that is not contiguous
    jfn = fulmen.jit(lambda x, w, b: F.linear(x, w, b))
    for args in ((x, weight_t.t(), b), (wide, w, b), (x, w, torch.randn(2048)[::2])):
        torch.testing.assert_close(jfn(*args), F.linear(*args))
        assert "torchex.onednn_linear(" in _last_trace(jfn)
    # the context manager: torch.testing's common_utils (imported by the OpInfo tests)
    # forbids setting torch.backends flags directly
    with torch.backends.mkldnn.flags(enabled=False):
        torch.testing.assert_close(jfn(x, w, b), F.linear(x, w, b))
