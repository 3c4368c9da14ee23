"""A tensor passed at several argument positions (NOTE [repeated tensor arguments]): traced as
one input, so `a is b` answers as eager's, and keyed apart from calls passing two tensors."""

import torch

import fulmen


def _same_or_sum(a, b):
    if a is b:
        return a * 2
    return a + b + 1


def test_a_tensor_passed_twice_is_the_same_tensor_inside_and_keyed_apart():
    jitted = fulmen.jit(_same_or_sum)
    x, y = torch.randn(3), torch.randn(3)
    for a, b in [(x, x), (x, y), (y, y), (y, x)]:
        torch.testing.assert_close(jitted(a, b), _same_or_sum(a, b), rtol=0, atol=0)
        torch.testing.assert_close(jitted(a, b=b), _same_or_sum(a, b), rtol=0, atol=0)
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0 and stats.cache_misses == 4  # per pattern and spelling


def test_an_in_place_update_through_one_of_two_positions_is_seen_through_the_other():
    def scaled(a, b):
        b.mul_(2)
        return a + 1

    jitted = fulmen.jit(scaled, dynamic=True)
    for n in (3, 4):
        x = torch.randn(n)
        mine = x.clone()
        torch.testing.assert_close(jitted(mine, mine), scaled(x, x), rtol=0, atol=0)
        torch.testing.assert_close(mine, x, rtol=0, atol=0)
    assert fulmen.compile_stats(jitted).eager_calls == 0  # compiled, not the aliasing fallback


def test_batch_first_self_attention_in_inference_is_row_major_as_eager():
    """`attention(x, x, x)`: eager's `query is key is value` fast path returns a new row-major
    tensor; traced as three inputs the regular path's transposed view came back."""
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    jitted = fulmen.jit(attention)
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        want, got = attention(x, x, x), jitted(x, x, x)
    assert got[0].stride() == want[0].stride() == (40, 8, 1)
    torch.testing.assert_close(got, want)
    assert fulmen.compile_stats(jitted).eager_calls == 0


class _Holder:
    def __init__(self, first, second):
        self.first, self.second = first, second


def _held(x, holder):
    if holder.first is x:
        return x * 3
    if holder.first is holder.second:
        return x - holder.first
    return x + holder.first


def test_a_tensor_an_object_argument_holds_as_well_is_the_same_tensor_inside():
    jitted = fulmen.jit(_held)
    x, y, z = torch.randn(3), torch.randn(3), torch.randn(3)
    for holder in [_Holder(x, z), _Holder(y, z), _Holder(y, y), _Holder(x, z), _Holder(z, y)]:
        torch.testing.assert_close(jitted(x, holder), _held(x, holder), rtol=0, atol=0)
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0 and stats.cache_misses == 3  # one entry per pattern
