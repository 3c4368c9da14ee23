"""Tensor hooks and `retain_grad()` on the outputs of a compiled call (NOTE [outputs other
outputs read] in `fulmen/read_outputs.py`): on an output other outputs of the call are computed
from, the outputs computed from it leave through nodes of their own, so the hook (and
`torch.autograd.grad`) sees eager's total gradient; on any other output the hook sees eager's
gradient as it is."""

import warnings

import pytest
import torch
from torch import nn

import fulmen


def _layers():
    torch.manual_seed(0)
    return nn.Linear(4, 6), nn.Linear(6, 3)


def _run(fn, params, hook_on, backward, hook=lambda g: g * 2, retain=False):
    """`fn(x)`'s outputs after a hook (or `retain_grad`) on the outputs `hook_on(outputs)` and
    `backward(outputs).backward()`: the gradients the hooks saw, the retained `.grad`s and the
    parameters' gradients."""
    for p in params:
        p.grad = None
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    outputs = fn(x)
    seen, hooked = {}, hook_on(outputs)
    for i, t in enumerate(hooked):
        if retain:
            t.retain_grad()
        else:
            t.register_hook(_seen_by(seen, i, hook))
    backward(outputs).backward()
    retained = [t.grad for t in hooked] if retain else []
    return [seen[i] for i in sorted(seen)], retained, [p.grad.clone() for p in params]


def _seen_by(seen: dict, i: int, hook):
    def seeing(grad):
        seen[i] = grad.clone()
        return hook(grad)

    return seeing


def _assert_same(got, expected):
    for g, e in zip(got, expected, strict=True):
        if isinstance(e, list):
            _assert_same(g, e)
        else:
            torch.testing.assert_close(g, e)


def _compiled_path(jf):
    stats = fulmen.compile_stats(jf)
    assert stats.calls >= 1 and stats.eager_calls == 0


def test_hook_on_an_output_other_outputs_are_computed_from_equals_eager():
    a, b = _layers()

    def f(x):
        h = torch.tanh(a(x))
        return b(h), h

    params = [*a.parameters(), *b.parameters()]
    eager = _run(f, params, lambda o: [o[1]], lambda o: o[0].sum() + o[1].sum())
    # eager's hook sees both uses of h: not what the caller's `h.sum()` alone gives
    assert not torch.allclose(eager[0][0], torch.ones(3, 6))
    jf = fulmen.jit(f)
    _assert_same(_run(jf, params, lambda o: [o[1]], lambda o: o[0].sum() + o[1].sum()), eager)
    _compiled_path(jf)


def test_retain_grad_on_an_output_other_outputs_are_computed_from_equals_eager():
    a, b = _layers()

    def f(x):
        h = torch.tanh(a(x))
        return {"loss": b(h).square().mean(), "hidden": h}

    jf = fulmen.jit(f)
    params = [*a.parameters(), *b.parameters()]
    eager = _run(f, params, lambda o: [o["hidden"]], lambda o: o["loss"], retain=True)
    assert eager[1][0] is not None  # eager's retained gradient: the loss's, through b
    _assert_same(_run(jf, params, lambda o: [o["hidden"]], lambda o: o["loss"], retain=True),
                 eager)
    _compiled_path(jf)


@pytest.mark.parametrize("dynamic", [False, True])
def test_hook_on_a_read_output_alone_reached_equals_eager(dynamic):
    """Only the hooked output is backpropagated: the outputs computed from it get no gradient,
    so the hook sees all of eager's (also at symbolic sizes, where unused cotangents are
    told apart otherwise)."""
    a, b = _layers()

    def f(x):
        h = torch.tanh(a(x))
        return b(h), h

    jf = fulmen.jit(f, dynamic=dynamic)
    params = list(a.parameters())
    eager = _run(f, params, lambda o: [o[1]], lambda o: o[1].square().sum())
    _assert_same(_run(jf, params, lambda o: [o[1]], lambda o: o[1].square().sum()), eager)
    _compiled_path(jf)


