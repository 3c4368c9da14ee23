"""executors/torch/inplace.py: a relu overwrites a matrix product's output nothing else reads."""

import pytest
import torch
import torch.nn.functional as F

import fulmen


@pytest.fixture(autouse=True)
def _default_fusion_policy(monkeypatch):
    """The default policy (the suite fuses tiny regions): these small relus stay on torch."""
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")


def _linear_relu(layers: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        modules += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules)


def _last_trace(jfn) -> str:
    return str(fulmen.last_traces(jfn)[-1])


def test_linear_relu_runs_relu_in_place_with_eagers_values():
    model = _linear_relu()
    jmodel = fulmen.jit(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(jmodel(x), model(x), rtol=0, atol=0)
    assert _last_trace(jmodel).count("relu_(") == 3


def test_linear_relu_training_gradients_equal_eagers():
    """The forward (inside the autograd bridge) relus in place; the relu's backward reads its
    own output, so gradients are eager's."""
    model = _linear_relu()
    jmodel = fulmen.jit(model)
    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(model(x).pow(2).sum(), [x, *model.parameters()])
    actual = torch.autograd.grad(jmodel(x).pow(2).sum(), [x, *model.parameters()])
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    assert "relu_(" in _last_trace(jmodel)


def test_a_product_read_again_or_returned_is_not_overwritten():
    """A product that another statement reads (here a view taken before the relu) or that is
    returned keeps its values: the relu stays out of place."""
    w = torch.randn(8, 8)

    def viewed(x):
        y = F.linear(x, w)
        flat = y.view(-1)
        return F.relu(y), flat * 2

    def returned(x):
        y = F.linear(x, w)
        return F.relu(y), y

    x = torch.randn(4, 8)
    for fn in (viewed, returned):
        jfn = fulmen.jit(fn)
        for a, e in zip(jfn(x), fn(x)):
            torch.testing.assert_close(a, e, rtol=0, atol=0)
        assert "relu_(" not in _last_trace(jfn)
