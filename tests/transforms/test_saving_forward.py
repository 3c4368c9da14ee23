"""Saving forwards (NOTE [saving forwards] in autodiff/registry.py): attention keeps the flash
kernel's log-sum-exp for eager's fused backward instead of recomputing the forward, with eager's
values and gradients, and no more bytes saved than its inputs, the log-sum-exp and
the output's layout twin."""

import pytest
import torch
import torch.nn.functional as F

import fulmen

MASK = torch.rand(2, 1, 6, 6) > 0.3
MASK[0, 0, 2] = False  # a fully masked query row


def _grads(fn, inputs, cotangent=None):
    out = fn(*inputs)
    cotangent = torch.randn_like(out) if cotangent is None else cotangent
    return out, cotangent, torch.autograd.grad(out, [t for t in inputs if t.requires_grad],
                                               cotangent)


@pytest.mark.usefixtures("codegen_eager")  # fused kernels run from the first call
@pytest.mark.parametrize("mask", [None, "causal", MASK, MASK.float().log()],
                         ids=["none", "causal", "bool", "float"])
def test_attention_keeps_logsumexp_and_matches_eager_exactly(mask):
    kwargs = {"is_causal": True} if isinstance(mask, str) else {"attn_mask": mask}
    q, k, v = (torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        out = F.scaled_dot_product_attention(q, k * 1.5, v, scale=0.3, **kwargs)
        return out.transpose(1, 2).contiguous().reshape(2, 6, 32) * 2.0

    jfn = fulmen.jit(fn)
    expected, cotangent, expected_grads = _grads(fn, (q, k, v))
    actual, _, actual_grads = _grads(jfn, (q, k, v), cotangent)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)  # eager's kernel
    for a, e in zip(actual_grads, expected_grads):  # (the scaling is a fused kernel)
        torch.testing.assert_close(a, e)
    forward = str(fulmen.last_traces(jfn)[-1])
    backward = str(fulmen.last_backward_traces(jfn)[-1])
    assert forward.count("scaled_dot_product_flash_attention_for_cpu_default(") == 1
    assert backward.count("scaled_dot_product_flash_attention_for_cpu_backward_default(") == 1
    assert "autograd" not in backward  # no recomputed forward, no kept graph


def test_attention_output_is_read_back_from_its_contiguous_copy():
    """NOTE [values kept under another layout]: the backward reads attention's output through
    views of the transposed copy the forward made, so the output itself is not saved."""
    q, k, v = (torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3))
    w = torch.randn(32, 32, requires_grad=True)

    def fn(q, k, v, w):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).contiguous().reshape(2, 6, 32) @ w

    jfn = fulmen.jit(fn)
    expected, cotangent, expected_grads = _grads(fn, (q, k, v, w))
    actual, _, actual_grads = _grads(jfn, (q, k, v, w), cotangent)
    for a, e in zip(actual_grads, expected_grads):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    residuals = fulmen.last_traces(jfn)[-1].output[1]
    shapes = [tuple(r.shape) for r in residuals]
    assert shapes.count((2, 4, 6, 8)) == 3  # q, k, v only; the output comes back from the copy
    assert (2, 4, 6) in shapes  # the log-sum-exp


@pytest.mark.parametrize("rearrange", [
    lambda o: o.permute(2, 0, 3, 1).contiguous().reshape(6, -1),  # a 3-cycle: not self-inverse
    lambda o: o.permute(0, 2, 3, 1).reshape(2, 6, 32),
], ids=["permute-cycle", "permute-reshape"])
def test_attention_output_read_back_through_a_permutation(rearrange):
    """NOTE [values kept under another layout] with a permutation that is not its own inverse:
    undoing it must apply the inverse permutation, else the backward reads another tensor's
    values as attention's output."""
    q, k, v = (torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3))
    w = torch.randn(64, 5, requires_grad=True)

    def fn(q, k, v, w):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return rearrange(out) @ w[: rearrange(out).shape[-1]]

    jfn = fulmen.jit(fn)
    expected, cotangent, expected_grads = _grads(fn, (q, k, v, w))
    actual, _, actual_grads = _grads(jfn, (q, k, v, w), cotangent)
    torch.testing.assert_close(actual, expected)
    for a, e in zip(actual_grads, expected_grads):
        torch.testing.assert_close(a, e)


def test_attention_output_viewed_as_another_dtype_is_no_layout_twin():
    """A `view(torch.int32)` of attention's output has its element count but not its values:
    the backward must not read the output back from it."""
    q, k, v = (torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v)
        return out * 2.0, out.view(torch.int32)

    jfn = fulmen.jit(fn)
    (expected, expected_bits), (actual, actual_bits) = fn(q, k, v), jfn(q, k, v)
    assert torch.equal(actual_bits, expected_bits)
    cotangent = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), cotangent)
    for a, e in zip(torch.autograd.grad(actual, (q, k, v), cotangent), expected_grads):
        torch.testing.assert_close(a, e)


def test_mask_requiring_grad_declines_and_matches_eager():
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 2, 4, 4, requires_grad=True)

    def fn(q, k, v, bias):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias * 1.5)

    jfn = fulmen.jit(fn)
    expected, cotangent, expected_grads = _grads(fn, (q, k, v, bias))
    actual, _, actual_grads = _grads(jfn, (q, k, v, bias), cotangent)
    for a, e in zip(actual_grads, expected_grads):
        torch.testing.assert_close(a, e)
    assert "flash_attention_for_cpu" not in str(fulmen.last_traces(jfn)[-1])

