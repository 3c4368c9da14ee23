"""Calls users make in training loops, compared with eager over several steps: module
methods that touch gradients inside a jitted function, and module state changed between
calls."""

import pytest
import torch

import fulmen
from fulmen.core import NotYetSupportedError


@pytest.mark.filterwarnings("ignore:fulmen. Tensor.grad")
@pytest.mark.parametrize("dynamic", [None, True])
def test_module_zero_grad_keeping_the_tensors_zeroes_each_calls_gradients(dynamic):
    """`fulmen.jit(lambda: model.zero_grad(set_to_none=False))`: `Module.zero_grad` reads each
    parameter's `.grad`, which no trace takes as an input (each backward makes a new one); its
    reads were let through as those of `Module._apply` (the same file), so the trace zeroed
    the gradients of the first call only (and not even those: a grad only its parameter
    holds looks like a tensor the call made, so the trace zeroed a copy of it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    zero = fulmen.jit(lambda: model.zero_grad(set_to_none=False), dynamic=dynamic)
    for _ in range(3):
        model(torch.randn(3, 4)).square().sum().backward()
        # (no reference to the grads kept here: that changes what the tracer sees)
        assert all(p.grad.abs().sum() > 0 for p in model.parameters())
        addresses = [p.grad.data_ptr() for p in model.parameters()]
        zero()
        assert [p.grad.data_ptr() for p in model.parameters()] == addresses
        for p in model.parameters():
            torch.testing.assert_close(p.grad, torch.zeros_like(p))


def _halve_frozen_grads(model):
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(0.5)


@pytest.mark.filterwarnings("ignore:fulmen. Tensor.grad")
@pytest.mark.parametrize("dynamic", [None, True])
def test_gradients_of_frozen_parameters_updated_in_a_jitted_function(dynamic):
    """A frozen layer (`requires_grad_(False)`) keeps the gradients it had, or ones the caller
    sets: reading them was allowed (only grads of leaves requiring grad were refused), and the
    trace took the tensor it met, which only its parameter holds, for one the call made: each
    call halved a copy of it (and after `p.grad = ...`, that of the first call)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).requires_grad_(False)
    halve = fulmen.jit(lambda: _halve_frozen_grads(model), dynamic=dynamic)
    for step in range(3):
        model.weight.grad = torch.full((2, 3), step + 1.0)
        model.bias.grad = None if step == 1 else torch.ones(2)
        halve()
        torch.testing.assert_close(model.weight.grad, torch.full((2, 3), (step + 1.0) / 2))
        if step != 1:
            torch.testing.assert_close(model.bias.grad, torch.full((2,), 0.5))


