"""Divergences from eager PyTorch in requires_grad, aliasing and autograd behaviour, each found
by a probe and fixed: the compiled call must answer as eager does."""

import pytest
import torch

import fulmen


def _view_under_no_grad(x):
    with torch.no_grad():
        v = x[1:].t()
    return v


def _view_under_no_grad_then_grad(x):
    with torch.no_grad():
        v = x[1:]
    return v.t()


@pytest.mark.parametrize("fn", [_view_under_no_grad, _view_under_no_grad_then_grad])
def test_view_of_an_input_taken_under_no_grad_answers_as_eager(fn):
    x = torch.randn(4, 3, requires_grad=True)
    expected, actual = fn(x), fulmen.jit(fn)(x)
    assert torch.equal(actual, expected)
    assert actual.requires_grad == expected.requires_grad
    assert actual._base is x and expected._base is x
    assert type(actual.grad_fn) is type(expected.grad_fn)
    assert actual.is_leaf == expected.is_leaf


def test_in_place_on_a_view_taken_under_no_grad_raises_as_eager():
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="created in no_grad mode"):
        _view_under_no_grad(x).add_(1)
    with pytest.raises(RuntimeError, match="created in no_grad mode"):
        fulmen.jit(_view_under_no_grad)(x).add_(1)


def _total(y):
    return y.sum()


def test_input_updated_in_place_after_a_dynamic_sum_still_backpropagates():
    # sum's backward needs only y's sizes: eager saves no tensor, so a later in-place update
    # of y is fine; the symbolic sizes must not keep y itself saved
    jf = fulmen.jit(_total, dynamic=True)
    for rows in (5, 7):
        x = torch.randn(rows, 3, requires_grad=True)
        y = x * 1
        total = jf(y)
        y.mul_(3)
        total.backward()
        assert torch.equal(x.grad, torch.ones(rows, 3))
