"""Modules a jitted function reaches besides a jitted module (`step(model, batch)`: an argument,
a global, a closure cell) behave as in eager: their `training` flags and attributes are keyed,
the stores their forwards make are put back or replayed, and a failed trace leaves them as they
were (`fulmen.tracer.module_stores.held_modules`)."""

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fulmen
from tests.tracer.test_module_behaviour import _Tempered


class Counter(torch.nn.Module):
    """A forward that counts its calls in a Python attribute and a buffer."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.calls = 0
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        self.seen += 1
        return self.linear(x) * self.calls + self.seen


def _forward(model, x):
    return model(x)


def test_an_argument_module_switched_to_eval_is_not_served_by_its_training_trace():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    jitted = fulmen.jit(_forward)
    x = torch.ones(3, 4)
    jitted(model, x)
    model.eval()
    torch.testing.assert_close(jitted(model, x), model(x))
    model.train()
    torch.manual_seed(0)
    expected = model(x)
    torch.manual_seed(0)
    torch.testing.assert_close(jitted(model, x), expected)


def test_an_attribute_of_an_argument_module_changed_between_calls_is_read_again():
    model, x = _Tempered(), torch.randn(2, 3)
    jitted = fulmen.jit(_forward)
    for temperature in (1.0, 0.5, 2.0, 0.5):
        model.temperature = temperature
        torch.testing.assert_close(jitted(model, x), model(x))


def test_a_global_module_switched_to_eval_and_its_dropout_rate_changed():
    global _GLOBAL_DROPOUT
    _GLOBAL_DROPOUT = torch.nn.Dropout(0.5)

    def apply(x):
        return _GLOBAL_DROPOUT(x) * 2

    jitted, x = fulmen.jit(apply), torch.ones(4, 4)
    jitted(x)
    _GLOBAL_DROPOUT.p = 0.0
    torch.testing.assert_close(jitted(x), x * 2)
    _GLOBAL_DROPOUT.p = 0.5
    _GLOBAL_DROPOUT.eval()
    torch.testing.assert_close(jitted(x), x * 2)


def test_counters_an_argument_module_keeps_advance_as_in_eager():
    model = Counter()
    twin = copy.deepcopy(model)
    jitted, x = fulmen.jit(_forward), torch.randn(2, 3)
    for _ in range(3):
        torch.testing.assert_close(jitted(twin, x), model(x))
    assert twin.calls == model.calls == 3
    assert type(twin.seen) is torch.Tensor and twin.seen.item() == 3  # no proxy left behind
    for mine, theirs in zip(twin.state_dict().values(), model.state_dict().values()):
        assert type(mine) is torch.Tensor
        torch.testing.assert_close(mine, theirs)
    twin(x)  # still usable eagerly


def test_a_tensor_stored_on_an_argument_module_runs_the_call_eagerly():
    class Keeps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 3)

        def forward(self, x):
            y = self.linear(x)
            self.last = y.sum()
            return y

    model = Keeps()
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(_forward)
    with pytest.warns(UserWarning, match="'last'"):
        for _ in range(2):
            x = torch.randn(2, 3)
            torch.testing.assert_close(jitted(twin, x), model(x))
            assert type(twin.last) is torch.Tensor
            torch.testing.assert_close(twin.last, model.last)


def test_a_failed_trace_leaves_an_argument_module_as_it_was():
    model = Counter()

    def step(model, x):
        y = model(x)
        x.resize_(6)  # not compiled: fulmen raises
        return y

    with pytest.raises(fulmen.NotYetSupportedError):
        fulmen.jit(step, fullgraph=True)(model, torch.randn(2, 3))
    assert model.calls == 0 and type(model.seen) is torch.Tensor and model.seen.item() == 0
    model(torch.randn(2, 3))
    assert model.calls == 1 and model.seen.item() == 1


def test_a_training_step_with_backward_inside_and_a_counting_module():
    model = Counter()
    twin = copy.deepcopy(model)

    def step(model, x):
        loss = model(x).square().mean()
        loss.backward()
        return loss

    jitted = fulmen.jit(step)
    with pytest.warns(UserWarning, match="inside a compiled function"):
        for _ in range(2):
            x = torch.randn(4, 3)
            torch.testing.assert_close(jitted(twin, x), step(model, x))
    assert twin.calls == model.calls == 2 and twin.seen.item() == 2
    torch.testing.assert_close(twin.linear.weight.grad, model.linear.weight.grad)


def test_gradients_of_an_argument_modules_parameters_are_read_on_every_call():
    """`grad_norm(model)` after each backward: the gradients `zero_grad()` and the next backward
    replace are no constants of the trace (the first step's gradient was read on every call).
    They are read afresh on every compiled call (NOTE [flags of closed-over tensors])."""
    model = torch.nn.Linear(3, 2)

    def grad_norm(model):
        return torch.stack([p.grad.norm() for p in model.parameters()]).sum()

    jitted, x = fulmen.jit(grad_norm), torch.randn(4, 3)
    for step in range(3):
        model.zero_grad()
        (model(x) * (step + 1)).sum().backward()
        torch.testing.assert_close(jitted(model), grad_norm(model))
    stats = fulmen.compile_stats(jitted)
    assert (stats.eager_calls, stats.cache_misses) == (0, 1)


def test_an_ema_update_under_no_grad_compiles_and_equals_eager():
    """`torch._foreach_lerp_` of an EMA copy's parameters (which require grad) under no_grad:
    eager's way to update parameters compiles (nothing in the trace computes with grad)."""
    model, ema = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    twin = copy.deepcopy(ema)

    def update(ema, model, decay):
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)

    jitted = fulmen.jit(update)
    for decay in (0.9, 0.9, 0.99):
        update(ema, model, decay)
        jitted(twin, model, decay)
        with torch.no_grad():
            model.weight.add_(0.1)
    for mine, theirs in zip(twin.parameters(), ema.parameters()):
        torch.testing.assert_close(mine, theirs)
        assert mine.requires_grad and mine.grad_fn is None
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_a_no_grad_update_beside_a_forward_with_grad_runs_eagerly():
    """Updating a parameter under no_grad, then computing a loss from it with grad: the
    gradient reaches the updated leaf as in eager (the trace would differentiate the old one)."""
    model = torch.nn.Linear(3, 1)
    twin = copy.deepcopy(model)

    def shrink_then_loss(model, x):
        with torch.no_grad():
            model.weight.mul_(0.5)
        return model(x).square().sum()

    jitted, x = fulmen.jit(shrink_then_loss), torch.randn(4, 3)
    with pytest.warns(UserWarning, match="under torch.no_grad"):
        for _ in range(2):
            jitted(twin, x).backward()
            shrink_then_loss(model, x).backward()
    torch.testing.assert_close(twin.weight, model.weight)
    torch.testing.assert_close(twin.weight.grad, model.weight.grad)


