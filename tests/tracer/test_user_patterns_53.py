"""User patterns probed in session 53 (h53probe), each compared with eager:

- torch's global modes set by a bare call inside a jitted function (`torch.set_grad_enabled(
  False)` not used as a context manager, `torch.set_default_dtype`). Eager leaves the mode
  changed after every call; a compiled call did not repeat the call, so from the second call on
  the caller's mode was kept (and a function called under `no_grad` that turned grad on
  returned a result requiring grad). Such calls run eagerly; modes put back are compiled.
- a global or closure cell rebound to another `nn.Module` (`MODEL = build()`): the compiled
  call ran the old module.
- an `autograd.Function` recomputing its forward in the backward through a closure over the
  module whose parameters it saved (a hand-written checkpoint): it was given copies of the
  parameters, so `autograd.grad` raised or (`allow_unused=True`) their gradients were lost."""

import copy

import pytest
import torch

import fulmen


@pytest.fixture(autouse=True)
def _modes_kept():
    grad, dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    yield
    torch.set_grad_enabled(grad)
    torch.set_default_dtype(dtype)


def _grad_off(x, w):
    torch.set_grad_enabled(False)
    return x @ w


def _grad_on_at_the_end(x, w):
    y = x @ w
    torch.set_grad_enabled(True)
    return y * 2


@pytest.mark.parametrize("fn,start", [(_grad_off, True), (_grad_on_at_the_end, False)])
def test_a_bare_set_grad_enabled_leaves_eagers_grad_mode_on_every_call(fn, start):
    x, w = torch.randn(3, 3), torch.randn(3, 3, requires_grad=True)
    jitted = fulmen.jit(fn)
    for _ in range(3):
        answers = []
        for call in (fn, jitted):
            torch.set_grad_enabled(start)
            out = call(x, w)
            answers.append((out.detach(), out.requires_grad, torch.is_grad_enabled()))
        (want, want_grad, want_mode), (got, got_grad, got_mode) = answers
        torch.testing.assert_close(got, want)
        assert (got_grad, got_mode) == (want_grad, want_mode)
        assert want_mode != start  # the function changed the mode
    assert fulmen.compile_stats(jitted).eager_calls == 3


def _double_precision_ones(x):
    torch.set_default_dtype(torch.float64)
    return x + torch.ones(3)


def test_a_set_default_dtype_inside_leaves_eagers_default_on_every_call():
    jitted = fulmen.jit(_double_precision_ones)
    for _ in range(3):
        answers = []
        for call in (_double_precision_ones, jitted):
            torch.set_default_dtype(torch.float32)
            out = call(torch.ones(3))
            answers.append((out, torch.get_default_dtype()))
        (want, want_default), (got, got_default) = answers
        torch.testing.assert_close(got, want)
        assert got_default == want_default == torch.float64


def _modes_put_back(x, w):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    scale = torch.tensor(2.0).to(x.dtype)
    torch.set_default_dtype(previous)
    with torch.set_grad_enabled(False):
        norm = (x @ w).norm()
    torch.set_grad_enabled(False)
    torch.set_grad_enabled(True)
    return x @ w * scale / norm


def test_modes_changed_and_put_back_inside_compile():
    x, w = torch.randn(3, 3), torch.randn(3, 3, requires_grad=True)
    w2 = w.detach().clone().requires_grad_()
    jitted = fulmen.jit(_modes_put_back)
    for _ in range(2):
        want, got = _modes_put_back(x, w), jitted(x, w2)
        torch.testing.assert_close(got, want)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(w2.grad, w.grad)
    stats = fulmen.compile_stats(jitted)
    assert stats.eager_calls == 0  # (a second compile: the key of `w` then holds its `.grad`)
    assert stats.cache_misses <= 2


# --- a global or closure cell rebound to another module ---

MODEL = torch.nn.Linear(4, 2)


def _predict(x):
    return MODEL(x).softmax(-1)


def _answers(jitted, fn, x):
    return [(jitted(x), fn(x))]


