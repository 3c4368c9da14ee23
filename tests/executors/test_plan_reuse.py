"""Call plans of symbolic regions across a sweep (issue 16): a symbolic entry serves many sizes
and strides, and each call must run a plan made for its own inputs' sizes and strides, never
one made for another call of the same entry (`fulmen.executors.codegen.cpu.plans`)."""

import pytest
import torch

import fulmen
from fulmen.executors.codegen.cpu.plans import kept_key
from fulmen.executors.codegen.cpu.runtime import FusedRegion

pytestmark = pytest.mark.usefixtures("codegen_eager")

EXECUTORS = ["codegen", "torch"]


def _regions(jfn) -> list[FusedRegion]:
    trace = fulmen.last_traces(jfn)[-1]
    return [bsym.sym.impl for bsym in trace.bsyms if isinstance(bsym.sym.impl, FusedRegion)]


def _plans(jfn) -> int:
    return sum(len(region._plans) for region in _regions(jfn))


def _check(jfn, fn, *args) -> None:
    torch.testing.assert_close(jfn(*args), fn(*args))


def test_one_symbolic_entry_runs_a_plan_per_stride_of_the_same_size():
    # x is a column slice of a wider tensor: sizes vary (a symbolic entry), and calls of one
    # size with two widths of the base differ only in x's row stride
    def fn(x, y):
        return torch.sigmoid(x * y + 1.5) - x

    jfn = fulmen.jit(fn, executors=EXECUTORS, dynamic=True)
    for n, width in [(4, 8), (6, 12), (6, 20), (6, 12), (9, 11), (6, 7)]:
        x = torch.randn(5, width)[:, :n]
        _check(jfn, fn, x, torch.randn(n))
    assert fulmen.cache_misses(jfn) == 1
    assert _regions(jfn) and _plans(jfn) >= 5  # each (size, stride) ran the kernel's own plan


def test_a_transposed_input_of_a_symbolic_entry_is_not_run_with_the_row_major_plan():
    # the same shape, once row-major and once a transpose: the strides swap, the shape does not
    def fn(x):
        return torch.exp(x) * 2 + x

    jfn = fulmen.jit(fn, executors=EXECUTORS, dynamic=True)
    for n in (3, 5):
        _check(jfn, fn, torch.randn(n, n))
    for n in (5, 4):
        _check(jfn, fn, torch.randn(n, n).t())
        _check(jfn, fn, torch.randn(n, n))


def test_rows_of_a_symbolic_norm_over_strided_and_contiguous_inputs():
    # a row kernel (an RMS norm) whose rows are read with a stride: every other column of a
    # wider input, then contiguous inputs of the same sizes
    def fn(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w

    jfn = fulmen.jit(fn, executors=EXECUTORS, dynamic=True)
    for rows, cols in [(3, 8), (5, 8), (5, 16)]:
        w = torch.randn(cols)
        _check(jfn, fn, torch.randn(rows, 2 * cols)[:, ::2], w)
        _check(jfn, fn, torch.randn(rows, cols), w)
    assert _regions(jfn) and _plans(jfn) >= 2


def test_a_merged_broadcast_is_split_in_a_symbolic_sweep():
    # grouped-query attention's repeated keys: a broadcast merged by a reshape, read in place
    # by splitting the merged dim (NOTE [a merged broadcast is a split iteration dim]); the
    # plan's split must be made for each size, not skipped
    def fn(k):
        b, h, s, d = k.shape
        rep = k[:, :, None].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)
        return rep * 3 + 1

    jfn = fulmen.jit(fn, executors=EXECUTORS, dynamic=True)
    for s in (5, 7, 11):
        _check(jfn, fn, torch.randn(2, 2, s, 4))
    assert _regions(jfn)


def test_a_plan_run_again_and_again_gets_its_check():
    # NOTE [a check for reuse]: a plan made in a sweep is not checked at once, but one run
    # again and again gets the C++ check that skips the table (NOTE [the last plan])
    def fn(x):
        return torch.sin(x) * 2 + x

    jfn = fulmen.jit(fn, executors=EXECUTORS, dynamic=True)
    for n in (3, 5):
        _check(jfn, fn, torch.randn(4, n))
    (region,) = _regions(jfn)
    x = torch.randn(4, 6)
    for _ in range(4):
        torch.testing.assert_close(region(x), fn(x))
    assert region._last is not None and region._last[3] is region._plans[kept_key(
        (torch.get_num_threads(), (x.shape, x.stride(), x.dtype, True, False)))]
