"""Graph-break guards tell answers apart exactly as Python does, and a path is recorded for the
answer the program saw (each compared with eager, values and compile counts)."""

import math

import torch

import fulmen


def test_a_branch_on_the_sign_of_a_zero_takes_each_path_like_eager():
    def fn(x):
        return x * math.copysign(1.0, x[0].item())  # 0.0 and -0.0 are equal, signs differ

    jfn = fulmen.jit(fn)
    for first in (0.0, -0.0, 0.0, -0.0):
        x = torch.tensor([first, 2.0, 3.0])
        torch.testing.assert_close(jfn(x), fn(x))
    assert fulmen.compile_stats(jfn).branches == 2


def test_a_list_answer_the_program_changes_keeps_its_recorded_value():
    def fn(x):
        values = x.tolist()
        values.append(1.0)  # user code edits the answer it was handed
        return x * len(values)

    jfn = fulmen.jit(fn)
    for _ in range(3):
        x = torch.tensor([1.0, 2.0])
        torch.testing.assert_close(jfn(x), fn(x))
    stats = fulmen.compile_stats(jfn)
    assert stats.eager_calls == 0 and stats.branches == 1 and not stats.recompile_reasons


def test_random_draws_between_two_breaks_answer_like_eager():
    def fn(x):
        a = torch.rand(16)
        x = x + 1 if a.sum() > 8 else x - 1
        b = torch.rand(16)
        x = x * 2 if b.sum() > 8 else x * 3
        return x + a + b

    jfn = fulmen.jit(fn)
    seen = set()
    for seed in range(6):
        x = torch.ones(16)
        torch.manual_seed(seed)
        seen.add((bool(torch.rand(16).sum() > 8), bool(torch.rand(16).sum() > 8)))
        torch.manual_seed(seed)
        expected = fn(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(jfn(x), expected)
    stats = fulmen.compile_stats(jfn)
    assert stats.eager_calls == 0 and stats.branches == len(seen)


def test_a_new_branch_reading_more_of_the_first_segment_matches_eager():
    def fn(x):
        y = x * 2
        z = x + 1  # read only on the second path
        if x.sum() > 0:
            return y
        return y * z

    jfn = fulmen.jit(fn)
    for sign in (1, -1, 1, -1):
        x = torch.randn(5).abs() * sign
        torch.testing.assert_close(jfn(x), fn(x))
    stats = fulmen.compile_stats(jfn)
    assert stats.eager_calls == 0 and stats.branches == 2
