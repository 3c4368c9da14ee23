"""Follow-ups of NOTE [flags of closed-over tensors]: a miss after a flag flip is explained by
the flag's name (`FlagReads.describe`), not by the attributes the key grew by when the first
trace reached a held module."""

import pytest
import torch

import fulmen
from tests.tracer.test_closure_flags import three_steps_reading_own_grad


def test_a_requires_grad_flip_is_explained_by_the_flags_name():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    w = torch.randn(3)

    def forward(x):
        y = layer(x)
        y = y * 2 if layer.weight.requires_grad else y * 3
        return y + w if w.requires_grad else y

    jitted = fulmen.jit(forward)
    for frozen in (False, False, True, True):
        layer.requires_grad_(not frozen)
        x = torch.randn(2, 4)
        torch.testing.assert_close(jitted(x), forward(x))
    w.requires_grad_(True)
    x = torch.randn(2, 4)
    torch.testing.assert_close(jitted(x), forward(x))
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0
    assert stats.recompile_reasons == [
        ["layer.weight.requires_grad changed from True to False"],
        ["w.requires_grad changed from False to True"]]


def test_a_gradient_appearing_or_changing_strides_is_explained_by_name():
    p = torch.nn.Parameter(torch.randn(3))

    def f(x):
        return x + 1 if p.grad is None else x * p.grad

    jitted = fulmen.jit(f)
    for step in range(4):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), f(x))
        if step == 1:
            p.grad = torch.ones(3)
        if step == 2:
            p.grad = torch.ones(1).expand(3)
    reasons = fulmen.compile_stats(jitted).recompile_reasons
    assert reasons == [
        ["p.grad changed from None to '<tensor (3,) torch.float32 stride (1,)>'"],
        ["p.grad changed from '<tensor (3,) torch.float32 stride (1,)>' to "
         "'<tensor (3,) torch.float32 stride (0,)>'"]]


def test_a_jitted_modules_read_of_its_own_parameters_grad_is_named():
    reasons = fulmen.compile_stats(three_steps_reading_own_grad()).recompile_reasons
    assert reasons[-1] == [
        "linear.weight.grad changed from None to '<tensor (3, 3) torch.float32 stride (3, 1)>'"]


# -- torch's own reads of closed-over gradients: keyed and read afresh, as the user's -------------


def _twins(frozen: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    twin.load_state_dict(model.state_dict())
    return model.requires_grad_(not frozen), twin.requires_grad_(not frozen)


def _same_state(model, twin) -> None:
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)
            assert p.grad.stride() == q.grad.stride()


def _backward(model, twin, step: int) -> None:
    x = torch.randn(5, 3)
    for m in (model, twin):
        (m(x) * (step + 1)).sum().backward()


def test_clip_grad_norm_of_a_closed_over_model_scales_the_current_gradients():
    """Gradients accumulate, are replaced by `zero_grad()` (None, then new ones), and one is set
    to a transposed tensor (other strides: a new entry); each call clips the current ones."""
    model, twin = _twins()

    def clip(m):
        return torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)

    jitted = fulmen.jit(lambda: clip(model))
    for step in range(6):
        if step == 2:
            model.zero_grad()
            twin.zero_grad()
        _backward(model, twin, step)
        if step == 4:
            grad = torch.randn(4, 2).t()
            model[2].weight.grad, twin[2].weight.grad = grad, grad.clone().t().contiguous().t()
        torch.testing.assert_close(jitted(), clip(twin))
        _same_state(model, twin)
    stats = fulmen.compile_stats(jitted)
    assert (stats.eager_calls, stats.cache_misses) == (0, 2)


def test_clip_grad_norm_of_a_frozen_closed_over_model_with_gradients_set_by_the_caller():
    model, twin = _twins(frozen=True)
    jitted = fulmen.jit(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
    for step in range(3):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.full_like(p, step + 1.0)
            q.grad = p.grad.clone()
        torch.testing.assert_close(jitted(),
                                   torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1))
        _same_state(model, twin)
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_zero_grad_keeping_the_gradients_of_a_closed_over_model_zeroes_the_current_ones():
    """`model.zero_grad(set_to_none=False)` calls `requires_grad_(False)` on each gradient (a
    no-op: the flag is keyed) and zeroes them in place; a gradient that became None is skipped
    (a new entry), and a gradient made with `create_graph=True` (it has a grad_fn: `detach_()`)
    runs the call eagerly."""
    model, twin = _twins()

    def clear_and_scale(m):
        m.zero_grad(set_to_none=False)
        return sum(p.grad.sum() for p in m.parameters() if p.grad is not None)

    jitted = fulmen.jit(lambda: clear_and_scale(model))
    for step in range(5):
        _backward(model, twin, step)
        if step == 3:
            model[0].weight.grad = twin[0].weight.grad = None
        torch.testing.assert_close(jitted(), clear_and_scale(twin))
        _same_state(model, twin)
        for m in (model, twin):  # the zeroed gradients are the ones the next backward adds to
            m[0].bias.grad.add_(1.0)
    stats = fulmen.compile_stats(jitted)
    assert (stats.eager_calls, stats.cache_misses) == (0, 2)
    x = torch.randn(5, 3)
    for m in (model, twin):
        for p in m.parameters():
            p.grad = None
        torch.autograd.backward(m(x).sum(), create_graph=True)
    with pytest.warns(UserWarning, match="metadata"):
        torch.testing.assert_close(jitted(), clear_and_scale(twin))
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        assert p.grad.requires_grad == q.grad.requires_grad


@pytest.mark.filterwarnings("ignore:fulmen")
def test_a_train_step_closing_over_model_and_optimizer_matches_eager():
    """The optimizer's gradients are inputs through the optimizer object, `clip_grad_norm_`'s
    are closed-over gradients: the same tensors as two inputs, one updated in place, so the
    call runs eagerly (the aliasing check), with eager's answer on every step."""
    model, twin = _twins()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)

    def step(m, o):
        norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        o.step()
        o.zero_grad()
        return norm

    jitted = fulmen.jit(lambda: step(model, opt))
    for i in range(4):
        _backward(model, twin, i)
        torch.testing.assert_close(jitted(), step(twin, opt_twin))
        _same_state(model, twin)


@pytest.mark.filterwarnings("ignore:fulmen")
def test_requires_grad_true_on_a_closed_over_gradient_runs_eagerly():
    """`requires_grad_(flag)` on a closed-over gradient is dropped only where the gradient
    already has `flag`; turning it on changes the caller's tensor (eagerly, as before)."""
    model, twin = _twins()

    def mark(m):
        m[0].weight.grad.requires_grad_(True)
        return m[0].weight.grad * 2

    jitted = fulmen.jit(lambda: mark(model))
    for step in range(3):
        for m in (model, twin):
            m.zero_grad()
        _backward(model, twin, step)
        got, want = jitted(), mark(twin)
        torch.testing.assert_close(got, want)
        assert model[0].weight.grad.requires_grad and got.requires_grad
