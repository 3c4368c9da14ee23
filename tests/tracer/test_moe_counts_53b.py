"""Symbolic counts after a graph break in trees whose input sizes are symbolic too (NOTE
[symbolic counts at a break site] in `fulmen.tracer.break_sizes`): a mixture of experts trained
with varying sequence lengths retraces a bounded number of times, not at every step, and every
call equals eager, including the specialised counts (0, 1, a count equal to the length)."""


import pytest
import torch

import fulmen
from fulmen.tree import MAX_VARIANTS
from tests.tracer.test_moe_counts import TwoExperts
from tests.tracer.test_moe_counts import _compare_training as _compare


def test_varying_lengths_and_routing_retrace_a_bounded_number_of_times():
    torch.manual_seed(0)
    model = TwoExperts()
    lengths = [12, 16, 20, 24] * 2
    inputs = [torch.randn(n, 8) for n in lengths]
    stats = _compare(model, inputs)
    # an entry for the first length, one with a symbolic length; in it one retrace for the
    # counts going symbolic: not one per step
    assert stats.eager_calls == 0, stats.eager_calls
    assert len(stats.recompile_reasons) <= 4, stats.recompile_reasons
    assert stats.recompile_reasons[0][0].startswith("x.shape changed")  # (lengths symbolic)


def test_counts_related_to_the_length_are_checked_with_the_calls_length():
    """Decisions relating a count to the (symbolic) length, and the specialised counts 0, 1
    and a count equal to the length: each call takes a path traced for its own case."""

    def fn(x, w):
        (a,) = torch.where(x > 0)
        y = x[a] * 2
        if a.shape[0] * 2 > x.shape[0]:  # a count against the input's length
            y = y + 1
        if a.shape[0] == x.shape[0] - 1:
            y = y * 3
        return y.sum() + a.shape[0] + (w[: a.shape[0]].sum() if a.shape[0] <= w.shape[0] else 0)

    def batch(length: int, count: int) -> torch.Tensor:
        x = -torch.rand(length) - 0.1
        x[torch.randperm(length)[:count]] = 1.0
        return x

    jitted, w = fulmen.jit(fn), torch.randn(9)
    calls = [(12, 5), (16, 3), (16, 7), (20, 4), (12, 9), (20, 11), (16, 15), (20, 19),
             (12, 0), (16, 1), (20, 20), (12, 12), (16, 10), (12, 6), (20, 2), (16, 9)]
    for length, count in calls:
        x = batch(length, count)
        torch.testing.assert_close(jitted(x, w), fn(x, w))
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_sizes_made_after_the_break_from_the_length_and_the_count():
    """A segment after the break reads both the input's symbolic length and the count (one
    ShapeEnv holds both: symbols of two would share names)."""

    def fn(x):
        (a,) = torch.where(x > 0)
        out = x.new_zeros(x.shape[0] + 1).index_add(0, a, x[a] * 2)
        return out, x.new_ones(a.shape[0], x.shape[0]).cumsum(1) * x[a, None]

    jitted = fulmen.jit(fn)
    for length, count in [(12, 5), (16, 3), (16, 7), (20, 4), (12, 9), (20, 11), (16, 13)]:
        x = -torch.rand(length) - 0.1
        x[torch.randperm(length)[:count]] = 1.0 + torch.rand(count)
        for got, want in zip(jitted(x), fn(x)):
            torch.testing.assert_close(got, want)
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0 and len(stats.recompile_reasons) <= 3, stats.recompile_reasons


class HitExperts(torch.nn.Module):
    """HF Mixtral's eager experts: a loop over the experts hit, each indexing the routing mask
    by a 0-d tensor (a break whose size is the token count, varying with the length) and
    `torch.where` on it on the same line (a break whose size is the expert's count)."""

    def __init__(self, width: int = 8, experts: int = 3) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(width, experts, bias=False)
        self.w = torch.nn.Parameter(torch.randn(experts, width, width) / width ** 0.5)

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(chosen, self.w.shape[0]).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        out = torch.zeros_like(x)
        for e in hit:
            e = e[0]
            pos, idx = torch.where(mask[e])
            out = out.index_add(0, idx, (x[idx] @ self.w[e]) * weights[idx, pos, None])
        return out


