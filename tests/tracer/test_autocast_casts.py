"""Inside `torch.autocast`, ops autocast runs in float32 (losses, `prod`) get their inputs cast
up from the half-precision matmul results, as in eager: same dtypes and values. A trace that
kept only autocast's casts down to half precision would return bfloat16 from `prod` and compute
the losses in bfloat16 (off by ~1e-3).
"""

import pytest
import torch
import torch.nn.functional as F

import fulmen

CASES = {
    "cross_entropy": lambda x, w, t: F.cross_entropy(x @ w, t.softmax(-1)),
    "bce_with_logits": lambda x, w, t: F.binary_cross_entropy_with_logits(x @ w, t.sigmoid()),
    "prod": lambda x, w, t: (x @ w).prod(-1),
    "mse_and_matmul": lambda x, w, t: (F.mse_loss(x @ w, t), x @ w),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_ops_under_autocast_match_eager(name, dtype):
    fn = CASES[name]
    x, w, t = torch.randn(4, 8), torch.randn(8, 8), torch.randn(4, 8)
    jfn = fulmen.jit(fn)
    with torch.autocast("cpu", dtype=dtype):
        expected = fn(x, w, t)
        actual = jfn(x, w, t)
    leaves = torch.utils._pytree.tree_leaves
    for e, a in zip(leaves(expected), leaves(actual), strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
