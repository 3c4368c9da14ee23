"""Stores a jitted forward makes on its modules (`fulmen.tracer.module_stores`): constants are
replayed after every compiled call, as eager's forward makes them; the rest is refused."""

import copy
import types

import pytest
import torch

import fulmen
from fulmen.core import NotYetSupportedError


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.calls = 0
        self.history = []
        self.mode = "first"

    def forward(self, x):
        self.calls += 1
        self.history.append(self.calls)
        self.last_shape = tuple(x.shape)
        y = self.linear(x) * self.calls
        if self.mode == "later":
            y = y + 1
        self.mode = "later"
        return y


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Counting()

    def forward(self, x):
        return self.inner(x).relu()


def test_constants_stored_by_the_forward_are_stored_by_every_compiled_call():
    """A call counter, a history list and a mode flag on a submodule: once silently reverted
    after tracing, so every compiled call saw the first call's values."""
    model = _Outer()
    jmodel = fulmen.jit(copy.deepcopy(model))
    for step in range(4):
        x = torch.randn(2 + step % 2, 3)
        torch.testing.assert_close(jmodel(x), model(x))
        compiled, eager = jmodel._orig_mod.inner, model.inner
        assert (compiled.calls, compiled.history, compiled.mode, compiled.last_shape) == \
            (eager.calls, eager.history, eager.mode, eager.last_shape)
    # the compiled path, not an eager fallback: `last_shape` holds symbolic sizes from the second
    # shape on (a symbolic size stored made every such call run eagerly)
    assert fulmen.compile_stats(jmodel).eager_calls == 0


class _StoresObject(torch.nn.Module):
    def forward(self, x):
        self.seen = object()
        return x * 2


class _StoresWithBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.positive = None

    def forward(self, x):
        self.positive = bool(x.sum() > 0)
        return x * 2


class _CountsWithBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * 2 if x.sum() > 0 else x * 3


class _InitializesWithBreak(torch.nn.Module):
    """A lazy one-time initialisation in a forward with a graph break (HF installs its
    output-capturing hooks so)."""

    def forward(self, x):
        if not getattr(self, "_ready", False):
            self._ready = True
        return x * 2 if x.sum() > 0 else x * 3


@pytest.mark.parametrize("make", [_StoresWithBreak, _CountsWithBreak, _InitializesWithBreak])
def test_stores_in_a_program_with_graph_breaks_are_made_as_in_eager(make):
    # was refused; the store may differ per path: a path that stores runs eagerly
    model, eager = make(), make()
    jitted = fulmen.jit(model)
    for step in range(6):
        x = torch.full((3,), 1.0 if step % 3 else -1.0)
        torch.testing.assert_close(jitted(x), eager(x))
        assert vars(model).get("positive") == vars(eager).get("positive")
        assert vars(model).get("calls") == vars(eager).get("calls")
        assert vars(model).get("_ready") == vars(eager).get("_ready")


def test_stores_that_cannot_be_replayed_run_eagerly_and_are_refused_under_fullgraph():
    model = _StoresObject()
    with pytest.raises(NotYetSupportedError, match="'seen'"):
        fulmen.jit(model, fullgraph=True)(torch.randn(3))
    assert not hasattr(model, "seen")  # tracing left the module as it was
    eager, x = _StoresObject(), torch.randn(3)
    with pytest.warns(UserWarning, match="'seen'"):
        torch.testing.assert_close(fulmen.jit(model)(x), eager(x))
    assert type(model.seen) is type(eager.seen)


class _Toggling(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(mode="a")
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, x):
        y = self.linear(x) * (2.0 if self.config.mode == "a" else 3.0)
        self.config.mode = "b" if self.config.mode == "a" else "a"
        return y


def test_a_store_into_a_config_object_is_repeated_on_cache_hits():
    """The mode alternates: from the third call on, every call hits a compiled program; the
    store into the module's config object must happen on those calls too."""
    model = _Toggling()
    jmodel = fulmen.jit(copy.deepcopy(model))
    x = torch.ones(1, 2)
    for _ in range(5):
        torch.testing.assert_close(jmodel(x), model(x))
        assert jmodel._orig_mod.config.mode == model.config.mode
    assert fulmen.cache_misses(jmodel) == 2


class _CountsRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(rows=0)

    def forward(self, x):
        self.config.rows = x.shape[0]
        return x * 2


def test_a_symbolic_size_stored_into_a_config_object_is_the_calls_size():
    # was left there as the symbol itself (`s77`) from the second batch size on: neither
    # replayed nor refused; such a call runs eagerly now
    model, eager = _CountsRows(), _CountsRows()
    jmodel = fulmen.jit(model)
    for rows in (3, 4, 5):
        torch.testing.assert_close(jmodel(torch.ones(rows, 2)), eager(torch.ones(rows, 2)))
        assert type(model.config.rows) is int and model.config.rows == eager.config.rows == rows
