"""Session 53's features meeting each other (issue 18): whole jitted training steps (backward in
the trace, optimizers, schedulers) reached through the containers users keep them in, compared
with eager over several steps."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fulmen


def _container_step(jit: bool, holder_kind: str, optimizer_kind: str):
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    if optimizer_kind == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    holder = {"list": [optimizer], "tuple": (optimizer,), "dict": {0: optimizer},
              "nested": [[optimizer]]}.get(holder_kind)

    def step():  # the first step makes the optimizer's state (momentum, exp_avg, step)
        held = holder[0][0] if holder_kind == "nested" else holder[0]
        held.step()
        held.zero_grad()

    def step_default(opt=optimizer):
        opt.step()
        opt.zero_grad()

    def step_partial(opt):
        opt.step()
        opt.zero_grad()

    fn = {"default": step_default, "partial": functools.partial(step_partial, optimizer)
          }.get(holder_kind, step)
    fn = fulmen.jit(fn) if jit else fn
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        F.mse_loss(model(torch.randn(5, 6, generator=generator)),
                   torch.randn(5, 4, generator=generator)).backward()
        fn()
    state = [value for per in optimizer.state.values() for value in per.values()]
    return [p.detach().clone() for p in model.parameters()] + state, fn


@pytest.mark.parametrize("holder_kind", ["list", "tuple", "dict", "nested", "default", "partial"])
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adamw"])
def test_an_optimizer_kept_in_a_closure_container_steps_as_eager(holder_kind, optimizer_kind):
    """`opts = [opt]` ... `opts[0].step()` in the jitted function: the optimizer was no object
    root (only objects held directly by a closure cell or a global were), so the state its first
    step made while tracing (proxies) stayed in the real `opt.state`; the call then ran eagerly
    (a closed-over `.grad`) on that state: FulmenError 'a TensorProxy was used outside tracing',
    and the optimizer was left broken. The same for one in a nested list, a default argument
    value or a `functools.partial`'s bound argument. Now those objects are roots: compiled,
    eager's values."""
    got, fn = _container_step(True, holder_kind, optimizer_kind)
    want, _ = _container_step(False, holder_kind, optimizer_kind)
    assert len(got) == len(want) >= 3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    stats = fulmen.compile_stats(fn)
    assert stats.calls == 3 and stats.eager_calls == 0


_MODEL = None  # rebound between calls, as a notebook rebinds its global model


def _rebound_global_loop(jit: bool):
    global _MODEL
    torch.manual_seed(0)
    models = [nn.Linear(6, 4), nn.Linear(6, 4)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]

    def step(x, y):
        loss = F.mse_loss(_MODEL(x), y)
        loss.backward()
        for optimizer in optimizers:  # the other model's parameters have no gradient
            optimizer.step()
            optimizer.zero_grad()
        return loss.detach()

    fn = fulmen.jit(step) if jit else step
    generator = torch.Generator().manual_seed(1)
    losses = []
    for call in range(5):
        _MODEL = models[call % 2]
        losses.append(fn(torch.randn(5, 6, generator=generator),
                         torch.randn(5, 4, generator=generator)))
    state = [value for o in optimizers for per in o.state.values() for value in per.values()]
    return losses + [p.detach().clone() for m in models for p in m.parameters()] + state, fn


def test_a_rebound_global_model_trains_with_optimizers_from_a_closure_list():
    """A global model rebound between calls (keyed by identity, h53probe) trained by a step
    with `loss.backward()` inside (backward in the trace) and two optimizers kept in a list
    (the other model's parameters without gradients): each model's step compiles and equals
    eager (losses, parameters, momentum buffers). A scenario guard, passing before this
    branch's change too."""
    got, fn = _rebound_global_loop(True)
    want, _ = _rebound_global_loop(False)
    assert len(got) == len(want) == 5 + 4 + 4
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    stats = fulmen.compile_stats(fn)
    assert stats.calls == 5 and stats.eager_calls == 0


class _SelfStepping(nn.Module):
    """A model keeping its optimizer, with its own training step."""

    def __init__(self, backward_inside: bool):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.opt = torch.optim.AdamW(self.lin.parameters(), lr=1e-2, weight_decay=0.1)
        self.backward_inside = backward_inside

    def train_step(self, x, y):
        if self.backward_inside:
            F.mse_loss(self.lin(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()
        return x.sum()


def _self_stepping_loop(jit: bool, backward_inside: bool):
    torch.manual_seed(0)
    net = _SelfStepping(backward_inside)
    fn = fulmen.jit(net.train_step) if jit else net.train_step
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 4, generator=generator)
        if not backward_inside:
            F.mse_loss(net.lin(x), y).backward()
        fn(x, y)
    state = [value for per in net.opt.state.values() for value in per.values()]
    lr = torch.tensor(net.opt.param_groups[0]["lr"])
    return [p.detach().clone() for p in net.lin.parameters()] + state + [lr], fn


@pytest.mark.parametrize("backward_inside", [False, True])
def test_a_modules_own_optimizer_steps_as_eager(backward_inside):
    """`jit(model.train_step)` stepping `self.opt` (a module attribute): the optimizer was no
    object root (the bound `self` is a module, not a plain object), so its first step's state,
    proxies, stayed in `self.opt.state`: with the backward outside, FulmenError 'a TensorProxy
    was used outside tracing' on the eager fallback; with it inside, every call ran eagerly.
    Now a module's optimizers and schedulers are roots: compiled, eager's values."""
    got, fn = _self_stepping_loop(True, backward_inside)
    want, _ = _self_stepping_loop(False, backward_inside)
    assert len(got) == len(want) == 2 + 6 + 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    stats = fulmen.compile_stats(fn)
    assert stats.calls == 4 and stats.eager_calls == 0


def _replaced_optimizer_loop(jit: bool):
    torch.manual_seed(0)
    net = _SelfStepping(True)
    fn = fulmen.jit(net.train_step) if jit else net.train_step
    generator = torch.Generator().manual_seed(2)
    for step in range(5):
        if step == 2:  # a new optimizer assigned to the module after compiling
            net.opt = torch.optim.SGD(net.lin.parameters(), lr=0.05, momentum=0.9)
        fn(torch.randn(5, 6, generator=generator), torch.randn(5, 4, generator=generator))
    buffers = [per["momentum_buffer"] for per in net.opt.state.values()]
    return [p.detach().clone() for p in net.lin.parameters()] + buffers, fn


def test_a_module_optimizer_replaced_after_compiling_is_the_one_stepped():
    """`net.opt = SGD(...)` between calls of `jit(net.train_step)`: the memo of the function's
    roots (`key_memo.RootsMemo`) asks the module for its optimizers again, so the new one is
    the root stepped (its momentum buffers real tensors equal to eager's), not the old one."""
    got, fn = _replaced_optimizer_loop(True)
    want, _ = _replaced_optimizer_loop(False)
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        assert type(a) is torch.Tensor
        torch.testing.assert_close(a, b)
    assert fulmen.compile_stats(fn).eager_calls == 0
