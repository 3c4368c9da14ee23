"""A custom `torch.autograd.Function` inside traced code is one op whose backward is the user's.

Each test compares a jitted function with eager over several calls, forward values and
gradients, and checks that the ctx features behave as in eager.
"""

import threading

import pytest
import torch

import fulmen
from fulmen.core import NotYetSupportedError


class StraightThroughRound(torch.autograd.Function):
    """Forward rounds; backward passes the gradient through (not the true derivative, 0)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaledMul(torch.autograd.Function):
    """`x * y * scale` with saved tensors, needs_input_grad and a non-tensor argument."""

    seen_needs: list = []

    @staticmethod
    def forward(ctx, x, y, scale):
        ctx.save_for_backward(x, y)
        ctx.scale = scale
        return x * y * scale

    @staticmethod
    def backward(ctx, grad):
        ScaledMul.seen_needs.append(tuple(ctx.needs_input_grad))
        x, y = ctx.saved_tensors
        gx = grad * y * ctx.scale * 2 if ctx.needs_input_grad[0] else None  # deliberately "wrong"
        gy = grad * x * ctx.scale if ctx.needs_input_grad[1] else None
        return gx, gy, None


def _compare(fn, make_inputs, calls=3, atol=1e-6):
    """Run `fn` eagerly and jitted on fresh inputs `calls` times; outputs and grads must match."""
    jfn = fulmen.jit(fn)
    for seed in range(calls):
        torch.manual_seed(seed)
        eager_inputs = make_inputs()
        jit_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in eager_inputs]
        expected = fn(*eager_inputs)
        actual = jfn(*jit_inputs)
        expected = expected if isinstance(expected, tuple) else (expected,)
        actual = actual if isinstance(actual, tuple) else (actual,)
        for e, a in zip(expected, actual):
            torch.testing.assert_close(a, e, atol=atol, rtol=1e-5)
            assert a.requires_grad == e.requires_grad
        loss_e = sum((o.float() * (i + 1)).sum() for i, o in enumerate(expected) if o.requires_grad)
        loss_a = sum((o.float() * (i + 1)).sum() for i, o in enumerate(actual) if o.requires_grad)
        if isinstance(loss_e, torch.Tensor):
            loss_e.backward()
            loss_a.backward()
        for e, a in zip(eager_inputs, jit_inputs):
            if e.requires_grad:
                torch.testing.assert_close(a.grad, e.grad, atol=atol, rtol=1e-5)
    return jfn


def test_backward_is_the_users_not_the_derivative_of_forward():
    def fn(x, w):
        return StraightThroughRound.apply(x * w).sin()

    jfn = _compare(fn, lambda: [(torch.randn(4, 8) * 3).requires_grad_(),
                                torch.randn(8, requires_grad=True)])
    assert "autograd_function.StraightThroughRound" in str(fulmen.last_traces(jfn)[0])


def test_a_trace_ending_in_another_thread_leaves_this_ones_apply_intercepted():
    """`Function.apply` is replaced while any trace records (`fulmen.tracer.patching`): a
    `fulmen.vjp` traced in another thread (it takes no lock) that ends while this thread's
    trace goes on must not put the original back, or the `apply` after it is traced through
    `forward` (`round`: no gradient at all, where the user's backward gives 3)."""
    started, other_done = threading.Event(), threading.Event()

    def fn(x):
        y = x * 3
        started.set()
        assert other_done.wait(timeout=60)
        return StraightThroughRound.apply(y).sum()

    def other():
        started.wait(timeout=60)
        try:
            fulmen.vjp(lambda z: (z * 2).sum(), torch.ones(3))  # (draws no random numbers)
        finally:
            other_done.set()

    x = torch.randn(4, requires_grad=True)
    started.set(), other_done.set()
    expected = torch.autograd.grad(fn(x), x)[0]
    started.clear(), other_done.clear()
    helper = threading.Thread(target=other)
    helper.start()
    try:
        actual = torch.autograd.grad(fulmen.jit(fn)(x), x)[0]
    finally:
        other_done.set()
        helper.join()
    torch.testing.assert_close(actual, expected)


def test_saved_tensors_needs_input_grad_and_constant_arguments():
    def fn(x, y):
        return ScaledMul.apply(x.exp(), y, 0.5).sum(dim=0)

    ScaledMul.seen_needs.clear()
    _compare(fn, lambda: [torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)])
    assert set(ScaledMul.seen_needs) == {(True, False, False)}  # eager and fulmen alike


