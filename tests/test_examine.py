"""`fulmen.examine`: decomposed / opaque / functionalized ops and untraceable code, never raising."""

import torch
import torch.nn.functional as F

import fulmen


def test_examine_a_function(capsys):
    def fn(x):
        y = F.gelu(x) * 2
        y.add_(1)
        return torch.special.i0(y).sum()

    x = torch.randn(3)
    before = x.clone()
    report = fulmen.examine(fn, x)
    assert report.ok and report.traced
    assert "ltorch.gelu" in report.decomposed and "ltorch.mul" in report.decomposed
    assert list(report.opaque) == ["torch.special.i0"]
    assert report.opaque["torch.special.i0"][0].startswith("test_examine.py:")
    assert "ltorch.add" in report.decomposed  # the functional form of add_
    printed = capsys.readouterr().out
    assert "torch.special.i0" in printed and "opaque" in printed
    assert torch.equal(x, before)


def test_examine_reports_graph_breaks():
    def fn(x):
        y = x.exp()
        if y.sum() > 0:  # value-dependent control flow: a graph break
            return y
        return -y

    report = fulmen.examine(fn, torch.randn(3))
    assert report.traced and report.ok
    (info,) = report.breaks
    assert info.startswith("bool(") and "test_examine.py:" in info
    assert "graph breaks" in str(report)


def test_examine_reports_what_cannot_be_traced_without_raising():
    def fn(x):
        y = x.exp()
        torch.manual_seed(0)  # a compiled function would not repeat it
        return y

    report = fulmen.examine(fn, torch.randn(3))
    assert not report.traced and not report.ok
    ((op, where, message),) = report.errors
    assert "manual_seed" in op and "random state" in message
    assert where.startswith("test_examine.py:")
    assert "ltorch.exp" in report.decomposed  # what traced before the failure is reported


def test_examine_a_module_with_buffer_updates():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = fulmen.examine(model, torch.randn(5, 4))
    assert report.traced
    assert "write-back to input/buffer" in report.functionalized
    assert "ltorch.linear" in report.decomposed
    for key, value in model.state_dict().items():  # examining changes nothing
        assert torch.equal(value, state[key]), key
    assert "batch_norm" in str(report)


def test_examine_reports_fallbacks():
    x = torch.randn(2, 4, dtype=torch.bfloat16)  # mixed with float32 weights: not decomposed
    report = fulmen.examine(lambda x, w, b: F.layer_norm(x, (4,), w, b), x, torch.randn(4),
                            torch.randn(4))
    assert report.ok
    assert list(report.fallbacks) == ["torch.nn.functional.layer_norm"]
    assert "declined" in str(report)
