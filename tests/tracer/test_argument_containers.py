"""Stores into list and dict arguments (append, item store, pop): `fulmen.jit` replays them on
the caller's container after every compiled call (NOTE [argument container stores]); where the
traced copies cannot behave as eager's one object such calls run eagerly (session 52; refused
with a clear error under fullgraph=True, as for callers without an epilogue), never silently
dropped."""

import pytest
import torch

import fulmen


def _grow(x, cache):
    cache.append(x * 1)
    return x.sum()


def _run_both(fn, make_args, calls=3):
    """Call `fn` eagerly and jitted on twin arguments; return both argument sets."""
    jfn = fulmen.jit(fn, executors=["torch"])
    eager_args, jit_args = make_args(), make_args()
    for i in range(calls):
        x = torch.full((2,), float(i))
        torch.testing.assert_close(jfn(x, *jit_args), fn(x, *eager_args))
    return eager_args, jit_args, jfn


def test_append_to_a_list_argument_is_replayed():
    eager, got, _ = _run_both(_grow, lambda: ([],))
    assert len(got[0]) == len(eager[0]) == 3
    for a, b in zip(got[0], eager[0]):
        torch.testing.assert_close(a, b)


def test_item_store_and_pop_on_a_dict_argument_are_replayed():
    def fn(x, state):
        state["h"] = state["h"] * 0.5 + x
        state.pop("drop", None)
        state["n"] = state.get("n", 0) + 1
        return state["h"].sum()

    eager, got, _ = _run_both(fn, lambda: ({"h": torch.ones(2), "drop": 1},))
    assert got[0].keys() == eager[0].keys() == {"h", "n"}
    assert got[0]["n"] == eager[0]["n"] == 3
    torch.testing.assert_close(got[0]["h"], eager[0]["h"])


def test_replayed_items_keep_the_callers_objects():
    def fn(x, cache):
        cache.append(x)  # the argument tensor itself, as in eager
        return x * 2

    inner = [torch.zeros(2)]
    cache = [inner]
    x = torch.ones(2)
    fulmen.jit(fn, executors=["torch"])(x, cache)
    assert cache[0] is inner and cache[1] is x  # unchanged items, argument tensors: same objects


def test_a_nested_list_is_changed_in_place():
    def fn(x, cache):
        cache[0].append(x * 3)
        return x

    layer = []
    cache = [layer]
    fulmen.jit(fn, executors=["torch"])(torch.ones(2), cache)
    assert cache[0] is layer and len(layer) == 1
    torch.testing.assert_close(layer[0], torch.full((2,), 3.0))


def test_gradients_flow_through_a_stored_tensor():
    w = torch.randn(2, requires_grad=True)

    def fn(x, cache):
        cache.append(x * w)
        return x.sum()

    got, want = [], []
    fulmen.jit(fn)(torch.ones(2), got)
    fn(torch.ones(2), want)
    (g,) = torch.autograd.grad(got[0].square().sum(), w)
    (e,) = torch.autograd.grad(want[0].square().sum(), w)
    torch.testing.assert_close(g, e)


def test_stores_replayed_across_a_graph_break():
    def fn(x, cache):
        cache.append(x + 1)
        if x.sum() > 0:  # a graph break
            cache.append(x * 2)
        return x

    jfn = fulmen.jit(fn, executors=["torch"])
    for value in (1.0, -1.0):
        got, want = [], []
        x = torch.full((2,), value)
        jfn(x, got)
        fn(x, want)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_a_changed_list_passed_twice_is_refused():
    shared = []
    with pytest.raises(fulmen.NotYetSupportedError, match="also passed elsewhere"):
        fulmen.jit(lambda x, a, b: _grow(x, a), fullgraph=True)(torch.ones(2), shared, shared)
    assert shared == []


def test_a_changed_list_that_is_returned_is_refused():
    def fn(x, cache):
        cache.append(x * 1)
        return cache

    cache = []
    with pytest.raises(fulmen.NotYetSupportedError, match="and returns it"):
        fulmen.jit(fn, fullgraph=True)(torch.ones(2), cache)
    assert cache == []


def test_a_changed_list_returned_inside_a_tuple_is_refused():
    """Eager returns the caller's very list inside the tuple (the refusal is found by walking
    the output, not only by its top)."""
    def fn(x, cache):
        cache.append(x * 1)
        return x + 1, cache

    cache = []
    with pytest.raises(fulmen.NotYetSupportedError, match="and returns it"):
        fulmen.jit(fn, fullgraph=True)(torch.ones(2), cache)
    assert cache == []


def test_a_changed_dict_subclass_is_refused():
    import collections

    def fn(x, state):
        state["h"] = x + 1
        return x

    state = collections.OrderedDict(h=torch.zeros(2))
    with pytest.raises(fulmen.NotYetSupportedError, match="OrderedDict"):
        fulmen.jit(fn, fullgraph=True)(torch.ones(2), state)
    torch.testing.assert_close(state["h"], torch.zeros(2))


def test_vjp_refuses_a_store_it_would_not_repeat():
    cache = []
    with pytest.raises(fulmen.NotYetSupportedError, match="list or dict passed as"):
        fulmen.vjp(_grow, torch.ones(2), cache)
    assert cache == []


def test_reading_list_and_dict_arguments_is_fine():
    jfn = fulmen.jit(lambda xs, d: xs[0] * d["a"])
    torch.testing.assert_close(jfn([torch.ones(2)], {"a": torch.full((2,), 3.0)}),
                               torch.full((2,), 3.0))
