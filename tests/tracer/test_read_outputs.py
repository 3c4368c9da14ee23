"""Outputs other outputs of a compiled call are computed from, behind nodes of their own (NOTE
[outputs other outputs read] in `fulmen/read_outputs.py`): hooks, `retain_grad`,
`torch.autograd.grad` and parameter gradients equal eager's with several read outputs, chains,
views, symbolic sizes, graph breaks and an HF model's hidden states."""

import pytest
import torch
from torch import nn

import fulmen
from fulmen.core import NotYetSupportedError


def _linears(*sizes):
    torch.manual_seed(0)
    return [nn.Linear(i, o) for i, o in sizes]


def _compare(f, params, observe, loss, x=None, jit_options=None, calls=1):
    """`(eager, compiled)`: what `observe(outputs)` returns (hooks' and retained gradients,
    `autograd.grad`'s, read after `loss(outputs)` is backpropagated by it) and the parameters'
    gradients, for `f` and `fulmen.jit(f)` over `calls` calls."""
    jf = fulmen.jit(f, **(jit_options or {}))
    results = []
    for fn in (f, jf):
        for call in range(calls):
            for p in params:
                p.grad = None
            inputs = x if x is not None else torch.randn(
                3, 4, generator=torch.Generator().manual_seed(call))
            outputs = fn(inputs)
            seen = observe(outputs, loss(outputs))
            results.append((seen(), [p.grad.clone() if p.grad is not None else None
                                     for p in params]))
    stats = fulmen.compile_stats(jf)
    assert stats.calls >= 1 and stats.eager_calls == 0
    return results[:calls], results[calls:]


def _assert_same(got, expected):
    if isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected)
        for g, e in zip(got, expected):
            _assert_same(g, e)
    elif expected is None:
        assert got is None
    else:
        torch.testing.assert_close(got, expected)


def _hooked(*picks, hook=lambda g: g * 2):
    """Register `hook` (recording what it saw) on the outputs `picks(outputs)`, then backward."""
    def observe(outputs, loss):
        seen = [None] * len(picks)
        for i, pick in enumerate(picks):
            pick(outputs).register_hook(lambda g, i=i: (seen.__setitem__(i, g.clone()),
                                                        hook(g))[1])
        loss.backward()
        return lambda: seen

    return observe


def _retained(*picks):
    def observe(outputs, loss):
        tensors = [pick(outputs) for pick in picks]
        for t in tensors:
            t.retain_grad()
        loss.backward()
        return lambda: [t.grad for t in tensors]

    return observe


def _grad_at(*picks, params=()):
    def observe(outputs, loss):
        found = torch.autograd.grad(loss, [pick(outputs) for pick in picks] + list(params))
        return lambda: list(found)

    return observe


def _two_reads():
    a, b, c = _linears((4, 6), (6, 3), (4, 3))

    def f(x):
        h1 = torch.tanh(a(x))
        h2 = torch.sigmoid(c(x))
        return b(h1) * h2, h1, h2

    return f, [*a.parameters(), *b.parameters(), *c.parameters()]


def _loss3(o):
    return o[0].square().sum() + o[1].sum() + (o[2] * 3).sum()


@pytest.mark.parametrize("observe", [
    _hooked(lambda o: o[1], lambda o: o[2]),
    _hooked(lambda o: o[1], lambda o: o[2], hook=lambda g: None),  # observers
    _retained(lambda o: o[1], lambda o: o[2]),
    _grad_at(lambda o: o[1], lambda o: o[2]),
], ids=["doubling hooks", "observer hooks", "retain_grad", "autograd.grad"])
def test_several_read_outputs_equal_eager(observe):
    f, params = _two_reads()
    eager, compiled = _compare(f, params, observe, _loss3, calls=2)
    _assert_same(compiled, eager)


def _chain():
    a, b, c = _linears((4, 6), (6, 6), (6, 3))

    def f(x):
        h1 = torch.tanh(a(x))
        h2 = torch.tanh(b(h1)) + h1
        return c(h2) * h1[:, :3], h2, h1

    return f, [*a.parameters(), *b.parameters(), *c.parameters()]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("observe", [
    _hooked(lambda o: o[2], lambda o: o[1]),
    _retained(lambda o: o[2], lambda o: o[1]),
    _grad_at(lambda o: o[2], lambda o: o[1]),
    _grad_at(lambda o: o[2]),
], ids=["hooks", "retain_grad", "autograd.grad", "autograd.grad at h1 alone"])
def test_a_chain_of_read_outputs_equals_eager(observe, dynamic):
    """`h1 -> h2 -> o`, all returned (also with symbolic sizes: two batch sizes)."""
    f, params = _chain()
    for rows in (3, 5):
        x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(rows))
        eager, compiled = _compare(f, params, observe, _loss3, x=x,
                                   jit_options={"dynamic": dynamic})
        _assert_same(compiled, eager)


def test_autograd_grad_of_the_parameters_alone_equals_eager():
    """A backward that captures (`torch.autograd.grad` of the parameters) runs the stages'
    own VJPs: the parameters' gradients stay eager's."""
    f, params = _chain()

    def observe(outputs, loss):
        found = torch.autograd.grad(loss, params)
        return lambda: list(found)

    eager, compiled = _compare(f, params, observe, _loss3)
    _assert_same(compiled, eager)


