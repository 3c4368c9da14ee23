"""rules_attention.py: the backward of F.scaled_dot_product_attention is eager's own, as one
statement, with eager's gradients (masks, causal, fully masked rows, a mask requiring grad)."""

import pytest
import torch
import torch.nn.functional as F

import fulmen

MASK = torch.rand(5, 7) > 0.4
MASK[1] = False  # a fully masked query row

CASES = [dict(), dict(is_causal=True), dict(attn_mask=MASK), dict(scale=0.3, attn_mask=MASK),
         dict(attn_mask=torch.randn(2, 1, 5, 7))]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_sdpa_backward_is_one_statement_with_eager_grads(index):
    kwargs = CASES[index]
    q = torch.randn(2, 3, 5, 8, requires_grad=True)
    k = torch.randn(2, 3, 7, 8, requires_grad=True)
    v = torch.randn(2, 3, 7, 8, requires_grad=True)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(torch.tanh(q), k * 2, v, **kwargs).sin()

    jfn = fulmen.jit(fn)
    expected, actual = fn(q, k, v), jfn(q, k, v)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    for a, e in zip(torch.autograd.grad(actual, (q, k, v), cotangent),
                    torch.autograd.grad(expected, (q, k, v), cotangent)):
        torch.testing.assert_close(a, e)
    backward = str(fulmen.last_backward_traces(jfn)[-1])
    # eager's flash backward from the kept log-sum-exp (or eager's op under torch.autograd)
    assert (backward.count("flash_attention_for_cpu_backward_default(")
            + backward.count("autograd_vjp(ltorch.scaled_dot_product_attention")) == 1
    assert "[2, 3, 5, 7]" not in backward  # no (L, S) scores or weights in the backward


def test_sdpa_mask_requiring_grad_gets_eager_grad():
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 2, 4, 4, requires_grad=True)

    def fn(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias * 1.5)

    jfn = fulmen.jit(fn)
    expected, actual = fn(q, k, v, bias), jfn(q, k, v, bias)
    torch.testing.assert_close(actual, expected)
    cotangent = torch.randn_like(expected)
    for a, e in zip(torch.autograd.grad(actual, (q, k, v, bias), cotangent),
                    torch.autograd.grad(expected, (q, k, v, bias), cotangent)):
        torch.testing.assert_close(a, e)


def test_sdpa_only_some_inputs_require_grad():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    fn = lambda q: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    jfn = fulmen.jit(fn)
    cotangent = torch.randn(1, 2, 4, 8)
    (actual,) = torch.autograd.grad(jfn(q), q, cotangent)
    (expected,) = torch.autograd.grad(fn(q), q, cotangent)
    torch.testing.assert_close(actual, expected)


def test_sdpa_forward_runs_whole_next_to_fused_ops():
    """The fusion partition does not split attention around its softmax (eager's fused kernel
    runs; no (L, S) -inf fill or scores in the forward), with or without grad."""
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q.sin(), k, v, attn_mask=MASK[:, :5]).cos()

    for requires_grad in (False, True):
        q.requires_grad_(requires_grad)
        jfn = fulmen.jit(fn)
        torch.testing.assert_close(jfn(q, k, v), fn(q, k, v))
        forward = str(fulmen.last_traces(jfn)[-1])
        # eager's op, or with grad the flash op eager's op runs (which keeps its log-sum-exp)
        assert ("torch.nn.functional.scaled_dot_product_attention(" in forward
                or "flash_attention_for_cpu_default(" in forward)
        assert "[2, 3, 5, 5]" not in forward


def test_two_layers_sharing_a_bool_mask_convert_it_once():
    """Each attention call of the split forward converts its bool mask to eager's float mask;
    two layers with one mask share that conversion (the forward's common subexpressions)."""
    q = torch.randn(2, 3, 5, 8, requires_grad=True)
    k, v = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)

    def fn(q):
        first = F.scaled_dot_product_attention(q, k, v, attn_mask=MASK)
        return F.scaled_dot_product_attention(first, k, v, attn_mask=MASK)

    jfn = fulmen.jit(fn, executors=["torch"])
    expected, actual = fn(q), jfn(q)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(torch.autograd.grad(actual.sum(), q)[0],
                               torch.autograd.grad(expected.sum(), q)[0])
    names = [b.sym.name for b in fulmen.last_traces(jfn)[-1].bsyms]
    assert names.count("scaled_dot_product_flash_attention_for_cpu_default") == 2
    assert names.count("where") == 1
