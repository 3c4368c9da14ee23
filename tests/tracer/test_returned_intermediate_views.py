"""Outputs eager returns as views of a tensor the call made (`return (x * 2)[0]`), under grad
(NOTE [a view of an intermediate returned]): updated in place and differentiated as in eager,
where the compiled program's view raised autograd's custom-Function error. What still differs
is pinned here: `_is_view()`/`._base` (eager: the intermediate), and two outputs viewing one
intermediate (their in-place update still raises)."""

import pytest
import torch

import fulmen


def _first_row(x):
    return (x * 2)[0]


def _transposed(x):
    return torch.sin(x).t()


def _flattened(x):
    return torch.tanh(x).mul(3).view(-1)


@pytest.mark.parametrize("fn", [_first_row, _transposed, _flattened])
@pytest.mark.parametrize("update", ["add_", "mul_"])
def test_a_view_of_an_intermediate_updated_in_place_then_differentiated(fn, update):
    jitted = fulmen.jit(fn)
    for _ in range(2):
        x = torch.randn(3, 3, requires_grad=True)
        twin = x.detach().clone().requires_grad_(True)
        got, want = jitted(x), fn(twin)
        getattr(got, update)(2)
        getattr(want, update)(2)
        torch.testing.assert_close(got, want)
        (got * torch.arange(got.numel()).view(got.shape)).sum().backward()
        (want * torch.arange(want.numel()).view(want.shape)).sum().backward()
        torch.testing.assert_close(x.grad, twin.grad)
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_a_views_base_is_not_eagers_known_difference():
    x = torch.randn(3, 3, requires_grad=True)
    got, want = fulmen.jit(_first_row)(x), _first_row(x)
    assert want._is_view() and want._base is not None
    assert not got._is_view() and got._base is None  # (eager: the intermediate `x * 2`)


def test_an_update_of_one_of_two_views_of_one_intermediate_still_raises():
    """Detached, an update of one view would change the other unseen by autograd (its gradient
    would no longer be eager's): the Function's views raise instead, loudly."""

    def two_views(x):
        y = x * 2
        return y.view(-1), y[0]

    a, b = fulmen.jit(two_views)(torch.randn(3, 3, requires_grad=True))
    assert a._is_view() and b._is_view()
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        a.mul_(2)


def test_an_update_of_a_view_whose_base_the_backward_saved_raises_as_in_eager():
    """`exp` saves its result: eager's in-place update of a view of it makes the backward raise,
    and so does the compiled program's (the detached output shares the version counter)."""
    w = torch.randn(16, 16)

    def f(x):
        return (x @ w).exp().t()

    for fn in (f, fulmen.jit(f)):
        out = fn(torch.randn(4, 16, requires_grad=True))
        out.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
