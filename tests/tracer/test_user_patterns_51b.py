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