def test_a_no_grad_update_after_a_forward_with_grad_raises_at_backward_as_eager():
    """The forward saves the weight for the input's gradient, then the code shrinks it under
    no_grad: eager's backward finds the saved weight modified and raises; the trace would
    differentiate the old weight silently, so the call runs eagerly and raises the same."""
    model = torch.nn.Linear(3, 3)

    def loss_then_shrink(x):
        loss = model(x).sum()
        with torch.no_grad():
            model.weight.mul_(0.5)
        return loss

    for fn in (loss_then_shrink, fulmen.jit(loss_then_shrink)):
        x = torch.randn(2, 3, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = fn(x)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("read", ["whole", "view"])
def test_a_parameter_set_under_no_grad_then_read_with_grad_keeps_its_gradient(read):
    """The updated parameter is the only tensor requiring grad: the trace's update value
    carried no grad, so the result came back without a grad_fn (a dropped gradient)."""

    def load_then_scale(p, w):
        with torch.no_grad():
            p.copy_(w)
        return (p if read == "whole" else p[1:]) * 2

    p, twin, w = (torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3)),
                  torch.arange(3.0))
    jitted = fulmen.jit(load_then_scale)
    with pytest.warns(UserWarning, match="under torch.no_grad"):
        got = jitted(twin, w)
    want = load_then_scale(p, w)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(twin.grad, p.grad)
    torch.testing.assert_close(twin, p)


def test_hooks_and_submodules_of_an_argument_module_changed_between_calls():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    jitted, x = fulmen.jit(_forward), torch.randn(2, 3)
    torch.testing.assert_close(jitted(model, x), model(x))
    handle = model[0].register_forward_hook(lambda module, args, out: out * 10)
    torch.testing.assert_close(jitted(model, x), model(x))
    handle.remove()
    torch.testing.assert_close(jitted(model, x), model(x))
    model[1] = torch.nn.Tanh()
    torch.testing.assert_close(jitted(model, x), model(x))
    model[0].weight = torch.nn.Parameter(torch.randn(3, 3))
    torch.testing.assert_close(jitted(model, x), model(x))


def test_a_parameter_of_an_argument_module_set_to_none_between_calls():
    model = torch.nn.Linear(4, 4)
    jitted, x = fulmen.jit(_forward), torch.randn(3, 4)
    torch.testing.assert_close(jitted(model, x), model(x))
    model.bias = None
    torch.testing.assert_close(jitted(model, x), model(x))


def test_a_global_modules_submodule_replaced_between_calls():
    global _GLOBAL_NET
    _GLOBAL_NET = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())

    def apply(x):
        return _GLOBAL_NET(x) + 1

    jitted, x = fulmen.jit(apply), torch.randn(2, 3)
    torch.testing.assert_close(jitted(x), apply(x))
    _GLOBAL_NET[1] = torch.nn.Sigmoid()
    torch.testing.assert_close(jitted(x), apply(x))


def test_backward_hooks_on_an_argument_module_fire_as_in_eager():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    seen = []
    model[0].register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(1))
    jitted, x = fulmen.jit(_forward), torch.randn(2, 3)
    with pytest.warns(UserWarning, match="backward hooks"):
        jitted(model, x).sum().backward()
    assert seen == [1]


