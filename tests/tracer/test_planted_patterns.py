"""Layouts, in-place passes and the autograd bridge on patterns the planted-bug campaign of
issue 18 (helper h39ver) found untested; each compares with eager and names the mutant of
`tests/fuzz/mutant_table.py` it kills."""

import pytest
import torch
import torch.nn.functional as F

import fulmen
from fulmen.core import NotYetSupportedError


def test_cat_of_channels_last_3d_keeps_eagers_layout():
    """`cat` of rank-5 channels-last-3d tensors: eager's result is channels-last-3d, and code
    reading its layout inside the function sees that (kills cat_rank5_row_major)."""
    def fn(a, b):
        out = torch.cat([a, b], 1)
        return out * 2, out.stride(), out.is_contiguous()

    fmt = torch.channels_last_3d
    a = torch.randn(2, 3, 4, 5, 6).contiguous(memory_format=fmt)
    b = torch.randn(2, 2, 4, 5, 6).contiguous(memory_format=fmt)
    got, want = fulmen.jit(fn)(a, b), fn(a, b)
    assert got[1:] == want[1:]
    assert got[0].stride() == want[0].stride()
    torch.testing.assert_close(got[0], want[0])


def test_onednn_linear_where_only_the_bias_requires_grad():
    """The oneDNN operator under recorded grad with only the bias requiring grad must record
    eager's graph (oneDNN's linear has none): kills onednn_bias_grad_dropped."""
    from fulmen.executors.torch.onednn_linear import ONEDNN_LINEAR
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    torch.manual_seed(0)
    x, w = torch.randn(2, 64, 128), torch.randn(1024, 128)
    b = torch.randn(1024, requires_grad=True)
    out = ONEDNN_LINEAR.impl(x, w, b)
    torch.testing.assert_close(out, F.linear(x, w, b))
    (grad,) = torch.autograd.grad(out.sum(), b)
    torch.testing.assert_close(grad, torch.full((1024,), 128.0))


def _cache_inputs():
    torch.manual_seed(0)
    return torch.randn(1, 2, 16, 4), torch.tensor([5, 6]), torch.randn(1, 2, 2, 4)


def _compare_with_inputs(fn):
    """fulmen and eager on equal copies of the inputs, twice: results agree (to float32's
    rounding: a fused kernel sums in another order than eager, and whether it runs depends on
    the disk cache), inputs agree exactly, and each result shares storage with a given input
    exactly where eager's does."""
    jfn = fulmen.jit(fn)
    for _ in range(2):
        args, ref = _cache_inputs(), _cache_inputs()
        got, want = jfn(*args), fn(*ref)
        torch.testing.assert_close(got, want)
        for a, r in zip(args, ref):
            torch.testing.assert_close(a, r, rtol=0, atol=0)
        for g, w in zip(got, want):
            assert [g.data_ptr() == a.data_ptr() for a in args] == \
                   [w.data_ptr() == r.data_ptr() for r in ref]


def test_returned_out_of_place_index_copy_stays_apart_from_the_cache():
    """`out = cache.index_copy(...)`, then `cache.copy_(out)`, returning `out`: eager's `out`
    is its own tensor, not the cache (kills index_copy_returned_result_in_place)."""
    def fn(cache, pos, new):
        out = cache.index_copy(2, pos, new)
        cache.copy_(out)
        return out, cache * 1

    _compare_with_inputs(fn)


def test_cache_written_with_another_value_than_the_index_copy():
    """The cache is overwritten with a value computed from the index_copy, not the index_copy
    itself: the pass must not run the index_copy in place and drop that write (kills
    index_copy_write_back_of_other_value)."""
    def fn(cache, pos, new):
        out = cache.index_copy(2, pos, new)
        cache.copy_(out * 2)
        return (out.sum(),)

    _compare_with_inputs(fn)


