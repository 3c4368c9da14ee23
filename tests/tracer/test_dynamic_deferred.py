"""`FULMEN_DYNAMIC=defer` (NOTE [a deferred first call] in `fulmen/tracer/shape_policy.py`):
the first call runs eagerly and records its shapes, so a sweep of shapes compiles once; every
result is eager's. Default jitting still compiles the first call."""

import warnings

import pytest
import torch

import fulmen


def _program(x, w):
    h = torch.nn.functional.gelu(x @ w)
    return h.softmax(-1) * x.shape[1] + h.sum(0, keepdim=True)


@pytest.fixture
def deferred(monkeypatch):
    monkeypatch.setenv("FULMEN_DYNAMIC", "defer")


def test_a_sweep_of_shapes_compiles_once_after_an_eager_first_call(deferred):
    jfn = fulmen.jit(_program)
    w = torch.randn(4, 6)
    x = torch.randn(1, 5, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deferred call warns of nothing
        torch.testing.assert_close(jfn(x, w), _program(x, w))
    stats = fulmen.compile_stats(jfn)
    assert (stats.eager_calls, stats.cache_misses, fulmen.last_traces(jfn)) == (1, 0, [])
    for shape in ((1, 8, 4), (2, 5, 4), (4, 11, 4), (1, 5, 4), (3, 3, 4)):
        x = torch.randn(shape)
        torch.testing.assert_close(jfn(x, w), _program(x, w))
    # the second call's sizes differ from the recorded first's: symbolic, batch of 1 included
    assert fulmen.cache_misses(jfn) == 1 and stats.eager_calls == 1
    assert '"cpu f32[s' in str(fulmen.last_traces(jfn)[0])


def test_a_repeated_shape_compiles_for_its_exact_sizes(deferred):
    jfn = fulmen.jit(_program)
    x, w = torch.randn(2, 5, 4), torch.randn(4, 6)
    for _ in range(3):
        torch.testing.assert_close(jfn(x, w), _program(x, w))
    assert fulmen.cache_misses(jfn) == 1 and fulmen.compile_stats(jfn).eager_calls == 1
    assert '"cpu f32[2, 5, 4]"' in str(fulmen.last_traces(jfn)[0])


def test_training_calls_deferred_give_eagers_gradients(deferred):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    twin.load_state_dict(model.state_dict())
    jitted = fulmen.jit(model)
    for length in (3, 7, 5):
        x = torch.randn(2, length, 4)
        jitted(x).square().mean().backward()
        twin(x).square().mean().backward()
    for ours, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert fulmen.cache_misses(jitted) == 1 and fulmen.compile_stats(jitted).eager_calls == 1


def test_fullgraph_and_functional_grad_compile_the_first_call(deferred):
    x, w = torch.randn(2, 5, 4), torch.randn(4, 6)
    jfn = fulmen.jit(_program, fullgraph=True)  # an eager run would skip its break errors
    torch.testing.assert_close(jfn(x, w), _program(x, w))
    assert fulmen.cache_misses(jfn) == 1 and fulmen.compile_stats(jfn).eager_calls == 0
    grad = fulmen.grad(lambda x, w: _program(x, w).sum(), argnums=1)  # no eager answer
    expected = torch.func.grad(lambda x, w: _program(x, w).sum(), argnums=1)(x, w)
    torch.testing.assert_close(grad(x, w), expected)  # (an eager run returns the value)


def test_the_default_compiles_the_first_call(monkeypatch):
    monkeypatch.delenv("FULMEN_DYNAMIC", raising=False)
    jfn = fulmen.jit(_program)
    x, w = torch.randn(2, 5, 4), torch.randn(4, 6)
    torch.testing.assert_close(jfn(x, w), _program(x, w))
    assert fulmen.cache_misses(jfn) == 1 and fulmen.compile_stats(jfn).eager_calls == 0
