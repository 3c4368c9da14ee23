"""Integers inside an object a jitted function closes over (a step counter the caller advances
between calls) are keyed once, by the function's own objects (`CacheKeyBuilder._fn_roots_key`,
traced as symbols once they change), not also by value among the closure's sources: there
every new value missed the symbolic entry, so each call compiled (8 entries, then eagerly)."""

import torch

import fulmen


class _State:
    def __init__(self):
        self.step = 0
        self.scale = 2


def _closing_over(state, body):
    def f(x):
        return body(x, state)

    return f


def _run(body, steps: int = 10):
    state = _State()
    f = _closing_over(state, body)
    jitted = fulmen.jit(f)
    for step in range(steps):
        state.step = step
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), f(x))
    return fulmen.compile_stats(jitted)


def test_a_counter_in_a_closed_over_object_compiles_a_symbolic_entry():
    stats = _run(lambda x, s: x * s.step + s.scale)
    assert stats.eager_calls == 0 and stats.cache_misses <= 3


def test_a_branch_on_a_closed_over_counter_follows_each_value():
    """The counter decides a branch: each side compiles, and every call takes eager's side."""
    stats = _run(lambda x, s: x * 2 if s.step > 4 else x - s.step)
    assert stats.eager_calls == 0
