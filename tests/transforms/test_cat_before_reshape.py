"""The backward's join of head-split gradients as one cat before one reshape
(`transforms/cat_before_reshape.py`): gradients and their strides are eager's."""

import torch

import fulmen


def _split_heads(qkv, heads):
    """litgpt's attention: split the projection, each part into heads, heads first."""
    b, t, c3 = qkv.shape
    q, k, v = qkv.split(c3 // 3, dim=-1)
    return [p.reshape(b, t, heads, -1).transpose(1, 2) for p in (q, k, v)]


def _heads_fn(qkv):
    q, k, v = _split_heads(qkv, 4)
    return (torch.sin(q) * k + v * v).sum()


def _grads(fn, x):
    x = x.detach().requires_grad_()
    fn(x).backward()
    return x.grad


def _backward_text(jfn) -> str:
    return str(fulmen.last_backward_traces(jfn)[-1])


def test_the_heads_gradients_join_in_one_cat_with_eagers_values_and_strides():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3 * 16)
    jfn = fulmen.jit(_heads_fn)
    got, expected = _grads(jfn, x), _grads(_heads_fn, x)
    torch.testing.assert_close(got, expected)
    assert got.stride() == expected.stride()
    text = _backward_text(jfn)
    assert 'f32[2, 8, 12, 4]' in text  # the permuted gradients joined along the heads
    assert "before reshape" in " ".join(t.provenance for t in fulmen.last_backward_traces(jfn))


def test_a_join_along_another_dimension_is_left_as_is():
    torch.manual_seed(0)

    def fn(x):  # the parts are joined along the sequence: no merged dims there
        q, k, v = x.split(4, dim=1)
        parts = [p.reshape(2, 4, 4, 4).transpose(2, 3).reshape(2, 4, 16) for p in (q, k, v)]
        return (torch.cat(parts, 1) * torch.arange(12.0)[:, None]).sum()

    x = torch.randn(2, 12, 16)
    jfn = fulmen.jit(fn)
    torch.testing.assert_close(_grads(jfn, x), _grads(fn, x))
    torch.testing.assert_close(_grads(jfn, x), _grads(fn, x))


def test_a_reshaped_gradient_read_elsewhere_keeps_its_reshape():
    torch.manual_seed(0)

    def fn(x):
        q, k, v = _split_heads(x, 2)
        flat = [p.transpose(1, 2).reshape(2, 8, 8) for p in (q, k, v)]
        return (torch.cat(flat, 2) * 2).sum() + (flat[0] ** 2).sum()

    x = torch.randn(2, 8, 24)
    jfn = fulmen.jit(fn)
    torch.testing.assert_close(_grads(jfn, x), _grads(fn, x))
