"""torch_autograd.py: ops run under torch.autograd, with flat arguments (NOTE [flat arguments])
and nested ones, against torch.autograd on the same call."""

import pytest
import torch

import fulmen
from fulmen.ops.torch_autograd import (
    autograd_backward_impl,
    autograd_forward_impl,
    autograd_vjp_impl,
)


def _addcmul(x, y, *, value):
    return torch.addcmul(x, y, y, value=value), x.sum()


def _cat(tensors, dim):
    return torch.cat(tensors, dim=dim)


def _case(flat: bool):
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    if flat:  # a tensor passed twice, a keyword, a tuple of outputs
        return _addcmul, (x, y), {"value": 0.5}, (x, y)
    return _cat, ([x, y, x],), {"dim": 0}, (x, y)  # a list of tensors: pytree's path


def _eager(fn, args, kwargs, primals, cotangents):
    leaves = [p.detach().requires_grad_() for p in primals]
    swap = {id(p): leaf for p, leaf in zip(primals, leaves)}
    args = tuple([swap.get(id(t), t) for t in a] if isinstance(a, list) else swap.get(id(a), a)
                 for a in args)
    outputs = fn(*args, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return outputs, torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True,
                                        materialize_grads=True)


@pytest.mark.parametrize("flat", [True, False])
def test_forward_backward_and_vjp_equal_autograd(flat):
    fn, args, kwargs, primals = _case(flat)
    outputs, graph = autograd_forward_impl(fn, args, kwargs, (True, True))
    leaves = outputs if isinstance(outputs, tuple) else (outputs,)
    assert not any(t.requires_grad for t in leaves)
    cotangents = tuple(torch.randn_like(t) for t in leaves)
    expected, expected_grads = _eager(fn, args, kwargs, primals, cotangents)
    for actual, wanted in zip(leaves, expected):
        torch.testing.assert_close(actual, wanted.detach())
    cotangent = cotangents if len(cotangents) > 1 else cotangents[0]
    grads = autograd_backward_impl(graph, None, cotangent)
    for actual, wanted in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(actual, wanted)
    for actual, wanted in zip(autograd_vjp_impl(fn, args, kwargs, cotangent), expected_grads,
                              strict=True):
        torch.testing.assert_close(actual, wanted)


def test_forward_keeps_the_arguments_of_the_caller():
    """The swapped arguments are fresh: the caller's tuple, dict and tensors are untouched."""
    x = torch.randn(3)
    args, kwargs = (x, 2.0), {"alpha": 3}
    outputs, _ = autograd_forward_impl(torch.add, args, kwargs, (True,))
    assert args[0] is x and not x.requires_grad and kwargs == {"alpha": 3}
    torch.testing.assert_close(outputs, x + 6.0)


def test_a_kept_graph_saved_before_tensor_residuals_reaches_its_place_in_backward():
    """An opaque op's kept autograd graph is a residual among tensors (the backward reads the
    graph before the matmul's saved inputs here): it rides on ctx and goes back to its place,
    and the gradients are eager's."""
    def f(x, w, grid):
        a = (x @ w).view(2, 1, 4, 4)
        return torch.nn.functional.grid_sample(a, grid, align_corners=False).square().sum()

    x, w = torch.randn(2, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    grid = torch.rand(2, 3, 3, 2) * 2 - 1
    expected = torch.autograd.grad(f(x, w, grid), (x, w))
    jf = fulmen.jit(f)
    torch.testing.assert_close(torch.autograd.grad(jf(x, w, grid), (x, w)), expected)
    residuals = [type(p).__name__ for p in fulmen.last_traces(jf)[-1].output[1]]
    assert "ObjectProxy" in residuals[:-1] and residuals[-1] == "TensorProxy"  # the case tested
