"""activations.py against eager: values whole and decomposed, gradients, and the ops being
recorded as decompositions (not opaque fallbacks)."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.transforms import decompose_to_prims

CASES = [
    lambda x: F.mish(x),
    lambda x: F.softplus(x, beta=2.0, threshold=3.0),
    lambda x: F.hardtanh(x, -0.5, 0.7),
    lambda x: F.leaky_relu(x, 0.2),
    lambda x: F.elu(x, alpha=1.5),
    lambda x: F.glu(x, dim=0),
]


@pytest.mark.parametrize("mode", [[], [decompose_to_prims]])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_activation(index, mode):
    fn = CASES[index]
    x = (torch.randn(4, 6) * 5).requires_grad_()
    jfn = fulmen.jit(fn, transforms=mode)
    expected, actual = fn(x), jfn(x)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    torch.testing.assert_close(torch.autograd.grad(actual, x, cotangent)[0],
                               torch.autograd.grad(expected, x, cotangent)[0])
    assert "opaque" not in str(fulmen.last_traces(jfn)[0])

