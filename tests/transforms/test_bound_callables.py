"""NOTE [bound callables] (core/trace.py): compiled traces call what their statements resolve to
(executor implementations, torch functions) through names bound once, on the printed lines."""

import traceback

import torch

import fulmen
from fulmen.core.trace import bind_callables  # noqa: F401  (the documented helper)
from fulmen.jit import _jitted
from fulmen.tools.profile import _compiled_functions


def _compiled(jfn):
    return _compiled_functions(_jitted(jfn))


def test_execution_trace_calls_bound_names():
    def fn(x, w):
        return torch.nn.functional.linear(x, w).relu().sum(1)

    jfn = fulmen.jit(fn)
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    torch.testing.assert_close(jfn(x, w), fn(x, w))
    (compiled,) = _compiled(jfn)
    names = compiled.__code__.co_names
    assert any(name.startswith("_fulmen_bound") for name in names)
    assert "nn" not in names and "functional" not in names and "codegen" not in names
    assert compiled.__globals__[next(n for n in names if n.startswith("_fulmen_bound"))] \
        is torch.nn.functional.linear


def test_errors_point_at_the_printed_line():
    def fn(x, w):
        return torch.matmul(x.exp(), w)

    jfn = fulmen.jit(fn)
    jfn(torch.randn(2, 3), torch.randn(3, 4))
    (compiled,) = _compiled(jfn)
    try:
        compiled(torch.randn(2, 3), torch.randn(5, 4))
    except RuntimeError as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        assert frame.filename.startswith("<fulmen") and "torch.matmul(" in frame.line
    else:
        raise AssertionError("a shape mismatch must raise")


def test_traces_before_claiming_keep_symbol_calls():
    def fn(x):
        return (x * 2).sin()

    jfn = fulmen.jit(fn)
    jfn(torch.randn(3))
    first = fulmen.last_traces(jfn)[0]
    compiled = first.python_callable()
    assert not any(n.startswith("_fulmen_bound") for n in compiled.__code__.co_names)
    torch.testing.assert_close(compiled(torch.ones(3)), (torch.ones(3) * 2).sin())


def test_profile_times_the_bound_statements():
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
    jmodel = fulmen.jit(torch.nn.Sequential(*layers))
    with torch.no_grad():
        profile = fulmen.profile(jmodel, torch.randn(2, 8), steps=3, warmup=1)
    assert sum(row.category == "matmul" for row in profile.rows) == 3
    assert all(row.statement.split("= ")[-1].startswith(("torch.", "codegen.", "del"))
               or row.statement.startswith("del") for row in profile.rows)
