"""The per-call fast paths of the cache key (issue 21): positional tensor arguments keyed through
a C++ check of the last call's (`key_memo.ArgumentKeyMemo`) and the sources checked by one
generated expression (`source_reads` NOTE [unchanged sources]). Each test makes several cache
hits first (so the fast paths hold the last call's key), then one kind of change the full key
sees, and checks that the call misses the cache and answers as eager does."""

import pytest
import torch

import fulmen


def _hits(jfn, *args, calls: int = 3):
    for _ in range(calls):
        jfn(*args)


# --- positional tensor arguments (`ArgumentKeyMemo`) -----------------------------------------

def _scaled(x):
    return x * 2 + 1


ARGUMENT_CHANGES = {
    "dtype": lambda x: x.double(),
    "shape": lambda x: torch.randn(5, 3),
    "strides": lambda x: torch.randn(3, 4).t(),
    "a Parameter of the same metadata": lambda x: torch.nn.Parameter(x.clone(),
                                                                     requires_grad=False),
}


@pytest.mark.parametrize("change", list(ARGUMENT_CHANGES))
def test_an_argument_metadata_change_after_hits_retraces(change):
    jfn = fulmen.jit(lambda x: x.stride(0) * _scaled(x) + float(isinstance(x, torch.nn.Parameter)))
    x = torch.randn(4, 3)
    _hits(jfn, x)
    misses = fulmen.cache_misses(jfn)
    y = ARGUMENT_CHANGES[change](x)
    expected = y.stride(0) * _scaled(y) + float(isinstance(y, torch.nn.Parameter))
    torch.testing.assert_close(jfn(y), expected)
    assert fulmen.cache_misses(jfn) == misses + 1


def test_requires_grad_flipped_on_an_argument_after_hits():
    jfn = fulmen.jit(_scaled)
    x = torch.randn(4)
    _hits(jfn, x)
    x.requires_grad_(True)
    out = jfn(x)
    assert out.requires_grad
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))


@pytest.mark.filterwarnings("ignore:fulmen. Tensor.grad")
def test_a_grad_gained_by_an_argument_after_hits_is_seen():
    """A leaf requiring grad is keyed by its `.grad` too: the C++ check sees no change when a
    `.grad` appears, so such arguments are never remembered."""

    def fn(x):
        return x * 2 if x.grad is None else x * 2 + x.grad

    jfn = fulmen.jit(fn)
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        _hits(jfn, x)
        assert fulmen.compile_stats(jfn).eager_calls == 0  # (the hits ran compiled)
        x.grad = torch.ones(4)
        torch.testing.assert_close(jfn(x), fn(x))
        x.grad = None
        torch.testing.assert_close(jfn(x), fn(x))


def test_the_same_tensor_passed_twice_after_hits_of_two():
    jfn = fulmen.jit(lambda a, b: a * 3 if a is b else a - b)
    x, y = torch.randn(4), torch.randn(4)
    _hits(jfn, x, y)
    torch.testing.assert_close(jfn(x, x), x * 3)


def test_grad_mode_and_autocast_after_hits():
    jfn = fulmen.jit(lambda x, w: x @ w)
    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    with torch.no_grad():
        _hits(jfn, x, w)
    assert jfn(x, w).requires_grad  # grad mode on again
    with torch.no_grad():
        _hits(jfn, x, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert jfn(x, w).dtype == torch.bfloat16


# --- modules: the sources (`read.unchanged`) and the state ----------------------------------

class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = 2.0

    def forward(self, x):
        y = self.lin(x) * self.scale * (2.0 if self.training else 3.0)
        y = y * (5.0 if self.lin.training else 7.0)
        return y * getattr(self, "temperature", 1.0) + getattr(self.lin, "shift", 0.0)


MODULE_CHANGES = {
    "eval()": lambda m: m.eval(),
    "a submodule's training flag": lambda m: setattr(m.lin, "training", False),
    "an attribute rebound": lambda m: setattr(m, "scale", 5.0),
    "an attribute added": lambda m: setattr(m, "temperature", 0.5),
    "a submodule's attribute added": lambda m: setattr(m.lin, "shift", 1.5),
    "a weight replaced in its slot": lambda m: m.lin._parameters.__setitem__(
        "weight", torch.nn.Parameter(torch.randn(4, 4))),
    "a weight's dtype": lambda m: m.double(),
    "a weight's requires_grad": lambda m: m.lin.weight.requires_grad_(False),
    "a weight updated in place": lambda m: m.lin.weight.data.mul_(3.0),
}


@pytest.mark.parametrize("change", list(MODULE_CHANGES))
def test_a_module_change_after_hits_answers_as_eager(change):
    torch.manual_seed(0)
    model = _Scaled()
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 4)
    _hits(jmodel, x)
    MODULE_CHANGES[change](model)
    x = x.to(model.lin.weight.dtype)
    torch.testing.assert_close(jmodel(x), model(x))


def test_eval_after_hits_turns_dropout_off():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.9))
    jmodel = fulmen.jit(model)
    x = torch.randn(64, 4)
    with torch.no_grad():
        _hits(jmodel, x)
        model.eval()
        torch.testing.assert_close(jmodel(x), model(x))


class _ClassScaled(_Scaled):
    scale = 0.25  # (what `self.scale` reads once the instance's own is deleted)


def test_an_attribute_deleted_and_another_added_after_hits():
    """The module's attribute count stays; the deleted one is gone from its `__dict__`."""
    model = _ClassScaled()
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        _hits(jmodel, x)
        count = len(vars(model))
        del model.scale
        model.temperature = 7.0
        assert len(vars(model)) == count
        torch.testing.assert_close(jmodel(x), model(x))


def test_a_closure_cell_and_a_global_after_hits():
    factor = [2.0]

    def make(value):
        def fn(x):
            return x * value + GLOBAL_SHIFT
        return fn

    global GLOBAL_SHIFT
    GLOBAL_SHIFT = 1.0
    jfn = fulmen.jit(make(factor[0]))
    x = torch.randn(4)
    _hits(jfn, x)
    GLOBAL_SHIFT = 5.0
    torch.testing.assert_close(jfn(x), x * 2.0 + 5.0)
    jfn.__wrapped__.__closure__[0].cell_contents = 3.0
    torch.testing.assert_close(jfn(x), x * 3.0 + 5.0)


GLOBAL_SHIFT = 1.0


def test_the_fast_paths_are_taken_on_hits():
    """Not vacuous: after a hit the argument check and the sources check are what answers."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        _hits(jmodel, x)
        guard = jmodel._jit._guard
        assert guard._read_sources.unchanged()
        assert guard._argument_memo.keys((x,)) is guard._argument_memo.keys((x,))
        assert fulmen.compile_stats(jmodel).eager_calls == 0