def test_views_of_read_outputs_equal_eager():
    """`v = h[:, :2]` is returned and read by another output: hooks on `v` and `h` see eager's
    totals."""
    a, b = _linears((4, 6), (2, 3))

    def f(x):
        h = torch.tanh(a(x))
        v = h[:, :2]
        return b(v), h, v

    params = [*a.parameters(), *b.parameters()]
    for observe in (_hooked(lambda o: o[2], lambda o: o[1]), _retained(lambda o: o[2]),
                    _grad_at(lambda o: o[2], lambda o: o[1])):
        eager, compiled = _compare(f, params, observe, _loss3)
        _assert_same(compiled, eager)


def test_a_hook_on_a_read_output_dropped_before_the_backward_equals_eager():
    a, b = _linears((4, 6), (6, 3))

    def f(x):
        h = torch.tanh(a(x))
        return b(h), h

    params = [*a.parameters(), *b.parameters()]
    jf = fulmen.jit(f)
    results = []
    for fn in (f, jf):
        for p in params:
            p.grad = None
        seen = []
        o, h = fn(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
        h.register_hook(lambda g, seen=seen: (seen.append(g.clone()), g * 3)[1])
        del h  # (gone; its hook stays)
        o.square().sum().backward()
        results.append([seen, [p.grad.clone() for p in params]])
    assert results[0][0]  # eager's hook ran
    _assert_same(results[1], results[0])


def test_read_outputs_with_a_graph_break_equal_eager():
    a, b = _linears((4, 6), (6, 3))

    def f(x):
        h = torch.tanh(a(x))
        if h.sum() > 0:
            h = h * 2
        return b(h), h

    params = [*a.parameters(), *b.parameters()]
    for sign in (1.0, -1.0):
        x = sign * torch.ones(3, 4)
        for observe in (_hooked(lambda o: o[1]), _grad_at(lambda o: o[1])):
            eager, compiled = _compare(f, params, observe,
                                       lambda o: o[0].square().sum() + o[1].sum(), x=x)
            _assert_same(compiled, eager)


def test_a_read_output_of_a_program_drawing_random_numbers():
    """Without a hook, the dropout's stage passes its gradients through (eager's parameter
    gradients); with one, it cannot be run again: a clear error."""
    a, b = _linears((4, 6), (6, 3))

    def f(x):
        h = torch.tanh(a(x))
        return nn.functional.dropout(b(h), 0.5), h

    params = [*a.parameters(), *b.parameters()]
    jf = fulmen.jit(f)
    grads = []
    for fn in (f, jf):
        for p in params:
            p.grad = None
        torch.manual_seed(3)
        o, h = fn(torch.ones(3, 4))
        (o.square().sum() + h.sum()).backward()
        grads.append([p.grad.clone() for p in params])
    _assert_same(grads[1], grads[0])
    o, h = jf(torch.ones(3, 4))
    h.register_hook(lambda g: g * 2)
    with pytest.raises(NotYetSupportedError, match="draws random numbers"):
        o.sum().backward()
    # where the dropout's output is not backpropagated, the hook is eager's
    hooked = []
    for fn in (f, jf):
        a.weight.grad = None
        o, h = fn(torch.ones(3, 4))
        h.register_hook(lambda g: g * 2)
        h.sum().backward()
        hooked.append(a.weight.grad.clone())
    torch.testing.assert_close(hooked[1], hooked[0])


def test_calls_without_read_outputs_have_no_node_of_their_own():
    """The common case pays nothing: every output's node is the call's one node."""
    a, b = _linears((4, 6), (6, 3))

    def f(x):
        h = torch.tanh(a(x))
        return b(h.detach()), h, h.sum(1).argmax()

    outputs = fulmen.jit(f)(torch.randn(3, 4))
    nodes = {type(o.grad_fn).__name__ for o in outputs if o.grad_fn is not None}
    assert nodes == {"FulmenAutogradFunctionBackward"}


@pytest.mark.slow
def test_hf_llama_hidden_states_equal_eager():
    """A tiny HF Llama with `output_hidden_states=True`: a training step's parameter gradients,
    and the gradient `retain_grad` keeps at a hidden state (read by the next layers and the
    loss), equal eager's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    jitted = fulmen.jit(model)
    results = []
    for fn in (model, jitted):
        model.zero_grad()
        out = fn(input_ids=ids, labels=ids, output_hidden_states=True)
        out.hidden_states[1].retain_grad()
        (out.loss + out.hidden_states[2].mean()).backward()
        results.append([out.hidden_states[1].grad,
                        *[p.grad.clone() for p in model.parameters()]])
    assert results[0][0] is not None
    _assert_same(results[1], results[0])
    assert fulmen.compile_stats(jitted).eager_calls == 0


def test_a_read_output_updated_in_place_after_the_call_equals_eager():
    """A hook on `h`, then `h.mul_(3)` and a hook on the new `h`: the stage reading `h` runs
    again from the inputs (the value it read is gone), the hooks see eager's gradients."""
    a, = _linears((4, 6))

    def f(x):
        h = a(x)
        return h.sum(1, keepdim=True) * h.detach().square(), h

    def observe(outputs, loss):
        seen = [None, None]
        outputs[1].register_hook(lambda g: (seen.__setitem__(0, g.clone()), g * 2)[1])
        outputs[1].mul_(3)
        outputs[1].register_hook(lambda g: (seen.__setitem__(1, g.clone()), g * 5)[1])
        (outputs[0].square().sum() + outputs[1].sum()).backward()
        return lambda: seen

    eager, compiled = _compare(f, list(a.parameters()), observe, lambda o: None)
    _assert_same(compiled, eager)