class _Changing(torch.nn.Module):
    """A module whose state callers change between calls in every way a jitted function must
    notice when the module is its argument."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.act = torch.nn.ReLU()
        self.drop = torch.nn.Dropout(0.5)
        self.scale = 1.0
        self.steps = 0

    def forward(self, x):
        self.steps += 1
        return self.drop(self.act(self.linear(x))) * self.scale + self.steps


def _change(model, action, handles):
    if action == "eval":
        model.eval()
    elif action == "train":
        model.train()
    elif action == "scale":
        model.scale += 0.5
    elif action == "hook":
        handles.append(model.linear.register_forward_hook(lambda m, args, out: out * 2))
    elif action == "unhook" and handles:
        handles.pop().remove()
    elif action == "swap":
        model.act = torch.nn.Tanh() if isinstance(model.act, torch.nn.ReLU) else torch.nn.ReLU()
    elif action == "update":
        with torch.no_grad():
            model.linear.weight.mul_(0.9)
    elif action == "replace":
        model.linear.bias = torch.nn.Parameter(torch.full((4,), 0.25))
    elif action == "no_bias":  # calls no registration hook
        model.linear.bias = None


_ACTIONS = ["eval", "train", "scale", "hook", "unhook", "swap", "update", "replace", "no_bias",
            "none"]


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from(_ACTIONS), min_size=1, max_size=6))
def test_any_change_between_calls_to_an_argument_module_is_seen(actions):
    model = _Changing()
    twin = copy.deepcopy(model)
    jitted, x = fulmen.jit(_forward), torch.randn(3, 4)
    handles, twin_handles = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # past the cache size limit calls run eagerly
        for action in ["none", *actions]:
            _change(model, action, handles)
            _change(twin, action, twin_handles)
            torch.manual_seed(0)
            expected = model(x)
            torch.manual_seed(0)
            torch.testing.assert_close(jitted(twin, x), expected, msg=f"after {action}")
    assert twin.steps == model.steps


class _CountsPositives(torch.nn.Module):
    """A value-dependent branch (a graph break) that stores on the module."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.positives = 0
        self.register_buffer("hits", torch.zeros(()))

    def forward(self, x):
        y = self.linear(x)
        if y.sum() > 0:
            self.positives += 1
            self.hits += 1
        return y * (self.positives + 1)


def test_an_argument_module_storing_behind_a_graph_break():
    # crashed (a proxy left in the module's buffers); the paths that store run eagerly
    model = _CountsPositives()
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(_forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(6):
            x = torch.randn(2, 3) * (1 if step % 2 else -1)
            torch.testing.assert_close(jitted(twin, x), model(x))
    assert twin.positives == model.positives and torch.equal(twin.hits, model.hits)


def _optimizer_step(optimizer, scheduler):
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


@pytest.mark.parametrize("zero_grad", [True, False])
def test_an_optimizer_and_scheduler_step_with_zero_grad_compiles(zero_grad):
    """`optimizer.step(); optimizer.zero_grad(); scheduler.step()` in one jitted function: the
    `p.grad = None` stores are replayed on the parameters after each call, and the parameters'
    write-backs (a trace tree: the scheduler reads numbers) run outside autograd; was an error
    ('a tensor that requires grad is modified in place', then a RuntimeError from the tree)."""
    model = torch.nn.Linear(3, 2)
    twin = copy.deepcopy(model)

    def make(params):
        optimizer = torch.optim.AdamW(params, lr=0.01)
        return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10)

    optimizer, scheduler = make(model.parameters())
    twin_optimizer, twin_scheduler = make(twin.parameters())
    step = _optimizer_step if zero_grad else lambda o, s: (o.step(), s.step())
    jitted = fulmen.jit(step)
    for _ in range(3):
        x = torch.randn(4, 3)
        model(x).square().sum().backward()
        twin(x).square().sum().backward()
        step(optimizer, scheduler)
        jitted(twin_optimizer, twin_scheduler)
        if not zero_grad:
            optimizer.zero_grad()
            twin_optimizer.zero_grad()
        for mine, theirs in zip(twin.parameters(), model.parameters()):
            torch.testing.assert_close(mine, theirs)
            assert mine.grad is None and mine.requires_grad
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_a_buffer_an_argument_module_replaces_is_stored_as_in_eager():
    """`self.ema = self.ema * 0.9 + ...` stores a new tensor (not an in-place update): the call
    runs eagerly, so the module holds eager's buffer."""

    class Averages(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("ema", torch.zeros(3))

        def forward(self, x):
            self.ema = self.ema * 0.9 + x.mean(0)
            return x - self.ema

    model = Averages()
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(_forward)
    with pytest.warns(UserWarning, match="'ema'"):
        for _ in range(3):
            x = torch.randn(4, 3)
            torch.testing.assert_close(jitted(twin, x), model(x))
            torch.testing.assert_close(twin.ema, model.ema)
