"""Cache keys tell apart the Python scalars eager tells apart: 0.0 and -0.0 (a sign that
`math.copysign` or a division bakes into the trace), as arguments and as globals read."""

import math

import torch

import fulmen
from fulmen.tracer.guards import _leaf_key, explain_change

SIGN = 0.0


def _signed(x, s):
    return x * math.copysign(1.0, s)


def test_signed_zero_arguments_get_separate_cache_entries():
    jfn = fulmen.jit(_signed)
    x = torch.ones(3)
    torch.testing.assert_close(jfn(x, 0.0), _signed(x, 0.0))
    torch.testing.assert_close(jfn(x, -0.0), _signed(x, -0.0))
    assert fulmen.compile_stats(jfn).cache_misses == 2


def test_signed_zero_global_is_guarded():
    global SIGN

    def fn(x):
        return x * math.copysign(1.0, SIGN)

    jfn = fulmen.jit(fn)
    x = torch.ones(2)
    try:
        SIGN = 0.0
        torch.testing.assert_close(jfn(x), fn(x))
        SIGN = -0.0
        torch.testing.assert_close(jfn(x), fn(x))
    finally:
        SIGN = 0.0


def test_signed_zero_added_to_a_negative_zero_tensor():
    def fn(x, s):
        return x + s

    jfn = fulmen.jit(fn)
    x = torch.tensor([-0.0])
    for s in (0.0, -0.0):
        assert torch.equal(jfn(x, s).signbit(), fn(x, s).signbit())


def test_keys_of_equal_and_distinct_floats():
    assert _leaf_key(0.0) != _leaf_key(-0.0)
    assert _leaf_key(math.nan) == _leaf_key(float("nan"))
    assert _leaf_key(1.5) == _leaf_key(1.5)
    assert _leaf_key(0.0) != _leaf_key(0)
    assert _leaf_key(complex(0.0, -0.0)) != _leaf_key(complex(0.0, 0.0))


def test_recompile_reason_names_the_sign_of_zero():
    assert explain_change({"s": 0.0}, {"s": -0.0}) == ["s changed from 0.0 to -0.0"]
