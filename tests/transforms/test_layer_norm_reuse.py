"""transforms/layer_norm_reuse.py: a CPU backward takes the layer norm output it recomputes
from the `native_layer_norm` call it makes for the statistics."""

import pytest
import torch

import fulmen


@pytest.fixture(autouse=True)
def _default_fusion_policy(monkeypatch):
    monkeypatch.setenv("FULMEN_FUSE_TINY", "0")


class TwoNorms(torch.nn.Module):
    """Two layer norms of one input (different weights), each read by a linear: the backward
    recomputes both outputs for the linears' weight gradients."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm_a, self.norm_b = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
        self.fc_a, self.fc_b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        with torch.no_grad():
            for norm in (self.norm_a, self.norm_b):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return torch.tanh(self.fc_a(self.norm_a(x))) * self.fc_b(self.norm_b(x))


def _backward_statements(jfn) -> list[str]:
    lines = str(fulmen.last_backward_traces(jfn)[-1]).splitlines()
    return [line for line in lines if not line.lstrip().startswith("#")]


def test_each_recomputed_layer_norm_is_its_statistics_calls_output():
    model = TwoNorms()
    jmodel = fulmen.jit(model)
    x = torch.randn(2, 4, 16, requires_grad=True)
    params = [x, *model.parameters()]
    expected = torch.autograd.grad(model(x).square().sum(), params)
    actual = torch.autograd.grad(jmodel(x).square().sum(), params)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    statements = "\n".join(_backward_statements(jmodel))
    assert statements.count("native_layer_norm_default(") == 2
    assert "functional.layer_norm(" not in statements
