"""`fulmen.jit(opt.step)`: the key of the optimizer (the jitted function's own object) is reused
while nothing it was computed from changed (`tracer/object_key_memo.py`), and every change the
full walk would see still misses: a param group value, a parameter list, a state tensor
replaced or changed in place, a `.grad` gone. Each case runs the same steps eagerly beside and
compares parameters and state."""

import functools

import pytest
import torch

import fulmen
from fulmen.tracer import object_key_memo


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


def _backward(model):
    torch.manual_seed(1)
    model(torch.randn(4, 6)).square().sum().backward()


def _restride(t):
    """`t`'s values in a tensor with other strides (a transposed copy, transposed back)."""
    return t.t().contiguous().t() if t.dim() == 2 else t.clone()


def _set_strides_in_place(opt):
    for state in opt.state.values():
        if state["exp_avg"].dim() == 2:
            state["exp_avg"].set_(_restride(state["exp_avg"]))


def _replace_state(opt):
    for state in opt.state.values():
        state["exp_avg_sq"] = _restride(state["exp_avg_sq"])


def _drop_param(opt):
    opt.param_groups[0]["params"].pop()


def _drop_grad(opt):
    opt.param_groups[0]["params"][0].grad = None


def _weight_decay(opt):
    opt.param_groups[0]["weight_decay"] = 0.5


def _maximize(opt):
    opt.param_groups[0]["maximize"] = True


def _lr(opt):
    opt.param_groups[0]["lr"] = 3e-2


def _run(change, jit: bool):
    model, opt = _setup()
    step = fulmen.jit(opt.step) if jit else opt.step
    for i in range(5):
        _backward(model)
        if i == 3:
            change(opt)
        step()
        if i != 3 or change is not _drop_grad:
            opt.zero_grad()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [p.detach() for p in model.parameters()] + state, step


# change -> whether the key must miss (a float read at run time, the lr, is keyed by type)
_CASES = {_weight_decay: True, _maximize: True, _drop_param: True, _drop_grad: True,
          _replace_state: True, _set_strides_in_place: True, _lr: False}


@pytest.mark.parametrize("change", list(_CASES), ids=lambda f: f.__name__.strip("_"))
def test_change_misses_and_matches_eager(change):
    want, _ = _run(change, False)
    got, step = _run(change, True)
    assert len(got) == len(want) > 4
    for a, b in zip(got, want):
        # (close, not equal: under pytest even unchanged steps differ from eager by an ulp)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    stats = fulmen.compile_stats(step)
    assert stats.calls == 5 and stats.eager_calls == 0
    assert (stats.cache_misses > _unchanged_misses()) == _CASES[change]


@functools.cache
def _unchanged_misses() -> int:
    stats = fulmen.compile_stats(_run(lambda opt: None, True)[1])
    assert stats.eager_calls == 0
    return stats.cache_misses


@pytest.mark.parametrize("scheduler", [False, True])
def test_unchanged_optimizer_is_not_walked(monkeypatch, scheduler):
    """Steps that change only tensor values, grads and the lr reuse the key (no walk), under
    an LR scheduler too (it wraps `opt.step` in a function the optimizer holds)."""
    walks = []
    real = object_key_memo.walk
    monkeypatch.setattr(object_key_memo, "walk", lambda root: walks.append(root) or real(root))
    model, opt = _setup()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10) if scheduler else None
    step = fulmen.jit(opt.step)
    for i in range(6):
        _backward(model)
        if i == 4:
            _lr(opt)
        step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if i == 2:
            walks.clear()
    assert fulmen.compile_stats(step).eager_calls == 0
    assert walks == []


@pytest.mark.parametrize("jit", [False, True])
def test_write_back_into_a_parameter_is_seen_by_autograd(jit):
    """The write-back into a parameter (`executors/torch._write_back`, through `detach()`)
    updates the parameter itself and its version counter: a graph that saved the parameter
    before the step refuses its backward, as in eager."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = fulmen.jit(opt.step) if jit else opt.step
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(3):
        model(x).square().sum().backward()
        weight, version = model.weight.detach().clone(), model.weight._version
        pending = (x @ model.weight.t()).sum()  # saves the weight
        step()
        assert model.weight._version > version
        assert not torch.equal(model.weight.detach(), weight)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            pending.backward()
        opt.zero_grad()
    if jit:
        assert fulmen.compile_stats(step).eager_calls == 0
