"""Gradients through dtype casts inside a program: each cotangent has its value's dtype, as in
eager, so the backward of a half-precision op that feeds a float32 region computes in half
precision. (`test_autodiff.py` checks a cast of an input alone: there autograd casts the
returned gradient itself, so a cast rule that forgets the dtype passes.)
"""

import pytest
import torch

import fulmen
from fulmen.tools.accuracy import assert_accurate, to_float64


def _half_float_half(x, w):
    h = x * w  # half precision
    y = torch.tanh(h.float()) * 3  # float32 region
    return (y.to(x.dtype) * h).sum(-1)  # back to half, meeting h again


def _float_half_float(x, w):
    h = (x * w).to(torch.bfloat16)
    return (torch.sigmoid(h) * h).float().sum(-1) + (x * w).sum(-1)


CASES = {
    "bf16-f32-bf16": (_half_float_half, torch.bfloat16),
    "f16-f32-f16": (_half_float_half, torch.float16),
    "f32-bf16-f32": (_float_half_float, torch.float32),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_through_casts_match_eager(case):
    fn, dtype = CASES[case]
    x = torch.randn(4, 64, dtype=dtype, requires_grad=True)
    w = torch.randn(64, dtype=dtype, requires_grad=True)
    expected = fn(x, w)
    grads = torch.autograd.grad(expected.sum(), (x, w))
    actual = fulmen.jit(fn)(x, w)
    jgrads = torch.autograd.grad(actual.sum(), (x, w))
    assert [g.dtype for g in jgrads] == [g.dtype for g in grads]

    def reference():
        wide = to_float64((x, w))
        return (fn(*wide), torch.autograd.grad(fn(*wide).sum(), wide))

    assert_accurate((actual, jgrads), (expected, grads), reference, low_precision=True)
