"""A view of an input returned from a differentiated program answers as eager's view: the
same `requires_grad`, a real view (so an in-place update of it is seen by autograd, or refused
as eager refuses it), and under `torch.no_grad()` the same answer as eager's view made there
(NOTE [a view of an input returned] in `fulmen.returned_views`); so is a view of another
output."""

import pytest
import torch

import fulmen

# ops whose result eager returns as a view of the input (some only when they can: reshape)
_VIEWS = {
    "reshape": lambda x: x.reshape(16),
    "flatten": lambda x: x.flatten(),
    "ravel": lambda x: x.ravel(),
    "reshape_as": lambda x: x.reshape_as(torch.empty(16)),
    "view_as": lambda x: x.view_as(torch.empty(2, 8)),
    "unflatten": lambda x: x.unflatten(1, (2, 2)),
    "diagonal": lambda x: x.diagonal(),
    "unfold": lambda x: x.unfold(1, 2, 2),
    "as_strided": lambda x: x.as_strided((2, 2), (1, 2)),
    "unbind": lambda x: x.unbind(0)[1],
    "chunk": lambda x: x.chunk(2, 1)[1],
    "split": lambda x: x.split(1)[2],
    "alias": lambda x: x[...],
    "transposed_reshape": lambda x: x.t().reshape(16),  # a copy: eager's answer too
}


def _update_returned_view_then_backward(jit, op):
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = w * 1
    out = jit(op)(x)
    try:
        out.mul_(2)
    except RuntimeError as e:
        return type(e)
    (x * x).sum().backward()
    return w.grad, x.detach()


@pytest.mark.parametrize("name", sorted(_VIEWS))
def test_a_returned_view_updated_in_place_changes_the_gradient_as_in_eager(name):
    op = _VIEWS[name]
    expected = _update_returned_view_then_backward(lambda f: f, op)
    actual = _update_returned_view_then_backward(fulmen.jit, op)
    if isinstance(expected, type):
        assert actual is expected
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _describe(t: torch.Tensor, x: torch.Tensor) -> tuple:
    shares = t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    return (t.shape, t.stride(), t.requires_grad, t.is_leaf, t.grad_fn is None, t._is_view(),
            shares)


# `x[...]` under no_grad gives x itself back (cse drops a view that gives its input back)
@pytest.mark.parametrize("name", sorted(set(_VIEWS) - {"alias"}))
def test_a_view_made_under_no_grad_answers_as_eager(name):
    op = _VIEWS[name]

    def fn(x):
        with torch.no_grad():
            return op(x)

    x = torch.randn(4, 4, requires_grad=True)
    expected, actual = fn(x), fulmen.jit(fn)(x)
    assert torch.equal(actual, expected)
    assert _describe(actual, x) == _describe(expected, x)


def _update_one_of_two_aliasing_outputs_then_backward(jit, op, updated):
    torch.manual_seed(0)
    x = torch.randn(4, 4, requires_grad=True)
    outs = jit(lambda x: (lambda h: (h, op(h)))(x * 2))(x)
    try:  # (eager refuses some: updating a view of `unbind`, or reading one after its base's)
        outs[updated].mul_(3)
        (outs[1 - updated] ** 2).sum().backward()
    except RuntimeError as e:
        return type(e)
    return outs[1 - updated].detach(), x.grad


@pytest.mark.parametrize("updated", [0, 1])
@pytest.mark.parametrize("name", sorted(_VIEWS))
def test_an_output_and_a_view_of_it_updated_in_place_answer_as_in_eager(name, updated):
    op = _VIEWS[name]
    expected = _update_one_of_two_aliasing_outputs_then_backward(lambda f: f, op, updated)
    actual = _update_one_of_two_aliasing_outputs_then_backward(fulmen.jit, op, updated)
    if isinstance(expected, type):
        assert actual is expected
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _views_of_views(x):
    h = x * 2
    return h[1:].t(), h, x.t(), h[1:].t()[0]  # (a view of an output listed before its base)


def _update_a_view_of_a_view_of_an_output(jit):
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    outs = jit(_views_of_views)(x)
    outs[3].mul_(5)
    (outs[1] ** 2).sum().backward()
    return outs[1].detach(), x.grad


def test_views_of_outputs_and_inputs_are_replayed_in_order():
    x = torch.randn(4, 3, requires_grad=True)
    actual, expected = fulmen.jit(_views_of_views)(x), _views_of_views(x)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e) and a._is_view() == e._is_view()
    assert actual[0]._base is actual[1] and actual[3]._base is actual[1]
    assert actual[2]._base is x
    torch.testing.assert_close(_update_a_view_of_a_view_of_an_output(fulmen.jit),
                               _update_a_view_of_a_view_of_an_output(lambda f: f))


class _CacheAndWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 6))
        self.weight = torch.nn.Parameter(torch.randn(3, 3))

    def forward(self, x, n):
        self.cache[:, n:n + 2] = x  # a buffer written back: the parameter is not
        return self.cache[:, :n + 2], self.weight.diagonal(), self.weight


def test_a_parameter_returned_beside_a_buffer_update_is_the_parameter_as_in_eager():
    eager, compiled = _CacheAndWeight(), _CacheAndWeight()
    compiled.load_state_dict(eager.state_dict())
    jf = fulmen.jit(compiled)
    for n in (0, 2):
        x = torch.full((2, 2), n + 1.0)
        expected, actual = eager(x, n), jf(x, n)
        for a, e in zip(actual, expected):
            assert torch.equal(a, e) and a._is_view() == e._is_view()
        assert actual[2] is compiled.weight and expected[2] is eager.weight
        assert actual[1]._base is compiled.weight  # (an opaque view: replayed on the weight)
    torch.testing.assert_close(compiled.cache, eager.cache)


def _a_view_updated_in_place(order):
    def fn(x):
        h = x * 2
        view = h[:, ::2].t()
        view.mul_(3)  # the view's new value is the multiplication's: still a view of `h`
        return (view, h) if order == "view first" else (h, view)
    return fn


@pytest.mark.parametrize("order", ["view first", "base first"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_view_updated_in_place_and_returned_with_its_base_is_a_view_of_it(order, requires_grad):
    # NOTE [a view of an input returned]: the caller's update of the view must reach the base
    fn = _a_view_updated_in_place(order)
    results = []
    for run in (fn, fulmen.jit(fn)):
        torch.manual_seed(0)
        x = torch.randn(4, 6, requires_grad=requires_grad)
        outs = run(x)
        view, h = outs if order == "view first" else outs[::-1]
        assert view._base is h and view.stride() == (2, 6)
        view.add_(100)
        results.append(h.detach().clone())
        if requires_grad:
            (h ** 2).sum().backward()
            results.append(x.grad)
    for actual, expected in zip(results[len(results) // 2:], results[:len(results) // 2]):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
