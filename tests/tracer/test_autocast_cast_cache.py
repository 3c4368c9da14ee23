"""Autocast's cast cache (NOTE [autocast's cast cache]): eager casts a float32 leaf weight that
requires grad once per autocast region, so its uses' low-precision gradients are added before
the cast's backward widens them. The compiled gradients are compared bit for bit."""

import torch

import fulmen


def _grads(fn, x, w):
    out = fn(x)
    return torch.autograd.grad(out.float().sum(), [x, w])


def _assert_bits_equal(fn, w):
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    jitted = fulmen.jit(fn)
    for _ in range(2):
        for got, want in zip(_grads(jitted, x, w), _grads(fn, x, w)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_a_closed_over_weight_read_twice_in_one_region():
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(8, 8))

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x @ w).relu() @ w

    _assert_bits_equal(f, w)


def test_two_regions_cast_the_weight_once_each():
    """An op outside autocast between the regions: the second region casts anew, as eager's
    (its cache is cleared when the first region ends)."""
    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.randn(8, 8))

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = (x @ w).relu() @ w
        h = h.float() * 0.5  # (exact)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (h @ w).relu() @ w

    _assert_bits_equal(f, w)


def test_a_cast_under_no_grad_is_not_reused_with_grad():
    torch.manual_seed(3)
    w = torch.nn.Parameter(torch.randn(8, 8))

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                scale = (x @ w).abs().mean()
            return ((x @ w) @ w) * scale

    _assert_bits_equal(f, w)
