"""Traces are values: printable, runnable, verifiable."""

import linecache

import pytest
import torch

import fulmen
from fulmen.core import BoundSymbol, FulmenError, check_trace
from fulmen.core.names import NameAllocator, sanitize


def mlp_like(x, w, b):
    h = torch.matmul(x, w) + b
    return torch.relu(h) * 0.5 - h.sum(dim=-1, keepdim=True) / 3


def _jitted_traces():
    x, w, b = torch.randn(4, 8), torch.randn(8, 5), torch.randn(5)
    jfn = fulmen.jit(mlp_like)
    with torch.no_grad():
        out = jfn(x, w, b)
    return (x, w, b), out, fulmen.last_traces(jfn)


def test_every_stage_compiles_and_reproduces_the_result():
    args, out, traces = _jitted_traces()
    assert len(traces) >= 3
    for trace in traces:
        compile(str(trace), "<test>", "exec")
        check_trace(trace)
        fn = trace.python_callable()
        torch.testing.assert_close(fn(*args), out)


def test_python_callable_registers_source_with_linecache():
    _, _, traces = _jitted_traces()
    fn = traces[-1].python_callable()
    filename = fn.__code__.co_filename
    assert filename.startswith("<fulmen")
    assert "def computation" in "".join(linecache.getlines(filename))


def test_traceback_points_at_trace_line():
    _, _, traces = _jitted_traces()
    fn = traces[-1].python_callable()
    with pytest.raises(RuntimeError) as info:
        fn(torch.randn(4, 7), torch.randn(8, 5), torch.randn(5))
    frames = [entry for entry in info.traceback if entry.path == fn.__code__.co_filename]
    assert frames and "torch.matmul" in str(frames[0].statement)


def test_check_trace_rejects_ssa_violation_and_use_before_def():
    _, _, traces = _jitted_traces()
    trace = traces[0]
    first, second = trace.bsyms[0], trace.bsyms[1]
    duplicated = trace.replace(bsyms=(first, first, *trace.bsyms[1:]))
    with pytest.raises(FulmenError, match="assigned twice"):
        check_trace(duplicated)
    swapped = trace.replace(bsyms=(second, first, *trace.bsyms[2:]))
    with pytest.raises(FulmenError, match="undefined"):
        check_trace(swapped)


def test_check_trace_rejects_metadata_mismatch():
    _, _, traces = _jitted_traces()
    trace = traces[0]
    bsym = trace.bsyms[0]
    from fulmen.proxies import TensorProxy

    wrong = TensorProxy(bsym.proxy_inputs[0].name, (1, 1), torch.float64, "cpu")
    bad = BoundSymbol(bsym.sym, (wrong, *bsym.args[1:]), bsym.kwargs, bsym.output)
    with pytest.raises(FulmenError, match="where defined"):
        check_trace(trace.replace(bsyms=(bad, *trace.bsyms[1:])))


def test_passes_do_not_mutate_their_input():
    _, _, traces = _jitted_traces()
    before = [str(trace) for trace in traces]
    fulmen.transforms.dce(traces[0])
    fulmen.transforms.delete_last_used(traces[0])
    assert [str(trace) for trace in traces] == before


def test_name_allocation():
    names = NameAllocator()
    assert names.named("x") == "x"
    assert names.named("x") == "x_1"
    assert names.new() == "t0"
    assert names.named("t1") == "t1_1"  # never collides with temporaries
    assert sanitize("layers.0.weight") == "layers_0_weight"
    assert sanitize("lambda") == "lambda_"


def test_a_call_site_tag_that_is_not_a_member_fails_where_the_statement_is_made():
    from fulmen.core import CallSiteTag

    _, _, traces = _jitted_traces()
    statement = traces[0].bsyms[0]
    tagged = statement.replace(tags=frozenset({"checkpoint"}))
    assert tagged.tags == {CallSiteTag.CHECKPOINT}
    with pytest.raises(ValueError, match="chekpoint"):
        statement.replace(tags=frozenset({"chekpoint"}))


def test_a_statements_kept_proxies_are_its_own_and_a_replaced_statement_recomputes_them():
    """The proxies a statement reads and writes are kept at the first question (NOTE [names of
    a statement, kept]); `replace` makes a statement whose answers are its new arguments'."""
    from fulmen.core.proxy import iter_proxies
    from fulmen.proxies import TensorProxy

    _, _, traces = _jitted_traces()
    bsym = next(b for b in traces[0].bsyms if len(b.proxy_inputs) >= 1)
    assert bsym.read_proxies == tuple(iter_proxies((bsym.args, bsym.kwargs)))
    assert bsym.proxy_outputs == list(iter_proxies(bsym.output))
    first = bsym.proxy_inputs[0]
    other = TensorProxy("other_input", first.shape, first.dtype, first.device)
    swapped = bsym.replace(args=tuple(other if a is first else a for a in bsym.args),
                           output=TensorProxy("other_output", (1,), torch.float32, "cpu"))
    assert "other_input" in [p.name for p in swapped.proxy_inputs]
    assert first.name not in swapped.input_names
    assert [p.name for p in swapped.read_proxies].count("other_input") >= 1
    assert [p.name for p in swapped.proxy_outputs] == ["other_output"]
    assert swapped.output_names == {"other_output"}
    # a copy of the kept list: changing it does not change the statement
    bsym.proxy_outputs.clear()
    assert bsym.proxy_outputs == list(iter_proxies(bsym.output))


def test_check_trace_rejects_a_decomposition_assigning_another_statements_name():
    """SSA counts the names a decomposition assigns (a pass may put the decomposition in the
    statement's place): a sub-statement writing a later statement's output fails the check."""
    _, _, traces = _jitted_traces()
    trace = traces[0]
    owner = next(i for i, b in enumerate(trace.bsyms) if b.subsymbols)
    later = next(b for b in trace.bsyms[owner + 1:] if b.proxy_outputs)
    bsym = trace.bsyms[owner]
    sub = bsym.subsymbols[0]
    clash = sub.replace(output=later.proxy_outputs[0])
    bad = bsym.replace(subsymbols=(clash, *bsym.subsymbols[1:]))
    bsyms = list(trace.bsyms)
    bsyms[owner] = bad
    with pytest.raises(FulmenError, match="inside the decomposition"):
        check_trace(trace.replace(bsyms=tuple(bsyms)))


def test_check_trace_rejects_a_decomposition_assigning_an_input_or_earlier_name():
    """The same for a name assigned before the statement: a trace input, or an earlier
    statement's output."""
    _, _, traces = _jitted_traces()
    trace = traces[0]
    owner = next(i for i, b in enumerate(trace.bsyms) if b.subsymbols)
    earlier = [p for b in trace.bsyms[:owner] for p in b.proxy_outputs]
    bsym = trace.bsyms[owner]
    for taken in (trace.args[0], *earlier[:1]):
        clash = bsym.subsymbols[0].replace(output=taken)
        bsyms = list(trace.bsyms)
        bsyms[owner] = bsym.replace(subsymbols=(clash, *bsym.subsymbols[1:]))
        with pytest.raises(FulmenError, match="inside the decomposition"):
            check_trace(trace.replace(bsyms=tuple(bsyms)))
