"""Tensors held by tuples nested in tuples (and named tuples) inside an object argument: each
call reads its own object's tensors, never the first call's (they were captured before)."""

from collections import namedtuple

import torch

import fulmen

Pair = namedtuple("Pair", "key value")


class Cache:
    def __init__(self, state):
        self.state = state


def _nested(a, b):
    return Cache([((a, b),)])


def _read_nested(x, cache):
    (a, b), = cache.state[0]
    return x * a + b


def test_a_tuple_in_a_tuple_of_an_object_is_read_per_call():
    jf = fulmen.jit(_read_nested)
    x = torch.randn(3)
    for _ in range(3):
        cache = _nested(torch.randn(3), torch.randn(3))
        torch.testing.assert_close(jf(x, cache), _read_nested(x, cache))
    assert fulmen.compile_stats(jf).eager_calls == 0
    assert fulmen.compile_stats(jf).cache_misses == 1


def test_an_in_place_change_of_a_nested_tuple_tensor_is_seen():
    jf = fulmen.jit(_read_nested)
    x = torch.randn(3)
    cache = _nested(torch.randn(3), torch.randn(3))
    jf(x, cache)
    cache.state[0][0][0].add_(1.0)
    torch.testing.assert_close(jf(x, cache), _read_nested(x, cache))


def _scale_nested(x, cache):
    (a, _), = cache.state[0]
    a.mul_(2)
    return x * a


def test_a_write_into_a_nested_tuple_tensor_lands_in_each_calls_object():
    jf = fulmen.jit(_scale_nested)
    x = torch.randn(3)
    for _ in range(2):
        mine, theirs = _nested(torch.ones(3), torch.ones(3)), _nested(torch.ones(3), torch.ones(3))
        original = mine.state[0]
        torch.testing.assert_close(jf(x, mine), _scale_nested(x, theirs))
        torch.testing.assert_close(mine.state[0][0][0], theirs.state[0][0][0])
        assert mine.state[0] is original  # the rebuilt tuples were put back
    assert fulmen.compile_stats(jf).eager_calls == 0


def _read_pairs(x, cache):
    return sum(x * pair.key + pair.value for pair in cache.state)


def test_named_tuples_in_an_object_are_read_per_call():
    jf = fulmen.jit(_read_pairs)
    x = torch.randn(4)
    for _ in range(3):
        cache = Cache([Pair(torch.randn(4), torch.randn(4)), Pair(torch.randn(4), torch.randn(4))])
        out = jf(x, cache)
        torch.testing.assert_close(out, _read_pairs(x, cache))
        assert type(cache.state[0]) is Pair
    assert fulmen.compile_stats(jf).eager_calls == 0


def _read_max(x, cache):
    return x * cache.state[0].values


def test_a_tuple_kind_that_cannot_be_rebuilt_runs_eagerly_with_each_calls_tensors():
    jf = fulmen.jit(_read_max)
    x = torch.randn(3)
    for _ in range(2):
        cache = Cache([torch.randn(2, 3).max(dim=0)])  # torch.return_types.max
        torch.testing.assert_close(jf(x, cache), _read_max(x, cache))
    assert fulmen.compile_stats(jf).eager_calls >= 1
