"""User patterns probed in session 51 (h51probe2): what a jitted function returns matches
eager's values *and* layout, with symbolic sizes too, on the calls before a kernel is ready."""

import pytest
import torch

import fulmen
from fulmen.executors.codegen import set_compile_policy


@pytest.fixture
def torch_fallback_only():
    """Keep codegen regions on their torch fallback (the calls before a kernel is hot)."""
    previous = set_compile_policy("lazy", hot_calls=10_000)
    yield
    set_compile_policy(previous.mode, previous.hot_calls)


def _scores(x):
    return (x * 2).exp(), torch.sigmoid(x), x.sum(0, keepdim=True), x.softmax(-1)


@pytest.mark.parametrize("dynamic", [None, True])
def test_fused_softmax_of_a_transposed_input_is_row_major_with_symbolic_sizes(
        torch_fallback_only, dynamic):
    """Eager's softmax of a transposed input is row-major. Fused with other outputs and with
    symbolic sizes (dynamic=True, or the second shape under dynamic=None) the region's torch
    fallback returned it transposed: `.view(-1)` of it raised where eager's did not, and the
    strides changed once the kernel was ready (NOTE [the fallback's layouts])."""
    jfn = fulmen.jit(_scores, dynamic=dynamic) if dynamic else fulmen.jit(_scores)
    for rows in (5, 7, 6):
        x = torch.randn(rows, 4).T
        expected, actual = _scores(x), jfn(x)
        for want, got in zip(expected, actual):
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride(), (rows, want.stride(), got.stride())
        assert actual[-1].view(-1).shape == (4 * rows,)
    stats = fulmen.compile_stats(jfn)
    assert stats.eager_calls == 0
    assert any("fusion" in str(trace) for trace in stats.last_traces)  # a region was fused


def _scale_row_then_add(x):
    x[0].mul_(2)
    return x + 1


def _scale_flat_view(x):
    x.t().view(-1)[:5].mul_(2)  # a view eager's strides allow (x is column-major)
    return x * 3


def _intermediate_row_scaled(x):
    h = x.t() * 2
    h[0].mul_(3)
    return h.exp(), h.sum()


@pytest.mark.parametrize("dynamic", [None, True])
def test_in_place_through_a_view_of_a_column_major_tensor_keeps_eagers_layout(dynamic):
    """A mutation through a view writes into a copy of its base (`view_scatter`), which was
    row-major: what read the base after it came back row-major where eager keeps the
    column-major layout, and `x.t().view(-1)` of a column-major input, a view in eager, raised
    "the view of a mutation does not alias its base" (an error where eager has none)."""
    for fn in (_scale_row_then_add, _scale_flat_view):
        jfn = fulmen.jit(fn, dynamic=dynamic) if dynamic else fulmen.jit(fn)
        for rows in (4, 6):
            expected_x = torch.randn(rows, 3).T
            actual_x = expected_x.T.clone().T
            expected, actual = fn(expected_x), jfn(actual_x)
            torch.testing.assert_close(actual, expected)
            torch.testing.assert_close(actual_x, expected_x)
            assert actual.stride() == expected.stride(), (fn.__name__, rows)
        assert fulmen.compile_stats(jfn).eager_calls == 0


@pytest.mark.parametrize("dynamic", [None, True])
def test_in_place_on_a_transposed_intermediate_gradients(dynamic):
    """The same copy on a transposed intermediate that requires grad: values, strides and
    the input's gradient equal eager's."""
    jfn = fulmen.jit(_intermediate_row_scaled, dynamic=dynamic) if dynamic \
        else fulmen.jit(_intermediate_row_scaled)
    for rows in (4, 6):
        torch.manual_seed(rows)
        x = torch.randn(rows, 3, requires_grad=True)
        twin = x.detach().clone().requires_grad_()
        expected, actual = _intermediate_row_scaled(x), jfn(twin)
        for want, got in zip(expected, actual):
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()
        (expected[0].sum() + expected[1]).backward()
        (actual[0].sum() + actual[1]).backward()
        torch.testing.assert_close(twin.grad, x.grad)
    assert fulmen.compile_stats(jfn).eager_calls == 0


def _bump_pixels(x):
    x.permute(0, 2, 3, 1).view(-1, x.shape[1])[:3].add_(1)  # a view of a channels_last x
    return x.relu()


@pytest.mark.parametrize("dynamic", [None, True])
def test_in_place_through_a_pixel_view_of_a_channels_last_input(dynamic):
    """`x.permute(0, 2, 3, 1).view(-1, C)` of a channels_last `x` is a view in eager; an
    update through it raised "does not alias its base" (the copy of `x` was row-major)."""
    jfn = fulmen.jit(_bump_pixels, dynamic=dynamic) if dynamic else fulmen.jit(_bump_pixels)
    for height in (4, 6):
        expected_x = torch.randn(2, 3, height, 5).to(memory_format=torch.channels_last)
        actual_x = expected_x.clone(memory_format=torch.preserve_format)
        expected, actual = _bump_pixels(expected_x), jfn(actual_x)
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(actual_x, expected_x)
        assert actual.stride() == expected.stride()
    assert fulmen.compile_stats(jfn).eager_calls == 0