def test_hooks_on_outputs_no_other_output_reads_equal_eager():
    a, b = _layers()
    c = nn.Linear(4, 3)

    def f(x):
        h = torch.tanh(a(x))
        return b(h), c(x).sigmoid(), h.sum(1)

    jf = fulmen.jit(f)
    params = [*a.parameters(), *b.parameters(), *c.parameters()]

    def loss(o):
        return (o[0] * o[1]).sum() + o[2].square().sum()

    eager = _run(f, params, lambda o: list(o), loss)
    assert len(eager[0]) == 3
    _assert_same(_run(jf, params, lambda o: list(o), loss), eager)
    _compiled_path(jf)


def test_hook_on_an_output_others_read_without_gradient_equals_eager():
    """Other outputs read `h` only through `detach` and `argmax`: no gradient of theirs
    reaches `h`, so the hook sees all of eager's."""
    a, b = _layers()

    def f(x):
        h = torch.tanh(a(x))
        return b(h.detach()) * h.argmax(1, keepdim=True), h

    jf = fulmen.jit(f)
    params = list(a.parameters())

    def loss(o):
        return o[0].sum() + o[1].square().sum()

    eager = _run(f, params, lambda o: [o[1]], loss)
    _assert_same(_run(jf, params, lambda o: [o[1]], loss), eager)
    _compiled_path(jf)


def test_retain_grad_on_outputs_nothing_else_reads_equals_eager():
    a, b = _layers()

    def f(x):
        h = torch.tanh(a(x))
        return b(h), h.mean(0)

    jf = fulmen.jit(f)
    params = [*a.parameters(), *b.parameters()]

    def loss(o):
        return o[0].square().sum() + o[1].sum()

    eager = _run(f, params, lambda o: list(o), loss, retain=True)
    got = _run(jf, params, lambda o: list(o), loss, retain=True)
    assert all(g is not None for g in got[1])
    _assert_same(got, eager)
    _compiled_path(jf)


def test_hook_on_an_output_another_returned_view_reads_equals_eager():
    """`return h, h[:, 0]`: the view is made again outside the compiled call (NOTE [a view of
    an input returned]), so autograd sees its use of h."""
    a, _ = _layers()

    def f(x):
        h = torch.tanh(a(x))
        return h, h[:, 0]

    jf = fulmen.jit(f)
    params = list(a.parameters())

    def loss(o):
        return o[0].sum() + o[1].square().sum()

    eager = _run(f, params, lambda o: [o[0]], loss)
    _assert_same(_run(jf, params, lambda o: [o[0]], loss), eager)
    _compiled_path(jf)


def test_removed_hook_on_a_read_output_equals_eager():
    a, b = _layers()

    def f(x):
        h = torch.tanh(a(x))
        return b(h), h

    jf = fulmen.jit(f)
    params = [*a.parameters(), *b.parameters()]
    grads = []
    for fn in (f, jf):
        for p in params:
            p.grad = None
        o, h = fn(torch.randn(3, 4, generator=torch.Generator().manual_seed(2)))
        h.register_hook(lambda g: g * 2).remove()
        (o.sum() + h.sum()).backward()
        grads.append([p.grad.clone() for p in params])
    _assert_same(grads[1], grads[0])
    _compiled_path(jf)


def test_hook_registered_inside_the_compiled_function_equals_eager():
    """A hook on an intermediate registered inside the function: the call runs eagerly, with
    a warning, and the hook changes the parameters' gradients as in eager."""
    a, b = _layers()

    def f(x):
        h = torch.tanh(a(x))
        h.register_hook(lambda g: g * 2)
        return b(h)

    jf = fulmen.jit(f)
    params = [*a.parameters(), *b.parameters()]
    eager = _run(f, params, lambda o: [], lambda o: o.sum())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(jf, params, lambda o: [], lambda o: o.sum())
    assert any("tensor hook registered" in str(w.message) for w in caught)
    _assert_same(got, eager)
    assert fulmen.compile_stats(jf).eager_calls >= 1


def test_autograd_grad_at_an_output_other_outputs_read_is_eagers():
    a, b = _layers()

    def f(x):
        h = torch.tanh(a(x))
        return b(h), h

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    grads = []
    for fn in (f, fulmen.jit(f)):
        o, h = fn(x)
        grads.append(torch.autograd.grad(o.sum() + h.sum(), h)[0])
    torch.testing.assert_close(grads[1], grads[0])