def test_two_breaks_of_one_line_vary_apart():
    torch.manual_seed(6)
    inputs = [torch.randn(n, 8) for n in [8, 12, 16, 20] * 2]
    stats = _compare(HitExperts(), inputs)
    assert stats.eager_calls == 0 and len(stats.recompile_reasons) <= 4, stats.recompile_reasons


class Seen:
    """An object a jitted function counts into (a token counter of a router)."""

    def __init__(self) -> None:
        self.seen = 0
        self.area = 0


def _counted(x, stats):
    (idx,) = torch.where(x[:, 0] > 0)
    stats.seen = stats.seen + idx.shape[0]
    stats.area += idx.shape[0] * x.shape[0]  # a count times the (symbolic) length
    return x[idx].sum(0)


def test_a_count_stored_into_an_object_is_each_calls_own():
    jitted, mine, theirs = fulmen.jit(_counted), Seen(), Seen()
    calls = [(12, 5), (12, 7), (16, 3), (16, 9), (20, 0), (20, 1), (12, 12), (16, 6), (20, 11)]
    for length, count in calls:
        x = torch.randn(length, 4)
        x[:, 0] = -1.0
        x[torch.randperm(length)[:count], 0] = 1.0
        torch.testing.assert_close(jitted(x, mine), _counted(x, theirs))
        assert (mine.seen, mine.area) == (theirs.seen, theirs.area)
    stats = fulmen.compile_stats(jitted)
    # the counts symbolic once they vary (0 and 1 take exact paths): not a retrace per call
    assert stats.eager_calls == 0 and len(stats.recompile_reasons) <= 6, stats.recompile_reasons


@pytest.mark.parametrize("thirds", [False, True])
def test_counts_split_into_classes_get_a_generic_child_each(thirds):
    """Decisions on a count's parity and remainder (classes no bound tells apart): one
    generic child per class under one key, each taken only where its checks hold; past
    `MAX_VARIANTS` classes (`thirds`: six) the answers are refused, traced exactly."""

    def fn(x):
        (a,) = torch.where(x > 0)
        y = x[a] * 2
        y = y + 1 if a.shape[0] % 2 == 0 else y * 3
        if a.shape[0] % 3 == 1:
            y = y - 5
        elif thirds and a.shape[0] % 3 == 2:
            y = y * 7
        return y.sum()

    jitted, generator = fulmen.jit(fn), torch.Generator().manual_seed(7)
    counts = [5, 7, 4, 9, 6, 11, 8, 13, 10, 3, 12, 15, 14, 2, 16, 0, 1, 17, 19, 18, 21, 20]
    for n in counts:
        x = -torch.rand(24, generator=generator) - 0.1
        x[:n] = 1 + torch.rand(n, generator=generator)
        torch.testing.assert_close(jitted(x), fn(x))
    stats = fulmen.compile_stats(jitted)

    def widest(node) -> int:
        return max([len(keys) for keys in node.variants.values()]
                   + [widest(child) for child in node.children.values()], default=0)

    trees = [entry.fn for entry in stats.cache.values() if entry.tree]
    assert trees and max(widest(tree.root) for tree in trees) == MAX_VARIANTS
    if not thirds:  # four classes, then 0 and 1 exact: no eager call
        assert stats.eager_calls == 0 and len(stats.recompile_reasons) <= 7, \
            stats.recompile_reasons


def _count_against_length(x):
    (a,) = torch.where(x > 0)
    y = x[a] * 2
    if a.shape[0] * 2 > x.shape[0]:  # decided per call from the count and the length
        y = y + 1
    return y.sum()


def test_a_symbolic_length_entry_checks_counts_against_each_calls_length():
    """One entry with a symbolic length and symbolic counts serves lengths 16-32: its check
    `2 * count > length` must read each call's length (a length read from another call took
    the wrong branch at 24/10, 20/9 and 32/12). No path specialises the length here."""
    jitted = fulmen.jit(_count_against_length)
    calls = [(12, 5), (16, 5), (16, 9), (16, 6), (16, 10), (24, 10), (24, 13), (20, 9),
             (20, 11), (32, 12), (32, 17), (24, 10)]
    for length, count in calls:
        x = -torch.rand(length) - 0.1
        x[torch.randperm(length)[:count]] = 1.0
        torch.testing.assert_close(jitted(x), _count_against_length(x))
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0 and stats.cache_misses <= 2
