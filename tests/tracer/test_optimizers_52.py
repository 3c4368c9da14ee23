"""`fulmen.jit(opt.step)` against eager across torch.optim (issue 18: a jitted optimizer step
once gave silently wrong answers), and the optimizers' fused and multi-tensor ATen ops run in
place on the mutated inputs (`executors/torch/inplace_lists.py`)."""

import pytest
import torch

import fulmen

optim = torch.optim

# name -> (optimizer over a list of parameters, most compilations over the steps: empty state,
# state, a step without one gradient; None: the optimizer decides on its step count in Python,
# a graph break per step, not counted)
CASES = {
    "sgd_nesterov": (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                      weight_decay=0.01), 3),
    "sgd_dampening_maximize": (lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2,
                                                maximize=True, foreach=True), 3),
    "adam_amsgrad_maximize": (lambda ps: optim.Adam(ps, lr=0.01, amsgrad=True, maximize=True,
                                                weight_decay=0.1, foreach=True), 3),
    "adamw_fused": (lambda ps: optim.AdamW(ps, lr=0.01, amsgrad=True, fused=True), 3),
    "nadam_decoupled": (lambda ps: optim.NAdam(ps, lr=0.01, decoupled_weight_decay=True,
                                           weight_decay=0.1, momentum_decay=0.01), 3),
    "radam_foreach": (lambda ps: optim.RAdam(ps, lr=0.01, foreach=True), None),
    "adamax": (lambda ps: optim.Adamax(ps, lr=0.01, foreach=True), 3),
    "adagrad_fused": (lambda ps: optim.Adagrad(ps, lr=0.1, lr_decay=0.1, fused=True), 3),
    "adadelta": (lambda ps: optim.Adadelta(ps, lr=1.0, weight_decay=0.01, foreach=True), 3),
    "rmsprop_centered": (lambda ps: optim.RMSprop(ps, lr=0.01, centered=True, momentum=0.9,
                                              foreach=True), 3),
    "rprop": (lambda ps: optim.Rprop(ps, lr=0.01), 3),
    "asgd": (lambda ps: optim.ASGD(ps, lr=0.01, t0=2, foreach=True), None),
}


def _train(make_opt, jit: bool, steps: int = 4):
    """A tiny model whose third parameter gets no gradient at the second step, under a StepLR
    schedule; the parameters and `opt.state_dict()` after `steps` steps."""
    torch.manual_seed(0)
    w, b, v = (torch.randn(*shape, requires_grad=True) for shape in ((3, 4), (4,), (4,)))
    opt = make_opt([w, b, v])
    sched = optim.lr_scheduler.StepLR(opt, 2, 0.5)
    step = fulmen.jit(opt.step) if jit else opt.step
    for i in range(steps):
        h = (torch.randn(5, 3) * (1 + i) @ w + b).tanh()
        (h.square().sum() + (0 if i == 1 else (h * v).sum())).backward()
        step()
        opt.zero_grad(set_to_none=i % 2 == 0)
        sched.step()
    return [w.detach(), b.detach(), v.detach()], opt.state_dict(), step


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_jitted_optimizer_step_equals_eager(name):
    """Parameters, state tensors (with the `step` counters' dtype and device) and the param
    groups equal eager's, within rounding (codegen's fused regions may round once less)."""
    make_opt, most = CASES[name]
    got, got_state, step = _train(make_opt, True)
    want, want_state, _ = _train(make_opt, False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_state["param_groups"] == want_state["param_groups"]
    assert got_state["state"].keys() == want_state["state"].keys()
    for index, per_param in want_state["state"].items():
        assert got_state["state"][index].keys() == per_param.keys()
        for key, value in per_param.items():
            torch.testing.assert_close(got_state["state"][index][key], value, rtol=1e-5,
                                       atol=1e-6)  # (also dtype and device)
    stats = fulmen.compile_stats(step)
    assert stats.calls == 4 and stats.eager_calls == 0
    assert most is None or stats.cache_misses <= most


def _written_back(jfn) -> list[str]:
    """The inputs the last trace of `jfn` writes back with `copy_`."""
    return [bsym.args[0].name for bsym in fulmen.last_traces(jfn)[-1].bsyms
            if bsym.sym.name == "copy_"]


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_the_fused_and_foreach_ops_of_a_step_run_in_place(kind, monkeypatch):
    """A fused AdamW step ran `aten._fused_adamw` (a new copy of every parameter, gradient and
    moment) and copied each back: 7x eager's time at 4M parameters. Now the very in-place op
    eager runs, bit for bit eager's results, no write-back left."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")  # (bit for bit: tiny regions stay on torch)

    def run(jit):
        torch.manual_seed(0)
        params = [torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)]
        opt = optim.AdamW(params, lr=0.01, **{kind: True})
        step = fulmen.jit(opt.step) if jit else opt.step
        for i in range(3):
            for p in params:
                p.grad = torch.randn_like(p) * (i + 1)
            step()
        return params + [t for s in opt.state.values() for t in s.values()], step

    got, step = run(True)
    want, _ = run(False)
    assert len(got) == len(want) == 8
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    written = _written_back(step)
    if kind == "fused":
        assert written == []  # (params, grads, moments and steps: all in place)
    else:  # the first of two in-place ops on one input keeps its functional form
        assert len(written) < 8, written


def test_an_input_read_after_an_in_place_list_op_is_written_back():
    """The fused region reads `x` after `_foreach_add_` has written it: the op stays functional
    (in place, the region would read the new `x` for `a`)."""
    def fn(x, y):
        a = x * 2
        torch._foreach_add_([x], [y])
        return a + x * 5

    jfn = fulmen.jit(fn)
    x, y = torch.randn(8), torch.randn(8)
    x_jit, x_eager = x.clone(), x.clone()
    assert torch.equal(jfn(x_jit, y), fn(x_eager, y))
    assert torch.equal(x_jit, x_eager)
    assert _written_back(jfn) == ["x"]


_OPTIMIZER = None  # the optimizer `_train_step` reads as a global


def _train_step():
    _OPTIMIZER.step()


@pytest.mark.parametrize("make_opt", [lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
                                      lambda ps: optim.Adam(ps, lr=0.1)], ids=["sgd", "adam"])
def test_a_jitted_function_reading_its_optimizer_as_a_global(make_opt):
    """A module-level `def train_step(): opt.step()`: the optimizer was no object of the
    function's (only closure cells and a bound method's `self` were), so the first step's new
    state stayed a TensorProxy in `opt.state`, and later steps reused the empty-state program
    (momentum lost, silently)."""
    global _OPTIMIZER
    results = []
    for jit in (True, False):
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        _OPTIMIZER = make_opt([w])
        step = fulmen.jit(_train_step) if jit else _train_step
        for i in range(4):
            w.grad = torch.full((3,), float(i + 1))
            step()
            assert all(type(value) is torch.Tensor for value in _OPTIMIZER.state[w].values())
        results.append(w.detach())
        if jit:
            stats = fulmen.compile_stats(step)
    assert torch.equal(*results)
    assert stats.calls == 4 and stats.eager_calls == 0
