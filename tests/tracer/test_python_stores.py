"""Python values the traced code stores besides its arguments and modules: a global counter
(`global step; step += 1`), a list in a global, in a closure cell or in a default argument
(`acc=[]`) appended to. A compiled call does not repeat such a store, so these calls run
eagerly: before, a call with the counter reset came out of the cache without counting, and
an entry with symbolic sizes was keyed by the values the trace itself had stored, so every
later call took it and the counter stopped (`x * step` stayed 1)."""

import collections
import warnings

import pytest
import torch

import fulmen

STEP = 0
SEEN = []


def _counts_globally(x):
    global STEP
    STEP += 1
    return x * STEP


def _appends_globally(x):
    SEEN.append(1)
    return x * len(SEEN)


def _appends_to_a_default(x, acc=[]):  # noqa: B006 - the store under test
    acc.append(1)
    return x * len(acc)


def _closure_appender():
    seen = []

    def fn(x):
        seen.append(1)
        return x * len(seen)

    return fn, seen


def _counter(kind):
    """The function and a reader and a resetter of the state it stores."""
    global STEP
    if kind == "global int":
        STEP = 0
        return _counts_globally, lambda: STEP, lambda: globals().__setitem__("STEP", 0)
    if kind == "global list":
        SEEN.clear()
        return _appends_globally, lambda: len(SEEN), SEEN.clear
    if kind == "default list":
        acc = _appends_to_a_default.__defaults__[0]
        acc.clear()
        return _appends_to_a_default, lambda: len(acc), acc.clear
    fn, seen = _closure_appender()
    return fn, lambda: len(seen), seen.clear


KINDS = ["global int", "global list", "default list", "closure list"]


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("kind", KINDS)
def test_a_stored_counter_counts_every_call_as_in_eager(kind, dynamic):
    fn, count, _ = _counter(kind)
    jfn = fulmen.jit(fn, dynamic=dynamic)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [jfn(torch.ones(3))[0].item() for _ in range(4)]
    assert got == [1.0, 2.0, 3.0, 4.0] and count() == 4


@pytest.mark.parametrize("kind", KINDS)
def test_a_counter_reset_between_calls_counts_again_as_in_eager(kind):
    fn, count, reset = _counter(kind)
    jfn = fulmen.jit(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            reset()
            assert jfn(torch.ones(3))[0].item() == 1.0 and count() == 1


def test_a_store_runs_the_call_eagerly_with_a_warning_naming_it():
    fn, count, _ = _counter("global int")
    with pytest.warns(UserWarning, match="global name 'STEP'"):
        fulmen.jit(fn)(torch.ones(2))
    assert count() == 1  # the trace's store was put back: the eager run counted once
    with pytest.raises(fulmen.FulmenError, match="would not repeat the store"):
        fulmen.jit(fn, fullgraph=True)(torch.ones(2))


def test_a_forward_hook_counting_in_a_closure_counts_every_call_as_in_eager():
    """A hook on a submodule is traced with the forward: its `count[0] += 1` stayed at 1."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    count = [0]

    def scale_by_calls(module, args, out):
        count[0] += 1
        return out * count[0]

    model[0].register_forward_hook(scale_by_calls)
    jmodel, x = fulmen.jit(model), torch.ones(1, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [jmodel(x) for _ in range(3)]
    assert count == [3]
    count[0] = 0
    torch.testing.assert_close(got, [model(x) for _ in range(3)])


class _Instantiating(collections.OrderedDict):
    """HF's `ACT2FN`: reading an item makes an instance of the class stored there."""

    def __getitem__(self, key):
        return super().__getitem__(key)()


ACTIVATIONS = _Instantiating(relu=torch.nn.ReLU)


def _activates(x):
    return ACTIVATIONS["relu"](x) * 2


def test_a_global_mapping_that_instantiates_on_read_is_no_store():
    """Snapshots read a dict subclass's storage, not its `__getitem__`: each read of `ACT2FN`
    is a new instance, which counted as a store (every HF model ran eagerly) and putting it
    back stored the instances."""
    jfn, x = fulmen.jit(_activates), torch.randn(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            torch.testing.assert_close(jfn(x), _activates(x))
    assert dict.__getitem__(ACTIVATIONS, "relu") is torch.nn.ReLU
    assert fulmen.compile_stats(jfn).cache_hits == 1
