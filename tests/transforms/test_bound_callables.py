"""NOTE [bound callables] (core/trace.py): compiled traces call what their statements resolve to
(executor implementations, torch functions) through names bound once, on the printed lines."""

import ast
import re
import traceback

import torch

import fulmen
from fulmen.core.printer import executable_source, print_trace
from fulmen.core.trace import bind_callables
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


def _statement_lines(module):
    function = next(node for node in module.body if isinstance(node, ast.FunctionDef))
    return [(type(node).__name__, node.lineno) for node in ast.walk(function)
            if isinstance(node, ast.stmt)]


def _program(x, w, n: float):
    y = torch.nn.functional.linear(x, w).relu()
    z = torch.cat([y, y[:, :1] * n], dim=1)  # sizes s0 and s0 + 1 (dim 1 stays static)
    return (z.softmax(-1) * x.sum()).sum(), z.shape[0] + 1


def test_executable_source_is_the_bound_source_on_the_same_lines():
    """NOTE [executable source] (core/printer.py): the module `python_callable` compiles is
    the one `bind_callables` makes of the printed source (same statements on the same lines,
    the same callables bound to the same names), for every trace of a symbolic training step:
    the traces before claiming (symbol calls kept), the claimed ones (bound calls, fused
    regions with decompositions printed as comments, `del` statements), the backward."""
    jfn = fulmen.jit(_program, dynamic=True)
    w = torch.randn(6, 4, requires_grad=True)
    for rows in (3, 5):
        x = torch.randn(rows, 4, requires_grad=True)
        out, size = jfn(x, w, 0.5)
        out.backward()
        assert size == rows + 1
    traces = fulmen.last_traces(jfn) + fulmen.last_backward_traces(jfn)
    assert any(isinstance(size, torch.SymInt) for t in traces for p in t.args
               for size in getattr(p, "shape", ()))
    bound = 0
    for trace in traces:
        source, namespace = print_trace(trace)
        expected = bind_callables(ast.parse(source), namespace)
        printed, executable, executable_namespace = executable_source(trace)
        assert printed == source
        module = ast.parse(executable)
        assert ast.dump(module) == ast.dump(expected), trace.name
        assert _statement_lines(module) == _statement_lines(expected), trace.name
        assert {k: id(v) for k, v in executable_namespace.items()} \
            == {k: id(v) for k, v in namespace.items()}, trace.name
        bound += sum(name.startswith("_fulmen_bound") for name in namespace)
    assert bound > 0


def test_printed_sizes_are_each_expressions_text():
    """NOTE [printed expressions kept]: the texts the printer keeps are keyed by the whole
    expression: `s0`, `s0 + 1` and `2*s0` (one symbol) print apart, in the type comments and
    as Python in the statements."""
    def fn(x):
        y = torch.cat([x, x[:1]], dim=0)
        return y.new_zeros(x.shape[0] + 1), torch.cat([x, x]).new_zeros(x.shape[0] * 2)

    jfn = fulmen.jit(fn, dynamic=True)
    for rows in (3, 5):
        jfn(torch.randn(rows, 2))
    source = str(fulmen.last_traces(jfn)[0])
    rows, columns = re.search(r'# x: "cpu f32\[(s\d+), (s\d+)\]', source).groups()
    for size in (rows, f"{rows} + 1", f"2*{rows}"):
        assert f"f32[{size}, {columns}]" in source, size
    for size in (columns, f"1 + {rows}", f"2*{rows}"):
        assert f"({size})" in source, size
