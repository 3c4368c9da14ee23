"""executors/torch/reinplace.py: a written-back input's new value computed into the input,
the write-back dropped, only where eager's values and aliasing are kept (NOTE [reinplacing is
safe when])."""

import pytest
import torch

import fulmen

optim = torch.optim


def _names(jfn) -> list[str]:
    return [b.sym.name for b in fulmen.last_traces(jfn)[-1].bsyms]


def _into_count(jfn) -> int:
    return sum(name.endswith(("_into", "_into_without_grad")) for name in _names(jfn))


# name -> optimizer over a list of parameters (single-tensor paths: the torch ops reinplaced)
OPTIMIZERS = {
    "sgd_momentum": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_nesterov_weight_decay": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                                      weight_decay=0.01),
    "adam_amsgrad": lambda ps: optim.Adam(ps, lr=0.01, amsgrad=True, weight_decay=0.1),
    "adamw": lambda ps: optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adamw_amsgrad": lambda ps: optim.AdamW(ps, lr=0.01, amsgrad=True),
}


def _train(make_opt, jit: bool, steps: int = 5):
    """Three small parameters under a cosine schedule (the learning rate changes every step);
    the parameters and the optimizer state after `steps` steps, and the step."""
    torch.manual_seed(0)
    w, b, v = (torch.randn(*shape, requires_grad=True) for shape in ((6, 4), (4,), (4,)))
    opt = make_opt([w, b, v])
    sched = optim.lr_scheduler.CosineAnnealingLR(opt, 4)
    step = fulmen.jit(opt.step) if jit else opt.step
    for i in range(steps):
        h = (torch.randn(5, 6) * (1 + i) @ w + b).tanh()
        (h.square().sum() + (h * v).sum()).backward()
        step()
        opt.zero_grad()
        sched.step()
    return [w.detach(), b.detach(), v.detach()], opt.state_dict(), step


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_reinplaced_optimizer_step_equals_eager_under_a_schedule(name):
    """Parameters and state equal eager's after 5 steps with a changing learning rate; the
    step's updates run in place (fewer write-backs than written inputs) and the schedule
    compiles nothing new."""
    got, got_state, step = _train(OPTIMIZERS[name], True)
    want, want_state, _ = _train(OPTIMIZERS[name], False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for index, per_param in want_state["state"].items():
        for key, value in per_param.items():
            torch.testing.assert_close(got_state["state"][index][key], value, rtol=1e-5,
                                       atol=1e-6)
    stats = fulmen.compile_stats(step)
    # (3: the schedule's learning rate reaches exactly 0 at its last step, and the sign of each
    # run-time float is part of the key, NOTE [floats read at run time])
    assert stats.eager_calls == 0 and stats.cache_misses <= 3
    assert _into_count(step) >= 3  # the parameters at least are updated in place


def _check(fn, make):
    """Run `fn` jitted on the torch executor (its ops are what is reinplaced; traced, then
    cached) and eagerly on equal inputs; compare results and inputs exactly. Returns the jitted
    function and its last inputs and result."""
    jfn = fulmen.jit(fn, executors=["torch"])
    for _ in range(2):
        args, ref = make(), make()
        got, want = jfn(*args), fn(*ref)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, r in zip(args, ref):
            torch.testing.assert_close(a, r, rtol=0, atol=0)
    return jfn, args, got


def _two():
    torch.manual_seed(0)
    return torch.randn(8, 4), torch.randn(8, 4)


def _read_old_value_after_the_update(x, y):
    new = x + y
    old = x * 3  # reads x's old value after `new` is computed
    x.copy_(new)
    return old


def test_an_input_read_after_its_new_value_is_computed_keeps_the_copy():
    """`new` may not be computed into `x`: `old` reads `x` after it."""
    jfn, (x, _), old = _check(_read_old_value_after_the_update, _two)
    assert "copy_" in _names(jfn)


def _view_read_after_the_new_value(x, y):
    view = x.t()
    new = x + y
    old = view * 2  # the view reads x's old values after `new` is computed
    x.copy_(new)
    return old


def test_a_view_taken_before_the_update_and_read_after_keeps_the_copy():
    """`new` may not be computed into `x` while a view of `x` is still to be read."""
    jfn, _, _ = _check(_view_read_after_the_new_value, _two)
    assert "copy_" in _names(jfn)


def _chain_with_a_value_read_twice(x, y):
    x.mul_(2)
    z = x * y  # reads the intermediate value
    x.add_(y)
    return z


def test_a_chain_stops_at_a_value_read_elsewhere():
    jfn, _, _ = _check(_chain_with_a_value_read_twice, _two)
    assert "copy_" not in _names(jfn) and _into_count(jfn) == 1


def _update_and_return_input(x, y):
    x.mul_(2).add_(y)
    return x


def test_an_input_updated_and_returned_is_the_input():
    jfn, (x, _), out = _check(_update_and_return_input, _two)
    assert out.data_ptr() == x.data_ptr() and _into_count(jfn) == 2
    assert "copy_" not in _names(jfn)


def _copy_in_a_value_and_return_it(x, y):
    new = x * 2 + y
    x.copy_(new)
    return new


def test_a_returned_value_copied_into_an_input_stays_its_own_tensor():
    """Eager's `new` is not `x`: computed into `x`, a later change of `new` would change `x`."""
    jfn, (x, _), new = _check(_copy_in_a_value_and_return_it, _two)
    assert new.data_ptr() != x.data_ptr()
    new.add_(1)
    assert not torch.equal(new, x)


def _view_returned(x, y):
    new = x * 2 + y
    x.copy_(new)
    return new.view(-1)


def test_a_view_of_the_value_returned_keeps_the_copy():
    jfn, (x, _), flat = _check(_view_returned, _two)
    assert flat.data_ptr() != x.data_ptr()


def _tied(a, b):
    a.mul_(2)
    b.add_(1)
    return a.sum()


def test_the_same_tensor_passed_twice_is_updated_as_eager():
    """Tied weights: both names are one input; the two updates chain on it."""
    jfn = fulmen.jit(_tied, executors=["torch"])
    for _ in range(2):
        t, r = torch.randn(5), None
        r = t.clone()
        got, want = jfn(t, t), _tied(r, r)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(t, r, rtol=0, atol=0)


def _view_input_update(base, row):
    row.mul_(2)
    return base.sum()


def test_an_input_that_is_a_view_of_another_is_never_reinplaced_wrongly():
    """`row` shares storage with `base`: a trace treating them as independent must not run
    (it raises or runs eagerly), so the result is eager's."""
    torch.manual_seed(0)
    base, ref = torch.randn(3, 4), None
    ref = base.clone()
    jfn = fulmen.jit(_view_input_update, executors=["torch"])
    try:
        got = jfn(base, base[1])
    except Exception:  # refused: a clear error, nothing changed
        torch.testing.assert_close(base, ref, rtol=0, atol=0)
        return
    want = _view_input_update(ref, ref[1])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(base, ref, rtol=0, atol=0)


def _no_grad_update_then_use(w, x):
    with torch.no_grad():
        w.mul_(0.5)
    return (w * x).sum()


def test_a_parameter_updated_under_no_grad_then_differentiated_equals_eager():
    """`w` requires grad: its new value is read with grad on, so it is not computed into `w`
    behind autograd's back; values and gradients are eager's."""
    jfn = fulmen.jit(_no_grad_update_then_use, executors=["torch"])
    for _ in range(2):
        torch.manual_seed(0)
        w, x = torch.randn(4, requires_grad=True), torch.randn(4)
        w2 = w.detach().clone().requires_grad_()
        got, want = jfn(w, x), _no_grad_update_then_use(w2, x)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(w.grad, w2.grad)
        torch.testing.assert_close(w.detach(), w2.detach())


def test_a_whole_training_step_updates_parameters_in_place_as_eager():
    """`loss.backward(); opt.step()` inside one jitted function: the parameters and moments
    are updated in place and equal eager's over steps under a schedule."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(),
                                    torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
        opt = optim.AdamW(model.parameters(), lr=0.01)
        sched = optim.lr_scheduler.StepLR(opt, 1, 0.7)
        x, y = torch.randn(4, 8), torch.tensor([0, 2, 1, 0])

        def step():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return model, step, sched

    (model, step, sched), (ref_model, ref_step, ref_sched) = make(), make()
    jstep = fulmen.jit(step)
    for _ in range(4):
        torch.testing.assert_close(jstep(), ref_step(), rtol=1e-5, atol=1e-6)
        sched.step()
        ref_sched.step()
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert fulmen.compile_stats(jstep).eager_calls == 0
    assert _into_count(jstep) >= 4


def _scale_buffer(buf, scale):
    buf.mul_(scale)
    return buf.sum()


def test_a_buffer_scaled_by_a_float_read_at_run_time_is_updated_in_place():
    """The scale changes every call (a float read at run time, `FloatProxy`): the update of
    a tensor not requiring grad runs in place and the calls after the second compile nothing
    (the pass once failed on the float operand, and the retrace made it a constant)."""
    jfn = fulmen.jit(_scale_buffer, executors=["torch"])
    buf, ref = torch.ones(6), torch.ones(6)
    for scale in (0.5, 0.7, 0.9, 1.1, 1.3):
        torch.testing.assert_close(jfn(buf, scale), _scale_buffer(ref, scale), rtol=0, atol=0)
        torch.testing.assert_close(buf, ref, rtol=0, atol=0)
    assert fulmen.compile_stats(jfn).cache_misses <= 2
    assert _into_count(jfn) == 1 and "copy_" not in _names(jfn)


def test_a_buffer_of_changing_size_is_updated_as_eager():
    """Symbolic sizes are left alone (comparing them would add guards); values are eager's."""
    jfn = fulmen.jit(_scale_buffer, executors=["torch"])
    for size in (4, 6, 8, 10):
        buf, ref = torch.ones(size), torch.ones(size)
        torch.testing.assert_close(jfn(buf, 0.5), _scale_buffer(ref, 0.5), rtol=0, atol=0)
        torch.testing.assert_close(buf, ref, rtol=0, atol=0)
    assert fulmen.compile_stats(jfn).cache_misses <= 3
