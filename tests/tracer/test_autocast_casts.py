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


def test_attention_with_dropout_of_mixed_dtypes_under_autocast_is_eagers():
    # HF Llama training under CPU autocast with attention dropout: the rotary embedding leaves
    # query and key in float32, the value is bfloat16 from its linear. The CPU math backend
    # that runs dropout upcasts a bfloat16 value internally; that cast was taken for
    # autocast's, the value went back to float32 and the call failed to trace.
    def attend(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.scaled_dot_product_attention(q, k, F.linear(v, w), dropout_p=0.25)

    w = torch.randn(8, 8)
    q, k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(3))
    torch.manual_seed(0)
    expected = attend(q, k, v)
    expected.float().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(0)
    out = fulmen.jit(attend)(q, k, v)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected)
    out.float().sum().backward()
    for t, grad in zip((q, k, v), grads):
        torch.testing.assert_close(t.grad, grad)


def test_grouped_mm_under_autocast_is_eagers():
    # HF's MoE layers (Mixtral, Qwen3-MoE) call `F.grouped_mm` on float32 CPU tensors; autocast
    # leaves it alone, but its meta kernel refuses float32, so the autocast probe on fake
    # tensors failed and MoE training under CPU autocast could not trace.
    def experts(x, w, offs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = F.linear(x, torch.eye(8))  # bfloat16
            return F.grouped_mm(x, w, offs=offs), torch._grouped_mm(hidden.to(w.dtype), w, offs=offs)

    x = torch.randn(6, 8)
    w = torch.randn(2, 8, 4, requires_grad=True)
    offs = torch.tensor([3, 6], dtype=torch.int32)
    expected = experts(x, w, offs)
    (grad,) = torch.autograd.grad(sum((t * t).sum() for t in expected), w)
    out = fulmen.jit(experts)(x, w, offs)
    for got, want in zip(out, expected):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(sum((t * t).sum() for t in out), w)[0], grad)