def test_double_backward_of_a_function_updating_a_buffer():
    """A function that updates a buffer in place: a double backward (create_graph=True) either
    raises a clear error or matches eager, and never applies the update a second time (kills
    double_backward_recomputes_write_backs)."""
    def fn(x, buf):
        buf.add_(1)
        return (x * buf).pow(3).sum()

    x = torch.randn(5, requires_grad=True)
    buf, ref = torch.zeros(5), torch.zeros(5)
    (g,) = torch.autograd.grad(fn(x, ref), x, create_graph=True)
    (expected,) = torch.autograd.grad(g.sum(), x)
    jfn = fulmen.jit(fn)
    try:
        (g,) = torch.autograd.grad(jfn(x, buf), x, create_graph=True)
        (actual,) = torch.autograd.grad(g.sum(), x)
    except NotYetSupportedError:
        actual = None
    torch.testing.assert_close(buf, ref, rtol=0, atol=0)
    if actual is not None:
        torch.testing.assert_close(actual, expected)


_VIEWS = {"slice": lambda y: y[1:3], "transpose": lambda y: y.t(),
          "view": lambda y: y.view(-1), "chain": lambda y: y[:, 1:].unsqueeze(0).transpose(1, 2),
          "with another output": lambda y: (y[0], y * 2)}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("name", list(_VIEWS))
def test_a_returned_view_of_an_input_requiring_grad_updates_in_place_as_in_eager(name, dynamic):
    """`v = f(y)` returning a view of `y` (a non-leaf requiring grad), then `v.mul_(3)`: eager
    updates `y` through the view and differentiates through the update; fulmen raised
    autograd's error for a view made inside a custom Function (kills returned_view_from_the_function)."""
    fn = _VIEWS[name]
    jfn = fulmen.jit(fn, dynamic=dynamic)
    for rows in (4, 5, 6):
        x = torch.randn(rows, 3, requires_grad=True)
        results = []
        for f in (fn, jfn):
            y = x * 2
            out = f(y)
            view = out[0] if isinstance(out, tuple) else out
            view.mul_(3)
            loss = (y ** 2).sum() + (view * 1.5).sum()
            if isinstance(out, tuple):
                loss = loss + out[1].sum()
            results.append((y.detach(), view.detach(), torch.autograd.grad(loss, x)[0]))
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want)


def test_equal_outputs_of_a_training_call_stay_distinct_tensors():
    """`return x * 2, x * 2` with grad: eager returns two tensors; an in-place update of one
    leaves the other, and each gets its own gradient (kills cse_split_merges_user_outputs)."""
    def fn(x):
        h = x.sin()
        return h * 2, h * 2, x.exp() * 3

    results = []
    x = torch.randn(4, 3, requires_grad=True)
    for f in (fn, fulmen.jit(fn)):
        a, b, c = f(x)
        assert a.data_ptr() != b.data_ptr()
        a.add_(1)
        loss = (a * 2).sum() + (b ** 2).sum() + c.sum()
        results.append((a.detach(), b.detach(), torch.autograd.grad(loss, x)[0]))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want)


def test_an_erased_key_never_takes_a_non_integer_for_a_symbolic_integer():
    """A static entry keyed on a float or bool where the symbolic entry has an integer is not
    served by it, so its erased key must not equal an integer call's (kills
    subsumed_int_value_kept_as_any)."""
    from fulmen.tracer.guards import CacheKeyBuilder
    from fulmen.tracer.subsumed import erased_key

    builder, x, symbolic = CacheKeyBuilder(), torch.randn(2, 3), {1: "int"}
    keys = []
    for n in (3, 5, 2.5, True, -1.0):
        static, _ = builder.key((x,), {"n": n})
        masked, _ = builder.key((x,), {"n": n}, (), symbolic)
        keys.append((erased_key(static, symbolic, builder.offset_positions), masked))
    for erased_a, masked_a in keys:
        for erased_b, masked_b in keys:
            if erased_a is not None and erased_a == erased_b:
                assert masked_a and masked_a == masked_b


@pytest.mark.parametrize("fuse_tiny", ["0", "1"])
def test_a_relu_of_an_argument_leaves_the_argument(fuse_tiny, monkeypatch):
    """`relu(x)` reading an argument last: the in-place relu pass may only overwrite a product
    the trace made, never the caller's tensor (kills relu_in_place_of_an_input)."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", fuse_tiny)
    w = torch.randn(8, 8)

    def fn(x, y):
        return F.relu(x) * 2, F.relu(F.linear(y, w))

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    before = x.clone(), y.clone()
    for got, want in zip(fulmen.jit(fn)(x, y), fn(*before)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close((x, y), before, rtol=0, atol=0)
