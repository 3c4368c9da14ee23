"""Backward with `create_graph=True` through a compiled program (NOTE [double backward by
recomputation] in `fulmen.autograd_bridge`): gradient penalties, a PINN's derivatives of the
output by the input, Hessian-vector products, compared with eager; and the clear errors where
recomputing would not repeat the forward."""

import copy

import pytest
import torch

import fulmen


def _grads_alike(mine, theirs) -> None:
    for a, b in zip(mine.parameters(), theirs.parameters()):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)


def test_second_derivative_of_a_function_is_eagers():
    x = torch.randn(5, requires_grad=True)
    y = fulmen.jit(lambda t: (t * t * t).sin().sum())(x)
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    ye = (x * x * x).sin().sum()
    (ge,) = torch.autograd.grad(ye, x, create_graph=True)
    (he,) = torch.autograd.grad(ge.sum(), x)
    torch.testing.assert_close(g, ge)
    torch.testing.assert_close(h, he)


def test_a_gradient_penalty_through_a_jitted_critic_is_eagers():
    """WGAN-GP: the critic is jitted, the penalty's gradient reaches its parameters."""
    torch.manual_seed(0)
    critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    twin = copy.deepcopy(critic)
    jitted = fulmen.jit(twin)
    for _ in range(3):  # repeated calls hit the cache
        real = torch.randn(5, 4)
        mine, theirs = real.clone().requires_grad_(), real.clone().requires_grad_()
        (g1,) = torch.autograd.grad(jitted(mine).sum(), mine, create_graph=True)
        (g2,) = torch.autograd.grad(critic(theirs).sum(), theirs, create_graph=True)
        torch.testing.assert_close(g1, g2)
        ((g1.norm(dim=1) - 1) ** 2).mean().backward()
        ((g2.norm(dim=1) - 1) ** 2).mean().backward()
        _grads_alike(twin, critic)


def test_a_pinn_loss_of_second_derivatives_is_eagers():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin = copy.deepcopy(net)
    jitted = fulmen.jit(twin)
    points = torch.rand(10, 2)

    def loss(model, xy):
        u = model(xy)
        (du,) = torch.autograd.grad(u, xy, torch.ones_like(u), create_graph=True)
        (ddu,) = torch.autograd.grad(du[:, 0].sum(), xy, create_graph=True)
        return ddu.pow(2).mean() + u.pow(2).mean()

    loss(jitted, points.clone().requires_grad_()).backward()
    loss(net, points.clone().requires_grad_()).backward()
    _grads_alike(twin, net)


def test_double_backward_after_an_input_changed_in_place_raises():
    w, z = torch.randn(3, requires_grad=True), torch.randn(3)
    out = fulmen.jit(lambda t, u: (t * u).sin().sum())(w, z)
    z.add_(1)  # the recomputation would read the new values
    with pytest.raises(fulmen.NotYetSupportedError, match="updated in place"):
        torch.autograd.grad(out, w, create_graph=True)


def test_double_backward_of_a_program_that_draws_random_numbers_raises():
    x = torch.randn(8, requires_grad=True)
    out = fulmen.jit(lambda t: torch.nn.functional.dropout(t, 0.5).pow(3).sum())(x)
    with pytest.raises(fulmen.NotYetSupportedError, match="random"):
        torch.autograd.grad(out, x, create_graph=True)
    # a first-order backward still works
    out = fulmen.jit(lambda t: torch.nn.functional.dropout(t, 0.5).pow(3).sum())(x)
    (grad,) = torch.autograd.grad(out, x)
    assert grad.shape == x.shape


def test_an_inference_tensor_beside_a_parameter_is_eagers():
    """An inference tensor may join autograd where eager does not save it. Two failures before:
    reading its version for the double-backward check raised "Inference tensors do not track
    version counter", and rematerialization saved the input itself (cheaper than `a + b`),
    which autograd refuses for an inference tensor."""
    with torch.inference_mode():
        offset = torch.randn(3)
    w = torch.randn(3, requires_grad=True)
    y = fulmen.jit(lambda a, b: (a + b).sin())(w, offset)
    y.sum().backward()
    torch.testing.assert_close(y, (w + offset).sin())
    torch.testing.assert_close(w.grad, (w + offset).cos())
