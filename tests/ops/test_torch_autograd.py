"""torch_autograd.py: ops run under torch.autograd, with flat arguments (NOTE [flat arguments])
and nested ones, against torch.autograd on the same call."""

import pytest
import torch

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
