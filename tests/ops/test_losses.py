"""losses.py against eager (reductions, weights, ignore_index, label smoothing), with grads."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.transforms import decompose_to_prims

TARGET = torch.tensor([[0, 4, 2], [1, -100, 3], [-100, 2, 2], [4, 0, 1]])
WEIGHT = torch.rand(5) + 0.5

CASES = [
    dict(),
    dict(weight=WEIGHT, reduction="sum"),
    dict(reduction="none"),
    dict(label_smoothing=0.2),
    dict(weight=WEIGHT, label_smoothing=0.3),
    dict(weight=WEIGHT, label_smoothing=0.1, reduction="none"),
]


@pytest.mark.parametrize("mode", [[], [decompose_to_prims]])
@pytest.mark.parametrize("loss", ["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_class_losses(index, loss, mode):
    kwargs = CASES[index]
    if loss == "nll_loss" and "label_smoothing" in kwargs:
        pytest.skip("nll_loss has no label smoothing")
    fn = getattr(F, loss)
    x = torch.randn(4, 5, 3, requires_grad=True)
    jfn = fulmen.jit(lambda x: fn(x, TARGET, **kwargs), transforms=mode)
    expected, actual = fn(x, TARGET, **kwargs), jfn(x)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, x, cotangent)[0],
                               torch.autograd.grad(expected, x, cotangent)[0])
    assert "opaque" not in str(fulmen.last_traces(jfn)[0])


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_mse_loss(reduction):
    x, y = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    jfn = fulmen.jit(lambda x, y: F.mse_loss(x, y, reduction=reduction),
                     transforms=[decompose_to_prims])
    expected, actual = F.mse_loss(x, y, reduction=reduction), jfn(x, y)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(torch.autograd.grad(actual.sum(), x)[0],
                               torch.autograd.grad(expected.sum(), x)[0])
