"""A store into a list or dict argument is refused with a clear error, never silently dropped
(the traced code sees copies rebuilt around the proxies)."""

import pytest
import torch

import fulmen


def _grow(x, cache):
    cache.append(x * 1)
    return x.sum()


def test_append_to_a_list_argument_is_refused():
    cache = []
    with pytest.raises(fulmen.NotYetSupportedError, match="list or dict passed as"):
        fulmen.jit(_grow)(torch.ones(2), cache)
    assert cache == []  # no proxy leaks into the user's list


def test_item_store_into_a_dict_argument_is_refused():
    def fn(x, state):
        state["h"] = x + 1
        return x

    with pytest.raises(fulmen.NotYetSupportedError):
        fulmen.jit(fn)(torch.ones(2), {"h": torch.zeros(2)})


def test_reading_list_and_dict_arguments_is_fine():
    jfn = fulmen.jit(lambda xs, d: xs[0] * d["a"])
    torch.testing.assert_close(jfn([torch.ones(2)], {"a": torch.full((2,), 3.0)}),
                               torch.full((2,), 3.0))
