"""`requires_grad_()` on a tensor made inside the compiled function (NOTE [fresh leaves]).

HF's wav2vec2-family feature encoders set `hidden_states.requires_grad = True` on a view of the
input while training, and MRA returns `torch.zeros_like(q).requires_grad_()`: such a fresh leaf
is compiled (its gradient is unobservable), as long as nothing observable depends on its graph;
otherwise the call runs eagerly.
"""

import pytest
import torch
import torch.nn as nn

import fulmen
from fulmen import NotYetSupportedError


class _FeatureEncoder(nn.Module):
    """The wav2vec2 feature encoder's pattern, with a fresh leaf added to the result."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 4, 3)

    def forward(self, x):
        hidden = x[:, None]
        if self.training:
            hidden.requires_grad = True
        hidden = self.conv(hidden)
        extra = torch.zeros_like(hidden).requires_grad_()
        assert hidden.requires_grad and extra.requires_grad and (extra * 2).requires_grad
        return (hidden + extra).sum(-1)


@pytest.mark.parametrize("training", [True, False])
def test_fresh_leaves_compile_with_eager_values_gradients_and_flags(training):
    torch.manual_seed(0)
    eager = _FeatureEncoder().train(training)
    compiled_module = _FeatureEncoder().train(training)
    compiled_module.load_state_dict(eager.state_dict())
    jitted = fulmen.jit(compiled_module, fullgraph=True)
    x = torch.randn(2, 9)
    for _ in range(2):  # the second call is a cache hit
        expected, actual = eager(x), jitted(x)
        torch.testing.assert_close(actual, expected)
        assert actual.requires_grad and actual.grad_fn is not None
        expected.sum().backward()
        actual.sum().backward()
        torch.testing.assert_close(compiled_module.conv.weight.grad, eager.conv.weight.grad)
    assert not x.requires_grad
    assert fulmen.compile_stats(jitted).cache_misses == 1


def test_fresh_leaf_under_no_grad_compiles():
    def fn(x):
        leaf = torch.zeros_like(x).requires_grad_()
        return (leaf + x).sum(0), leaf.requires_grad, (leaf * 2).requires_grad

    x = torch.randn(3, 2)
    with torch.no_grad():
        out, leaf_flag, product_flag = fulmen.jit(fn, fullgraph=True)(x)
    torch.testing.assert_close(out, x.sum(0))
    assert (leaf_flag, product_flag, out.requires_grad) == (True, False, False)


def _returns_graph_of_the_leaf(x):
    leaf = torch.zeros_like(x).requires_grad_()
    return leaf * x


def _updates_the_base(x):
    base = x * 2
    view = base[0]
    view.requires_grad_()
    base.add_(1)
    return view * 3


def _updates_a_value_of_it_under_no_grad(x):
    leaf = torch.zeros_like(x).requires_grad_()
    y = leaf * 2
    with torch.no_grad():
        y.add_(x)  # y still requires grad, and so does the result
    return y * 3


def _returns_the_leaf(w, x):
    leaf = torch.zeros_like(x).requires_grad_()
    return leaf, w * x


@pytest.mark.parametrize("fn, args", [
    (_returns_graph_of_the_leaf, lambda: (torch.randn(3),)),
    (_updates_the_base, lambda: (torch.randn(2, 3),)),
    (_updates_a_value_of_it_under_no_grad, lambda: (torch.randn(3),)),
    (_returns_the_leaf, lambda: (torch.randn(3, requires_grad=True), torch.randn(3))),
])
def test_observable_fresh_leaves_run_eagerly(fn, args):
    with pytest.raises(NotYetSupportedError, match="require"):
        fulmen.jit(fn, fullgraph=True)(*args())
    with pytest.warns(UserWarning, match="such calls run eagerly"):
        actual = fulmen.jit(fn)(*args())
    expected = fn(*args())
    for a, e in zip(actual if isinstance(actual, tuple) else (actual,),
                    expected if isinstance(expected, tuple) else (expected,)):
        assert a.requires_grad == e.requires_grad and a.is_leaf == e.is_leaf


def test_requires_grad_on_an_argument_still_runs_eagerly():
    x = torch.randn(3)
    with pytest.warns(UserWarning, match="requires_grad_"):
        out = fulmen.jit(lambda t: t.requires_grad_() * 2)(x)
    assert x.requires_grad and out.grad_fn is not None


@pytest.mark.parametrize("make", [
    lambda w: torch.zeros_like(w), lambda w: torch.ones_like(w), lambda w: torch.full_like(w, 2.0),
    lambda w: torch.empty_like(w).zero_(), lambda w: w.new_zeros(3), lambda w: w.new_ones(2, 3),
    lambda w: w.new_full((3,), 4.0), lambda w: torch.rand_like(w) * 0,
])
def test_tensors_made_like_one_requiring_grad_do_not_require_grad(make):
    """As in eager (MRA's `torch.zeros_like(q).requires_grad_()` is a fresh leaf, not a no-op)."""
    def fn(w):
        made = make(w)
        return made, made.requires_grad, (w * 2).sum()

    w = torch.randn(2, 3, requires_grad=True)
    made, flag, total = fulmen.jit(fn, fullgraph=True)(w)
    assert (made.requires_grad, flag, total.requires_grad) == (False, False, True)
    total.backward()
    torch.testing.assert_close(w.grad, torch.full_like(w, 2.0))


def _kaiming_filled(x):
    weight = torch.empty(3, 3)
    nn.init.kaiming_uniform_(weight, a=5 ** 0.5)  # hands the tensor over by keyword
    nn.init.zeros_(tensor=weight[0])
    return x @ weight


def _new_parameter_filled(x):
    weight = nn.Parameter(torch.empty(3, 3))  # a fresh leaf, filled under no_grad by nn.init
    nn.init.normal_(weight)
    return x @ weight.detach(), weight.requires_grad


def test_nn_init_of_tensors_made_inside_draws_as_eager():
    x = torch.randn(2, 3)
    for fn in (_kaiming_filled, _new_parameter_filled):
        jitted = fulmen.jit(fn, fullgraph=True)
        for _ in range(2):
            torch.manual_seed(0)
            expected, after_eager = fn(x), torch.rand(2)
            torch.manual_seed(0)
            actual, after = jitted(x), torch.rand(2)
            torch.testing.assert_close(actual, expected)
            torch.testing.assert_close(after, after_eager)  # the generator moved as in eager


def test_module_made_inside_the_forward_runs_eagerly():
    def fn(x):
        return nn.Linear(3, 2)(x)  # its output requires grad through the new parameters

    x = torch.randn(2, 3)
    torch.manual_seed(0)
    expected = fn(x)
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="such calls run eagerly"):
        actual = fulmen.jit(fn)(x)
    torch.testing.assert_close(actual, expected)
    assert actual.grad_fn is not None
