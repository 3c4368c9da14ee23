"""In-place metadata changes (`unsqueeze_`, `t_`, ...) of tensors the call makes are traced
(NOTE [in-place metadata changes] in fulmen/tracer/metadata_inplace.py); the caller's tensors,
and references fulmen cannot rebind, run eagerly."""

import warnings

import pytest
import torch

import fulmen
from fulmen.core import NotYetSupportedError


def _compiled_without_fallback(fn, *args):
    jfn = fulmen.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "runs eagerly" would be a warning
        out = jfn(*args)
    assert fulmen.compile_stats(jfn).eager_calls == 0
    return jfn, out


def _local_unsqueeze(a, b):
    x = a @ b
    x.unsqueeze_(1)
    return x * 2, x.shape[1]


@pytest.mark.parametrize("op", ["unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_",
                                "as_strided_"])
def test_metadata_change_of_a_local_is_traced(op):
    calls = {
        "unsqueeze_": lambda x: x.unsqueeze_(0), "squeeze_": lambda x: x.squeeze_(1),
        "t_": lambda x: x.t_(), "transpose_": lambda x: x.transpose_(0, 1),
        "swapdims_": lambda x: x.swapdims_(1, 0), "as_strided_": lambda x: x.as_strided_((2, 2), (1, 3)),
    }

    def fn(a):
        x = a * 1
        alias = x
        back = calls[op](x)
        return x + 1, alias.shape, back is x, x.stride()

    a = torch.randn(3, 1) if op == "squeeze_" else torch.randn(3, 3)
    expected = fn(a)
    jfn, out = _compiled_without_fallback(fn, a)
    torch.testing.assert_close(out[0], expected[0])
    assert out[1:] == expected[1:]


def test_metadata_change_gradients_and_repeated_calls():
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    out, n = _local_unsqueeze(a, b)
    out.sum().backward()
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    jfn, (jout, jn) = _compiled_without_fallback(_local_unsqueeze, a, b)
    assert jout.shape == out.shape and jn == n
    jout.sum().backward()
    torch.testing.assert_close((a.grad, b.grad), (ga, gb))
    jfn = fulmen.jit(_local_unsqueeze)
    for _ in range(3):  # other values: cache hits
        a2 = torch.randn(2, 3)
        torch.testing.assert_close(jfn(a2, b.detach())[0], _local_unsqueeze(a2, b.detach())[0])
    assert fulmen.compile_stats(jfn).cache_hits == 2


def test_metadata_change_in_a_helper_rebinds_the_callers_local():
    def helper(t):
        t.unsqueeze_(0)

    def fn(a):
        x = a + 1
        helper(x)
        return x.shape, x * 3

    a = torch.randn(3)
    _, out = _compiled_without_fallback(fn, a)
    assert out[0] == (1, 3)
    torch.testing.assert_close(out[1], fn(a)[1])


def test_metadata_change_keeps_aliasing_with_earlier_views():
    def fn(a):
        x = a * 1
        row = x[0]
        x.t_()
        x.add_(1)  # row, a view of x, sees it
        row.mul_(10)  # and x sees this
        return x, row

    a = torch.randn(2, 3)
    _, out = _compiled_without_fallback(fn, a)
    torch.testing.assert_close(out, fn(a))


def test_a_reference_that_is_not_rebound_runs_eagerly():
    def fn(a):
        x = a * 1
        held = [x]
        x.unsqueeze_(0)
        return held[0].shape, held[0] + 1  # eager: the same tensor, now 2-d

    a = torch.randn(3)
    jfn = fulmen.jit(fn)
    with pytest.warns(UserWarning, match="runs eagerly|in-place change of its shape"):
        out = jfn(a)
    expected = fn(a)
    assert out[0] == expected[0]
    torch.testing.assert_close(out[1], expected[1])
    with pytest.raises(NotYetSupportedError):
        fulmen.jit(fn, fullgraph=True)(a)


def test_metadata_change_of_an_argument_or_a_view_of_one_still_runs_eagerly():
    def of_view(x):
        v = x[0]
        v.unsqueeze_(0)
        return v * 1

    x = torch.randn(2, 3)
    with pytest.warns(UserWarning, match="unsqueeze_"):
        out = fulmen.jit(of_view)(x)
    torch.testing.assert_close(out, of_view(x))
    x = torch.randn(2, 3)
    with pytest.warns(UserWarning, match="t_"):
        out = fulmen.jit(lambda t: t.t_())(x)
    assert out is x and x.shape == (3, 2)


@pytest.mark.parametrize("result", [lambda a, w: a * w, lambda a, w: a * w.dim()],
                         ids=["of_the_leaf", "of_its_rank"])
def test_metadata_change_of_a_new_leaf_requiring_grad_raises_as_eager(result):
    # (a result computed from the leaf runs the call eagerly anyway, NOTE [fresh leaves]; one
    # reading only its rank tests the metadata change's own check)
    def fn(a):
        w = torch.zeros(3, requires_grad=True)
        w.unsqueeze_(0)
        return result(a, w)

    with pytest.raises(RuntimeError, match="leaf Variable"):
        fn(torch.ones(3))
    with pytest.raises(RuntimeError, match="leaf Variable"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fulmen.jit(fn)(torch.ones(3))