class SortWithIndex(torch.autograd.Function):
    """Sorted values and their float positions; the positions are not differentiable."""

    @staticmethod
    def forward(ctx, x):
        values, indices = torch.sort(x, dim=-1)
        ctx.save_for_backward(indices)
        positions = indices.to(x.dtype)
        ctx.mark_non_differentiable(positions)
        return values, positions

    @staticmethod
    def backward(ctx, grad_values, grad_positions):
        (indices,) = ctx.saved_tensors
        return torch.zeros_like(grad_values).scatter(-1, indices, grad_values)


def test_mark_non_differentiable():
    def fn(x):
        values, positions = SortWithIndex.apply(x * 2)
        return values.cos(), positions

    _compare(fn, lambda: [torch.randn(4, 6, requires_grad=True)])


class TwoOutputs(torch.autograd.Function):
    """With `set_materialize_grads(False)` the unused output's gradient arrives as None."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_a, grad_b):
        TwoOutputs.seen.append((grad_a is None, grad_b is None))
        total = grad_a * 2 if grad_a is not None else None
        if grad_b is not None:
            total = grad_b * 3 if total is None else total + grad_b * 3
        return total


def test_set_materialize_grads_and_once_differentiable():
    def fn(x):
        a, _ = TwoOutputs.apply(x.tanh())
        return a

    TwoOutputs.seen.clear()
    _compare(fn, lambda: [torch.randn(5, requires_grad=True)], calls=2)
    assert TwoOutputs.seen == [(False, True)] * 4  # two eager calls, two fulmen calls


class SetupContextMul(torch.autograd.Function):
    """The new style: forward without ctx, `setup_context` saves."""

    @staticmethod
    def forward(x, y):
        return x * y

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y * 10, grad * x


def test_setup_context_style():
    _compare(lambda x, y: SetupContextMul.apply(x, y.sigmoid()) + 1,
             lambda: [torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)])


def test_inside_a_module_with_parameters():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return StraightThroughRound.apply(self.linear(x)).relu().sum()

    torch.manual_seed(0)
    model = Block()
    jmodel = fulmen.jit(model)
    x = torch.randn(4, 8) * 4
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for _ in range(2):
        jmodel(x).backward()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, 2 * e)


def test_under_no_grad():
    def fn(x):
        return StraightThroughRound.apply(x).exp()

    def inner_no_grad(x):
        with torch.no_grad():
            y = StraightThroughRound.apply(x)
        return y * x

    x = torch.randn(4, 4, requires_grad=True)
    jfn = fulmen.jit(fn)
    with torch.no_grad():
        torch.testing.assert_close(jfn(x), fn(x))
    # inside no_grad eager records no backward: the forward is traced inline
    jinner = fulmen.jit(inner_no_grad)
    torch.testing.assert_close(jinner(x), inner_no_grad(x))
    assert "autograd_function.StraightThroughRound" not in str(fulmen.last_traces(jinner)[0])
    expected = torch.autograd.grad(inner_no_grad(x).sum(), x)[0]
    torch.testing.assert_close(torch.autograd.grad(jinner(x).sum(), x)[0], expected)


def test_functional_grad_and_vjp_use_the_users_backward():
    def fn(x):
        return StraightThroughRound.apply(x * 2)

    x = torch.randn(5)
    torch.testing.assert_close(fulmen.grad(lambda t: fn(t).sum())(x), torch.full((5,), 2.0))
    _, vjp_fn = fulmen.vjp(fn, x)
    torch.testing.assert_close(vjp_fn(torch.ones(5))[0], torch.full((5,), 2.0))


def test_function_applied_to_a_closed_over_parameter():
    weight = torch.randn(6, requires_grad=True)

    def fn(x):
        return (StraightThroughRound.apply(weight * 3) * x).sum()

    expected = torch.autograd.grad(fn(torch.ones(6)), weight)[0]
    actual = torch.autograd.grad(fulmen.jit(fn)(torch.ones(6)), weight)[0]
    torch.testing.assert_close(actual, expected)


def test_random_forward_keeps_the_eager_stream():
    class NoisyIdentity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x + torch.rand_like(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    def fn(x):
        return NoisyIdentity.apply(x) * torch.rand_like(x)

    jfn = fulmen.jit(fn)
    x = torch.randn(16, requires_grad=True)
    torch.manual_seed(3)
    expected = fn(x)
    torch.manual_seed(3)
    actual = jfn(x)
    torch.testing.assert_close(actual, expected)


def test_autocast_inside_the_traced_function():
    class Matmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            return grad @ b.t().to(grad.dtype), a.t().to(grad.dtype) @ grad

    def fn(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = Matmul.apply(a, b)
        return out.float().sum(dim=0)

    _compare(fn, lambda: [torch.randn(4, 8, requires_grad=True),
                          torch.randn(8, 3, requires_grad=True)], atol=1e-2)


def test_forward_modifying_its_input_runs_eagerly():
    class AddOneInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x.add_(1)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    def fn(x):
        return AddOneInPlace.apply(x * 2)

    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="modifies its input"):
        out = fulmen.jit(fn)(x)
    torch.testing.assert_close(out, fn(x))
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    with pytest.raises(NotYetSupportedError, match="modifies its input"):
        fulmen.jit(fn, fullgraph=True)(x)


def test_forward_reading_a_traced_tensor_that_is_no_argument_runs_eagerly():
    def fn(x):
        scale = x.detach() * 2  # computed in the trace, closed over by forward

        class TimesScale(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a):
                return a * scale

            @staticmethod
            def backward(ctx, grad):
                return grad * scale

        return TimesScale.apply(x).sum()

    x = torch.randn(2, 3, requires_grad=True)
    with pytest.warns(UserWarning, match="not an argument of apply"):
        fulmen.jit(fn)(x).backward()
    got, x.grad = x.grad, None
    fn(x).backward()
    torch.testing.assert_close(got, x.grad)


def test_custom_op_with_register_autograd():
    @torch.library.custom_op("fulmen_test::scaled_sin", mutates_args=())
    def scaled_sin(x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.sin(x) * scale

    @scaled_sin.register_fake
    def _(x, scale):
        return torch.empty_like(x)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.scale = inputs[1]

    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.cos(x) * ctx.scale * 3, None  # not the true derivative

    scaled_sin.register_autograd(backward, setup_context=setup_context)
    _compare(lambda x: scaled_sin(x.exp(), 2.0).sum(dim=-1),
             lambda: [torch.randn(3, 4, requires_grad=True)])


def test_bloom_training_grads_equal_eager():
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4,
                                      hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config).train()
    ids = torch.randint(0, 128, (2, 8))
    model(ids, labels=ids).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    jmodel = fulmen.jit(model)
    for _ in range(2):
        model.zero_grad()
        jmodel(ids, labels=ids).loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_forward_reading_a_parameter_it_was_not_given_runs_as_eager():
    class UsesModule(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, module):
            return x @ module.weight.t()

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return UsesModule.apply(x, self.linear)

    # the module's parameters stay real tensors while tracing (fulmen.tracer.tracer), so apply
    # runs forward on the real weight at run time, as eager does (and, as in eager, the weight
    # gets no gradient through this op: backward returns None for the module)
    model = Model()
    x = torch.randn(2, 4, requires_grad=True)
    out = fulmen.jit(model)(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    expected = model(x)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad, torch.autograd.grad(expected.sum(), x)[0])


class GradientReversal(torch.autograd.Function):
    """Identity forward returning its input as is; negated, scaled gradient."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


def test_identity_forward_returning_its_input():
    def fn(x, w):
        features = x * w
        return (GradientReversal.apply(features, 0.5) * 3).sum() + features.sum()

    _compare(fn, lambda: [torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)])


def test_fulmen_grad_called_inside_a_compiled_function_runs_it_as_eager():
    """`fulmen.grad(g)(x)` met while tracing traced through `g`'s source and returned its value
    where the gradient was asked (`IndexError` at `[1]`); the call now runs eagerly."""
    def g(x):
        return (x.sin() * 2).sum()

    def outer(x):
        return (fulmen.grad(g)(x) + x).sum()

    x = torch.randn(4)
    with pytest.warns(UserWarning, match="fulmen.grad"):
        actual = fulmen.jit(outer)(x)
    torch.testing.assert_close(actual, outer(x))
