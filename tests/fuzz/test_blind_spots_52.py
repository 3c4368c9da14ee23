"""Session 52 blind spots: behaviours whose planted miscompiles (tests/fuzz/mutant_table.py,
section "session 52, h52mut") no earlier test caught. Each test compares fulmen with eager
PyTorch (or, for a pure helper, with a brute-force answer), never with fulmen itself.
"""

from __future__ import annotations

import torch

import fulmen


def _fresh(*tensors):
    return [t.clone() for t in tensors]


def _same_outputs_and_inputs(fn, *args):
    """`jit(fn)` gives eager's outputs and leaves its inputs as eager leaves them, on a miss and
    on a hit; returns the jitted function."""
    eager_args = _fresh(*args)
    expected = fn(*eager_args)
    jfn = fulmen.jit(fn)
    for _ in range(2):
        jit_args = _fresh(*args)
        actual = jfn(*jit_args)
        torch.testing.assert_close(actual, expected)
        for a, e in zip(jit_args, eager_args, strict=True):
            torch.testing.assert_close(a, e)
    return jfn


# --- views the mutation tracker must know (tracer/view_calls.py) -----------------------------


def _write_through_unflatten(x):
    v = x.unflatten(1, (2, 3))
    v[:, 1].mul_(10)
    return x + 1


def _write_through_unflatten_of_intermediate(x):
    y = x * 2
    y.unflatten(0, (2, 2)).select(1, 0).zero_()
    return y


def test_a_write_through_an_unflatten_view_reaches_its_base():
    _same_outputs_and_inputs(_write_through_unflatten, torch.randn(3, 6))
    _same_outputs_and_inputs(_write_through_unflatten_of_intermediate, torch.randn(4, 3))


def _write_through_overlapping_windows(x):
    x.unfold(0, 2, 1).mul_(2)  # windows share elements: eager's kernel writes each once per read
    return x + 0


def _read_windows_after_base_write(x):
    y = x * 1
    v = y.unfold(0, 2, 1)
    y.add_(1)
    return v * 1


def test_overlapping_unfold_windows_never_give_a_wrong_answer():
    """A write through (or a read after a write under) windows that overlap depends on the
    memory layout: fulmen refuses it or matches eager, never computes other values."""
    for fn in (_write_through_overlapping_windows, _read_windows_after_base_write):
        eager_x = torch.arange(12.0).reshape(6, 2)
        expected = fn(eager_x)
        jit_x = torch.arange(12.0).reshape(6, 2)
        try:
            actual = fulmen.jit(fn)(jit_x)
        except fulmen.NotYetSupportedError as error:  # refused for the aliasing, not a crash
            assert "alias" in str(error), error
            continue
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(jit_x, eager_x)


def _bool_index_views(x):
    y = x * 1
    v = y[True]
    v.add_(1)
    w = y[True, 0]
    y.mul_(3)
    return y, w * 1


def _false_index_copy(x):
    y = x * 1
    y[False].add_(1)  # an empty copy: y unchanged
    return y


def _true_index_of_input(x):
    x[True].mul_(2)
    return x + 0


def test_bool_indexing_views_and_copies_as_eager():
    _same_outputs_and_inputs(_bool_index_views, torch.randn(4, 3))
    _same_outputs_and_inputs(_false_index_copy, torch.randn(4, 3))
    _same_outputs_and_inputs(_true_index_of_input, torch.randn(4, 3))


# --- object arguments put back after tracing (tracer/object_inputs.py) -----------------------


class _Pair:
    def __init__(self, a: float, b: float):
        self.pair = (a, b)


def _scaled_by_pair(x, h):
    return x * h.pair[0] + h.pair[1]


def test_a_tuple_of_two_changing_floats_is_put_back_as_it_was():
    """Both floats of a tuple read at run time: the tuple is rebuilt twice while tracing, and
    the object must hold its own tuple of plain floats after every call."""
    jfn = fulmen.jit(_scaled_by_pair)
    x = torch.randn(4)
    for step in range(4):
        a, b = 0.5 + step, 2.0 - step / 3
        h = _Pair(a, b)
        torch.testing.assert_close(jfn(x, h), _scaled_by_pair(x, _Pair(a, b)))
        assert h.pair == (a, b) and all(type(v) is float for v in h.pair), h.pair


# --- dtype conversions (ops/torch/conversions.py) --------------------------------------------


def _type_names(x):
    return x.type(), x.short().type(), x.char().type(), x.bool().type(), x.half().type()


def test_legacy_type_names_as_eager():
    x = torch.randn(3)
    assert fulmen.jit(lambda x: (x + 1, *_type_names(x)))(x)[1:] == _type_names(x)


# --- floats read at run time (ops/host_float.py) ---------------------------------------------


def _host_float_math(x, t):
    return x * abs(t - 2.0) + (t - 3.0) % 2.0 - (-t) // 3.0 + (+t) ** 2 - 2.0 ** t


def test_arithmetic_on_a_changing_float_is_pythons():
    """`abs`, `%`, `//`, unary signs and powers of a float read at run time (negative values
    included, where `%` and `fmod` differ)."""
    jfn = fulmen.jit(_host_float_math)
    x = torch.randn(4, dtype=torch.float64)
    for t in (0.25, 1.5, 2.75, 4.5, -1.25):
        torch.testing.assert_close(jfn(x, t), _host_float_math(x, t))
    # the float is read at run time; its sign is keyed (NOTE [floats read at run time]): the
    # negative value is one more entry
    assert fulmen.compile_stats(jfn).cache_misses <= 3



# --- inputs that share memory (tracer/input_aliasing.py) -------------------------------------


def _write_third_read_first(a, b, c):
    c.add_(1)
    return a.sum() + b.sum()


def test_a_write_to_an_input_inside_a_wider_one_past_a_narrow_one_is_seen():
    """`a` spans the buffer, `b` and `c` are disjoint slices of it: `c` overlaps `a` though it
    starts past `b`'s end (the cluster of overlapping ranges must keep `a`'s end)."""
    eager = torch.randn(100)
    jitted = eager.clone()
    expected = _write_third_read_first(eager, eager[10:20], eager[50:60])
    actual = fulmen.jit(_write_third_read_first)(jitted, jitted[10:20], jitted[50:60])
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(jitted, eager)

# --- kernel spellings (executors/codegen/target.py) ------------------------------------------


def _rounded_quotients(a, b):
    return (torch.div(a, b, rounding_mode="trunc") * 3 + 1,
            torch.div(a * 2, b, rounding_mode="trunc").abs())


def test_a_fused_truncated_division_rounds_toward_zero(codegen_eager, monkeypatch):
    """Float32 `div(rounding_mode="trunc")` rendered in a kernel (`{trunc}` of the op table is
    the target's trunc): negative quotients round up, as eager's."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "1")
    a = torch.tensor([-7.0, -5.5, -0.5, 0.5, 5.5, 7.0, -9.0, 3.0])
    b = torch.tensor([2.0, 2.0, 3.0, 3.0, -2.0, -4.0, 4.0, -2.0])
    jfn = fulmen.jit(_rounded_quotients, executors=["codegen", "torch"])
    for actual, expected in zip(jfn(a, b), _rounded_quotients(a, b), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    from fulmen.executors.codegen import kernel_sources

    assert "trunc" in "".join(kernel_sources(fulmen.last_traces(jfn)[-1]).values())
