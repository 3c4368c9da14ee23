"""Floats that change between calls (an LR scheduler's learning rate, Adam's step count read
with `.item()`) are read at run time, not compiled once per value (NOTE [floats read at run
time] in `fulmen.ops.host_float`); results stay eager's bit for bit."""

import warnings

import pytest
import torch

import fulmen

SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 3, 0.5),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 20),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (1 + i)),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=25,
                                                                cycle_momentum=False),
}
OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def _train(make_opt, make_sched, jit: bool, steps: int = 20):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = make_opt(model.parameters())
    sched = make_sched(opt)
    step = fulmen.jit(opt.step) if jit else opt.step
    x = torch.randn(7, 6)
    for _ in range(steps):
        model(x).square().sum().backward()
        step()
        opt.zero_grad()
        sched.step()
    state = [t for per_param in opt.state.values() for t in per_param.values()
             if isinstance(t, torch.Tensor)]
    return [p.detach() for p in model.parameters()] + state, step


@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_jitted_optimizer_step_under_a_scheduler_compiles_twice(optimizer, sched, monkeypatch):
    """Parameters and optimizer state equal eager's bit for bit over 20 steps (with tiny
    regions left on torch, as by default: codegen's fused `lerp`/`addcmul` round otherwise)."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cache_size_limit warning: no eager fallback
        got, step = _train(OPTIMIZERS[optimizer], SCHEDULERS[sched], True)
    ref, _ = _train(OPTIMIZERS[optimizer], SCHEDULERS[sched], False)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    stats = fulmen.compile_stats(step)
    # the first step creates the optimizer's state (a call of another structure), the second
    # compiles for the state; the learning rate is read at run time from the first call
    # (before, every new rate compiled, and after 8 ran eagerly)
    assert stats.cache_misses <= 2 and stats.eager_calls == 0


def test_a_float_argument_that_changes_is_read_at_run_time():
    def scale(x, factor):
        return x * (factor / 3) + factor ** 0.5

    jfn = fulmen.jit(scale)
    x = torch.randn(4)
    for factor in (0.5, 0.7, 1.3, 2.9, 0.1):
        assert torch.equal(jfn(x, factor), scale(x, factor))
    assert fulmen.compile_stats(jfn).cache_misses == 2


def test_a_decision_on_a_changing_float_keeps_it_a_constant():
    """`if factor > 1` needs the value: the float is traced as a constant again (keyed by its
    value), and every call still equals eager."""
    def branchy(x, factor):
        return x * factor if factor > 1 else x - factor

    jfn = fulmen.jit(branchy)
    x = torch.randn(4)
    for factor in (0.5, 0.7, 1.3, 0.5, 1.3):
        assert torch.equal(jfn(x, factor), branchy(x, factor))


def test_a_changing_float_stored_into_an_object_is_not_replayed_stale():
    class Holder:
        def __init__(self):
            self.lr = 0.1
            self.seen = 0.0

    def record(x, h):
        h.seen = h.lr * 2
        return x * h.lr

    jfn = fulmen.jit(record)
    h, ref = Holder(), Holder()
    x = torch.randn(3)
    for lr in (0.1, 0.2, 0.3, 0.4):
        h.lr = ref.lr = lr
        assert torch.equal(jfn(x, h), record(x, ref))
        assert h.seen == ref.seen


def test_math_on_a_changing_float_is_read_at_run_time():
    import math

    def fn(x, t):
        return x * math.sqrt(t) + math.exp(-t)

    jfn = fulmen.jit(fn)
    x = torch.randn(5)
    for t in (0.5, 1.5, 2.5, 3.5):
        assert torch.equal(jfn(x, t), fn(x, t))
    assert fulmen.compile_stats(jfn).cache_misses == 2


def test_one_cycle_momentum_reads_adams_betas_at_run_time(monkeypatch):
    """OneCycleLR (cycle_momentum, its default) changes Adam's `betas[0]`, a float inside a
    tuple, at every step too: the tuple is rebuilt around the float read at run time."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")
    make_sched = lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=25)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, step = _train(OPTIMIZERS["adam"], make_sched, True)
    ref, _ = _train(OPTIMIZERS["adam"], make_sched, False)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    stats = fulmen.compile_stats(step)
    assert stats.cache_misses <= 2 and stats.eager_calls == 0