def _scaled_steps(jit: bool, dynamic):
    """Four steps of `GradScaler` around an Adam optimizer whose `step` attribute is replaced
    by its jitted method (the scaler calls `optimizer.step()`); the third step's gradients
    hold an inf, so the scaler skips it and halves the scale."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if jit:
        opt.step = fulmen.jit(opt.step, dynamic=dynamic)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    records = []
    for step in range(4):
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4)).square().sum()).backward()
        if step == 2:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        records += [p.detach().clone() for p in model.parameters()]
        records.append(torch.tensor(scaler.get_scale()))
    return records, opt.step


@pytest.mark.parametrize("dynamic", [None, True])
def test_an_optimizers_step_replaced_by_its_jitted_method_under_a_grad_scaler(dynamic):
    """`opt.step = fulmen.jit(opt.step)`: the call's key walked the optimizer's attributes,
    `step` among them, into the jitted function's own cache and traces, and raised `TypeError:
    unhashable type` on the first call."""
    want, _ = _scaled_steps(False, dynamic)
    got, step = _scaled_steps(True, dynamic)
    torch.testing.assert_close(got, want)
    stats = fulmen.compile_stats(step)
    assert stats.calls == 3 and stats.eager_calls == 0  # the scaler skipped the inf step


@pytest.mark.filterwarnings("ignore:fulmen. forward_ad")
def test_calls_inside_a_forward_ad_dual_level_run_eagerly():
    """Dual tensors through a jitted module with grad mode on (forward-mode Jacobian-vector
    products, as in some second-order optimizers): the compiled program's autograd.Function
    has no `jvp`, so the call raised `NotImplementedError` where eager runs; such calls run
    eagerly now (and raise under fullgraph)."""
    fwad = torch.autograd.forward_ad
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    jitted = fulmen.jit(model)
    for _ in range(2):
        x, tangent = torch.randn(2, 4), torch.randn(2, 4)
        with fwad.dual_level():
            want = fwad.unpack_dual(model(fwad.make_dual(x, tangent)))
            got = fwad.unpack_dual(jitted(fwad.make_dual(x, tangent)))
        torch.testing.assert_close(got.primal, want.primal)
        torch.testing.assert_close(got.tangent, want.tangent)
    assert fulmen.compile_stats(jitted).eager_calls == 2
    with fwad.dual_level(), pytest.raises(NotYetSupportedError, match="dual_level"):
        fulmen.jit(model, fullgraph=True)(fwad.make_dual(x, tangent))
    torch.testing.assert_close(jitted(x), model(x))  # outside: compiled
    assert fulmen.compile_stats(jitted).cache_misses >= 1


def _low_precision_steps(make, dtype, jit: bool, dynamic):
    """Five jitted `opt.step()`s (under a StepLR scheduler: the learning rate is a float read
    at run time from the second call) on one parameter of `dtype`; the parameter and the
    optimizer state after each."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, dtype=dtype) * 3)
    opt = make([param])
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)
    step = fulmen.jit(opt.step, dynamic=dynamic) if jit else opt.step
    records = []
    for i in range(5):
        opt.zero_grad()
        (param.float() * (i + 1)).sin().sum().backward()
        step()
        scheduler.step()
        records += [param.detach().clone(), *[v.clone() for v in opt.state[param].values()]]
    return records, step


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=True),
    lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, foreach=True),
    lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.5, foreach=True),
], ids=["sgd", "adamw", "rmsprop"])
def test_foreach_optimizers_on_low_precision_parameters_step_as_eager(make, dtype, dynamic):
    """On CPU, eager's in-place `torch._foreach_mul_(xs, 0.9)` multiplies by the scalar rounded
    to the tensors' dtype; the trace recorded the functional `_foreach_mul`, which does not
    round, so SGD's momentum buffers, AdamW's decayed weights (`1 - lr * wd`, a float read at
    run time) and RMSprop's averages of bfloat16/float16 parameters drifted from eager's (an
    SGD weight by 0.8 after five steps). Bit for bit now."""
    want, _ = _low_precision_steps(make, dtype, False, dynamic)
    got, step = _low_precision_steps(make, dtype, True, dynamic)
    assert len(got) == len(want)
    for a, b in zip(got, want):  # (float16's eps underflows: NaN where eager has NaN)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert fulmen.compile_stats(step).eager_calls == 0


def _steps_under_global_hooks(jit: bool, dynamic):
    """Five SGD steps through `opt.step` (jitted or not); a global optimizer step pre-hook
    doubling the gradients is registered before the second and removed before the fourth,
    a post-hook clamping the weights is registered before the third."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    def double(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad.mul_(2)

    def clamp(opt, args, kwargs):
        with torch.no_grad():
            for group in opt.param_groups:
                for p in group["params"]:
                    p.clamp_(-0.3, 0.3)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = fulmen.jit(opt.step, dynamic=dynamic) if jit else opt.step
    handles, records = [], []
    try:
        for i in range(5):
            if i == 1:
                handles.append(register_optimizer_step_pre_hook(double))
            if i == 2:
                handles.append(register_optimizer_step_post_hook(clamp))
            if i == 3:
                handles.pop(0).remove()
            opt.zero_grad()
            model(torch.randn(2, 4)).square().sum().backward()
            step()
            records += [p.detach().clone() for p in model.parameters()]
    finally:
        for handle in handles:
            handle.remove()
    return records, step


@pytest.mark.parametrize("dynamic", [None, True])
def test_global_optimizer_step_hooks_registered_between_jitted_steps(dynamic):
    """`torch.optim.optimizer.register_optimizer_step_pre_hook` (and post-hooks): every
    `Optimizer.step` runs the global hooks, which a jitted `opt.step` traced with those of its
    first call: a hook registered later never ran, one removed kept running. They are in
    every call's key now (`process_state.PROCESS_STATES`)."""
    want, _ = _steps_under_global_hooks(False, dynamic)
    got, step = _steps_under_global_hooks(True, dynamic)
    torch.testing.assert_close(got, want)
    assert fulmen.compile_stats(step).eager_calls == 0


def _unfreezing_calls(jit: bool, dynamic):
    """Four calls of a function that unfreezes the layer it closes over before using it; the
    caller freezes the layer before the second and third (a fine-tuning schedule)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)

    def forward(x):
        layer.requires_grad_(True)
        return layer(x).tanh()

    fn = fulmen.jit(forward, dynamic=dynamic) if jit else forward
    records = []
    for step in range(4):
        layer.requires_grad_(step not in (1, 2))
        y = fn(torch.randn(2 + step, 4))
        y.sum().backward()
        records += [y.detach(), y.requires_grad, layer.weight.requires_grad,
                    layer.weight.grad.clone(), layer.bias.grad.clone()]
        layer.zero_grad()
    return records


@pytest.mark.filterwarnings("ignore:fulmen. Tensor.requires_grad_")
@pytest.mark.parametrize("dynamic", [None, True])
def test_requires_grad_set_inside_on_a_layer_frozen_between_calls(dynamic):
    """`layer.requires_grad_(True)` asks the parameters for the flag they had while tracing,
    so it was left out of the trace; a parameter of a module the function closes over is not
    keyed by its flag, so the calls made with the layer frozen reused that trace: the layer
    stayed frozen and `backward()` raised (its output did not require grad)."""
    want = _unfreezing_calls(False, dynamic)
    got = _unfreezing_calls(True, dynamic)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


