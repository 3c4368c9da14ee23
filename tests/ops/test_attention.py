"""attention.py: F.scaled_dot_product_attention decomposed, against eager's fused kernel."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.transforms import decompose_to_prims

MASK = torch.rand(3, 5) > 0.4
MASK[1] = False  # a fully masked query row: zeros, as eager

CASES = [dict(), dict(is_causal=True), dict(attn_mask=MASK), dict(attn_mask=torch.randn(2, 1, 3, 5)),
         dict(scale=0.3, attn_mask=MASK)]


@pytest.mark.parametrize("mode", [[], [decompose_to_prims]])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_sdpa(index, mode):
    kwargs = CASES[index]
    q = torch.randn(2, 2, 3, 4, requires_grad=True)
    k = torch.randn(2, 2, 5, 4, requires_grad=True)
    v = torch.randn(2, 2, 5, 6, requires_grad=True)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
    jfn = fulmen.jit(fn, transforms=mode)
    expected, actual = fn(q, k, v), jfn(q, k, v)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    for a, e in zip(torch.autograd.grad(actual, (q, k, v), cotangent),
                    torch.autograd.grad(expected, (q, k, v), cotangent)):
        torch.testing.assert_close(a, e)
    assert "opaque" not in str(fulmen.last_traces(jfn)[0])


def test_sdpa_with_dropout_runs_whole():
    q = torch.randn(1, 2, 4)
    fn = lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)  # noqa: E731
    jfn = fulmen.jit(fn)
    torch.manual_seed(0)
    expected = fn(q)
    torch.manual_seed(0)
    torch.testing.assert_close(jfn(q), expected)