def test_a_changing_float_in_a_nested_tuple_is_keyed_by_its_value():
    """A float inside a tuple inside a tuple is not rebuilt for tracing: it stays a constant,
    and no call may reuse a program compiled for another value (a wrong cache hit when the
    key left the value out)."""
    class Holder:
        def __init__(self, value):
            self.pairs = ((value, 2.0), (3.0, 4.0))

    def fn(x, h):
        return x * h.pairs[0][0]

    jfn = fulmen.jit(fn)
    x = torch.randn(3)
    for value in (0.5, 1.5, 2.5, 3.5):
        assert torch.equal(jfn(x, Holder(value)), x * value)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_under_a_constant_learning_rate_reads_its_step_count_at_run_time(optimizer,
                                                                              monkeypatch):
    """`state["step"].item()` gave a new graph-break answer at every step (8 paths, then
    eagerly); after the first new float answer items are read at run time."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")
    constant = lambda opt: torch.optim.lr_scheduler.ConstantLR(opt, 1.0, total_iters=0)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, step = _train(OPTIMIZERS[optimizer], constant, True)
    ref, _ = _train(OPTIMIZERS[optimizer], constant, False)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    stats = fulmen.compile_stats(step)
    assert stats.cache_misses <= 2 and stats.eager_calls == 0


def test_a_step_function_given_the_optimizer_compiles_twice(monkeypatch):
    """`fulmen.jit(step)(opt)` with `opt.step(); opt.zero_grad()` inside, under a scheduler."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")

    def step(opt):
        opt.step()
        opt.zero_grad()

    results = []
    for jit in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
        call = fulmen.jit(step) if jit else step
        for _ in range(10):
            model(torch.ones(2, 4)).square().sum().backward()
            call(opt)
            sched.step()
        results.append([p.detach() for p in model.parameters()])
        if jit:
            stats = fulmen.compile_stats(call)
            assert stats.cache_misses <= 2 and stats.eager_calls == 0
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_an_item_that_decides_a_branch_stays_a_graph_break():
    """With items read at run time, `if t.item() > 2` needs the value: traced again with
    graph breaks, and every call equals eager."""
    def fn(x, counter):
        counter += 1
        scale = counter.item()
        y = x * scale
        return (y + 1 if counter.item() > 4 else y - 1), counter

    jfn = fulmen.jit(fn)
    x = torch.randn(3)
    counter, ref_counter = torch.tensor(0.0), torch.tensor(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(8):
            out, _ = jfn(x, counter)
            ref, _ = fn(x, ref_counter)
            assert torch.equal(out, ref) and torch.equal(counter, ref_counter)


def test_a_changing_float_read_past_pythons_protocols_is_never_a_stale_constant():
    """`from math import sqrt` bound before tracing reads the number as a C double: the
    trace sees NaN and is made again with the float constant, so every call equals eager."""
    from math import sqrt

    def fn(x, t):
        return x * sqrt(t) + torch.arange(0, t * 10).sum()

    jfn = fulmen.jit(fn)
    x = torch.randn(5)
    for t in (0.5, 1.5, 2.5, 3.5):
        assert torch.equal(jfn(x, t), fn(x, t))


def _arange(start, end, step):
    return torch.arange(start, end, step, dtype=torch.float32)


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_new_branch_of_a_graph_break_reads_the_floats_at_run_time_too(dynamic):
    """`arange` of floats read at run time has a length PyTorch knows only from the values: a
    graph break guards it. A length not seen before is a new path of the trace tree, traced
    with the floats read at run time as the entry's first path was: traced with this call's
    values as constants, it served a later call of the same length its values ([0, -4] for
    arange(1, 5, 2))."""
    jfn = fulmen.jit(_arange, dynamic=dynamic)
    for args in ((0.0, -8.000001, -4.0), (1.0, 5.000001, 2.0), (0.0, -8.0, -4.0),
                 (1.0, 5.0, 2.0), (0.5, 3.0, 0.5)):
        torch.testing.assert_close(jfn(*args), _arange(*args), rtol=0, atol=0)


def test_every_python_operator_on_a_changing_float_is_eagers_on_both_sides():
    """Each binary operator on a float read at run time, with it on the left and on the
    right (the reflected methods), and the unary ones: bit for bit eager's at every value."""
    def fn(x, f):
        return (x * (f + 0.3), x * (0.3 + f), x * (f - 0.3), x * (0.3 - f), x * (f * 3.0),
                x * (3.0 * f), x * (f / 0.7), x * (0.7 / f), x * (f // 0.3), x * (2.9 // f),
                x * (f % 0.4), x * (2.9 % f), x * (f ** 1.5), x * (1.5 ** f), x * -f, x * +f,
                x * abs(-f))

    jfn = fulmen.jit(fn)
    x = torch.randn(3)
    for f in (0.45, 1.3, 2.2, 0.8):
        for got, want in zip(jfn(x, f), fn(x, f), strict=True):
            assert torch.equal(got, want)
    assert fulmen.compile_stats(jfn).cache_misses == 2
