"""Autograd flags of tensors a jitted function closes over (NOTE [flags of closed-over tensors]):
`requires_grad` and `.grad` reads are keyed, so the call compiles and a flip recompiles; each
test checks against eager and that no call ran eagerly (before the keying, every such call did).
"""

import pytest
import torch

import fulmen


def _no_eager_calls(jitted, misses: int) -> None:
    stats = fulmen.compile_stats(jitted)
    assert (stats.eager_calls, stats.cache_misses) == (0, misses)


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_requires_grad_flip_of_a_closed_over_parameter_recompiles(dynamic):
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)

    def forward(x):
        y = layer(x)
        return y * 2 if layer.weight.requires_grad else y * 3

    jitted = fulmen.jit(forward, dynamic=dynamic)
    for frozen in (False, True, False, True, True):
        layer.requires_grad_(not frozen)
        x = torch.randn(2, 4)
        got, want = jitted(x), forward(x)
        torch.testing.assert_close(got, want)
        assert got.requires_grad == want.requires_grad
    _no_eager_calls(jitted, 2)  # one per flag value


def test_requires_grad_of_a_closed_over_plain_tensor_is_keyed():
    w = torch.randn(3)

    def f(x):
        return x * w if w.requires_grad else x - w

    jitted = fulmen.jit(f)
    for flag in (False, True, False):
        w.requires_grad_(flag)
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), f(x))
    _no_eager_calls(jitted, 2)


def test_the_grad_of_a_closed_over_parameter_is_keyed_and_read_on_every_call():
    """`p.grad is None` decides a branch (keyed); the gradient the code computes with is a trace
    input read from `p` on every call: `zero_grad()` and the next backward make a new one, and a
    backward without it accumulates into the same one."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3))

    def f(x):
        if p.grad is None:
            return x + 1
        return x * p.grad

    jitted = fulmen.jit(f)
    for step in range(6):
        x = torch.randn(3)
        torch.testing.assert_close(jitted(x), f(x))
        if step % 3 == 0:
            p.grad = None
        (p * torch.randn(3)).sum().backward()
    _no_eager_calls(jitted, 2)  # grad None, then a gradient of p's metadata


def test_an_in_place_update_of_a_closed_over_gradient_reaches_the_current_gradient():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)

    def halve():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)

    jitted = fulmen.jit(halve)
    for step in range(3):
        model.zero_grad()
        (model(torch.randn(4, 3)) * (step + 1)).sum().backward()
        want = [p.grad / 2 for p in model.parameters()]
        jitted()
        for p, w in zip(model.parameters(), want):
            torch.testing.assert_close(p.grad, w)
    _no_eager_calls(jitted, 1)  # (each call finds a new gradient, of the same metadata)


class ReadsOwnGrad(torch.nn.Module):
    """A module whose forward branches on its own weight's `.grad`."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)

    def forward(self, x):
        g = self.linear.weight.grad
        return self.linear(x) if g is None else self.linear(x) - g.sum()


def three_steps_reading_own_grad():
    """`fulmen.jit` of a `ReadsOwnGrad` after three calls equal to eager's, each followed by a
    backward of eager's output (the first gives the weight its gradient)."""
    torch.manual_seed(0)
    model = ReadsOwnGrad()
    jitted = fulmen.jit(model)
    for _ in range(3):
        x = torch.randn(2, 3)
        got, want = jitted(x), model(x)
        torch.testing.assert_close(got, want)
        want.sum().backward()
    return jitted


def test_a_module_reading_its_own_parameters_grad_recompiles_when_it_appears():
    _no_eager_calls(three_steps_reading_own_grad(), 2)


@pytest.mark.filterwarnings("ignore:fulmen")
def test_a_closed_over_gradient_in_a_function_with_graph_breaks_runs_eagerly():
    """A trace tree keeps its captured tensors: computing with a closed-over gradient there runs
    the call eagerly, with eager's answer."""
    p = torch.nn.Parameter(torch.ones(3))

    def f(x):
        y = x * p.grad
        return y * 2 if y.sum() > 0 else y * 3  # a graph break

    jitted = fulmen.jit(f)
    for sign in (1.0, -1.0, 1.0):
        p.grad = torch.full((3,), sign)
        x = torch.rand(3)
        torch.testing.assert_close(jitted(x), f(x))
    assert fulmen.compile_stats(jitted).eager_calls == 3


@pytest.mark.parametrize("frozen", [False, True])
def test_torchs_own_reads_of_closed_over_gradients_are_read_on_every_call(frozen):
    """Torch's own reads of `.grad` (`clip_grad_norm_` on a closed-over model) are keyed and
    read afresh as the user's are (they ran the call eagerly before session 51's h51flags),
    also for a frozen model whose gradients the caller sets (a read baked into the trace
    scaled the first call's gradients, or a copy of them, on every call)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).requires_grad_(not frozen)
    twin = torch.nn.Linear(3, 2).requires_grad_(not frozen)
    clip = fulmen.jit(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1))
    for step in range(3):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.full_like(p, step + 1.0)
            q.grad = p.grad.clone()
        torch.testing.assert_close(clip(), torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1))
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert fulmen.compile_stats(clip).eager_calls == 0