def test_a_jitted_function_follows_its_global_model_rebound():
    """`MODEL = build()` after compiling: the compiled call ran the old model (its parameters
    are read from the module object the trace reached, whose state had not changed)."""
    global MODEL
    old = MODEL
    try:
        torch.manual_seed(0)
        MODEL = torch.nn.Linear(4, 2)
        jitted = fulmen.jit(_predict)
        x = torch.randn(3, 4)
        pairs = _answers(jitted, _predict, x)
        MODEL = torch.nn.Linear(4, 2)  # same sizes: only the binding tells them apart
        pairs += _answers(jitted, _predict, x)
        MODEL = torch.nn.Linear(4, 5)
        pairs += _answers(jitted, _predict, x) + _answers(jitted, _predict, x)
        for got, want in pairs:
            torch.testing.assert_close(got, want)
        stats = fulmen.compile_stats(jitted)
        assert stats.eager_calls == 0 and stats.cache_hits >= 1
    finally:
        MODEL = old


def test_a_jitted_function_follows_its_closure_model_rebound():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def predict(x):
        return model(x).softmax(-1)

    jitted = fulmen.jit(predict)
    x = torch.randn(3, 4)
    pairs = _answers(jitted, predict, x)
    model[2] = torch.nn.Linear(8, 5)  # a submodule swapped: watched already
    pairs += _answers(jitted, predict, x)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    pairs += _answers(jitted, predict, x) + _answers(jitted, predict, x)
    for got, want in pairs:
        torch.testing.assert_close(got, want)
    assert fulmen.compile_stats(jitted).eager_calls == 0


# --- an autograd.Function that recomputes its forward in the backward ---


class _Recompute(torch.autograd.Function):
    """A hand-written activation checkpoint: the forward runs `fn` without a graph and saves
    the input and the parameters `fn` reads; the backward runs `fn` again with grad and
    differentiates it with respect to them (the parameters reached through `fn`'s closure are
    the ones saved)."""

    @staticmethod
    def forward(ctx, fn, allow_unused, x, *params):
        ctx.fn, ctx.allow_unused = fn, allow_unused
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            out = ctx.fn(x)
        grads = torch.autograd.grad(out, (x, *params), grad, allow_unused=ctx.allow_unused)
        return (None, None, *grads)


class _Checkpointed(torch.nn.Module):
    def __init__(self, allow_unused: bool):
        super().__init__()
        self.allow_unused = allow_unused
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return _Recompute.apply(self._block, self.allow_unused, x, *self.proj.parameters())

    def _block(self, x):
        return torch.nn.functional.gelu(self.proj(x))


@pytest.mark.parametrize("allow_unused", [False, True])
def test_a_function_recomputing_through_its_modules_parameters_trains_as_eager(allow_unused):
    """The compiled call handed the Function detached copies of the parameters: the backward's
    graph (built from the module's own parameters) did not reach them, so `autograd.grad`
    raised, or with `allow_unused=True` the parameters silently got no gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Checkpointed(allow_unused), _Checkpointed(allow_unused))
    twin = copy.deepcopy(model)
    jitted = fulmen.jit(twin)
    for _ in range(2):
        x = torch.randn(4, 8, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        want, got = model(x), jitted(x2)
        torch.testing.assert_close(got, want)
        want.pow(2).sum().backward()
        got.pow(2).sum().backward()
        torch.testing.assert_close(x2.grad, x.grad)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert q.grad is not None, name
            torch.testing.assert_close(q.grad, p.grad)
    assert fulmen.compile_stats(jitted).eager_calls == 0


class _Bilinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


def test_a_parameter_hook_runs_once_beside_a_custom_function():
    """A parameter with a tensor hook is still given to the Function as a copy: the hook runs
    once per backward, as in eager."""
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    weights[1].data.copy_(weights[0].data)
    calls = [0, 0]
    for index, w in enumerate(weights):
        w.register_hook(lambda g, index=index: calls.__setitem__(index, calls[index] + 1) or g * 2)

    def fn(x, w):
        return _Bilinear.apply(x, w).relu()

    jitted = fulmen.jit(fn)
    x = torch.randn(2, 4)
    for _ in range(2):
        fn(x, weights[0]).sum().backward()
        jitted(x, weights[1]).sum().backward()
        torch.testing.assert_close(weights[1].grad, weights[0].grad)
    assert calls == [2, 2]
    assert fulmen.compile_stats(jitted).eager_calls == 0
