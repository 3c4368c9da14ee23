"""`Tensor._base` read while tracing answers as eager (`factory_mode.ViewBaseRead`): the trace's
torch-function mode answered None for every tensor, so `v._base.sum()` of a closed-over view
crashed where eager runs, and `v._base is None` took the other branch, silently."""

import warnings

import torch

import fulmen


def test_the_base_of_a_closed_over_view_is_its_real_base():
    base = torch.arange(6.0)
    view = base[1:]

    def total(x):
        return x + view._base.sum()

    def flag(x):
        return x + (0 if view._base is None else 1)

    x = torch.ones(3)
    jitted_total, jitted_flag = fulmen.jit(total), fulmen.jit(flag)
    for step in range(3):
        if step == 1:
            base.add_(1)  # (read at each call: the captured base itself)
        if step == 2:
            view = torch.arange(10.0)[5:]  # another base, the same metadata
        assert torch.equal(jitted_total(x), total(x))
        assert torch.equal(jitted_flag(x), flag(x))
    view = torch.arange(5.0)  # no view: no base
    assert torch.equal(jitted_flag(x), flag(x))
    for jitted in (jitted_total, jitted_flag):
        assert fulmen.compile_stats(jitted).eager_calls == 0


def test_the_base_of_a_traced_tensor_runs_the_call_eagerly():
    def answers(x):
        return x[1:]._base is None, x.view(3)._base is x

    def total(x, view):
        return x + view._base.sum()

    x, base = torch.ones(3), torch.arange(6.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jitted_answers, jitted_total = fulmen.jit(answers), fulmen.jit(total)
        assert jitted_answers(x) == answers(x) == (False, True)
        assert torch.equal(jitted_total(x, base[1:]), total(x, base[1:]))
    for jitted in (jitted_answers, jitted_total):
        assert fulmen.compile_stats(jitted).eager_calls == 1
