"""Attention on repeated key/value heads runs on the heads themselves (`grouped_attention`)."""

import pytest
import torch
import torch.nn.functional as F

import fulmen


def _hf_repeat(x, times):  # HF's repeat_kv
    b, g, s, d = x.shape
    return x[:, :, None, :, :].expand(b, g, times, s, d).reshape(b, g * times, s, d)


def _litgpt_repeat(x, times):
    return x.repeat_interleave(times, dim=1)


def _tiled(x, times):  # heads g0, g1, g0, g1: NOT grouped-query attention's order
    b, g, s, d = x.shape
    return x[:, None].expand(b, times, g, s, d).reshape(b, times * g, s, d)


def _attention(repeat, masked):
    def fn(q, k, v, mask):
        k, v = repeat(k * 1.5, 2), repeat(v + 0.5, 2)
        if masked:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3) * 2
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2
    return fn


def _inputs(requires_grad):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 6, 8, generator=g) for heads in (4, 2, 2))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, :, :, 4:] = False  # a padded row
    return [t.requires_grad_(requires_grad) for t in (q, k, v)] + [mask]


def _grouped_calls(jfn) -> list:
    """The attention statements of the stage the grouped-attention pass wrote (none when it
    left the trace)."""
    stages = [t for t in fulmen.last_traces(jfn) if t.provenance == "after grouped attention"]
    return [b for stage in stages for b in stage.bsyms
            if b.sym.name == "scaled_dot_product_attention"]


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("repeat", [_hf_repeat, _litgpt_repeat], ids=["hf", "litgpt"])
@pytest.mark.parametrize("grad", [True, False])
def test_repeated_heads_run_as_grouped_attention_with_eagers_values(repeat, masked, grad):
    """HF's `repeat_kv` and litgpt's `repeat_interleave` before attention become one call with
    `enable_gqa=True` on the un-repeated heads: the forward is eager's bit for bit, the
    gradients eager's up to the order the grouped heads' gradients are summed in."""
    fn = _attention(repeat, masked)
    jfn = fulmen.jit(fn)
    inputs, reference = _inputs(grad), _inputs(grad)
    with torch.set_grad_enabled(grad):
        out, expected = jfn(*inputs), fn(*reference)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (call,) = _grouped_calls(jfn)
    assert call.kwargs["enable_gqa"] is True
    assert [tuple(t.shape) for t in call.args[:3]] == [(2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8)]
    if grad:
        cotangent = torch.randn_like(expected)
        out.backward(cotangent)
        expected.backward(cotangent)
        for actual, wanted in zip(inputs[:3], reference[:3], strict=True):
            torch.testing.assert_close(actual.grad, wanted.grad)


@pytest.mark.parametrize("grad", [True, False])
def test_heads_repeated_in_another_order_are_not_grouped(grad):
    """A repeat giving heads g0, g1, g0, g1 (a tile, not grouped-query attention's g0, g0, g1,
    g1) is not the repeat `enable_gqa` stands for: the call keeps its repeated inputs and
    eager's values."""
    fn = _attention(_tiled, True)
    jfn = fulmen.jit(fn)
    inputs, reference = _inputs(grad), _inputs(grad)
    with torch.set_grad_enabled(grad):
        out, expected = jfn(*inputs), fn(*reference)
    torch.testing.assert_close(out, expected)
    assert not _grouped_calls(jfn)
    if grad:
        out.sum().backward()
        expected.sum().backward()
        for actual, wanted in zip(inputs[:3], reference[:3], strict=True):
            torch.testing.assert_close(actual.grad, wanted.grad)
