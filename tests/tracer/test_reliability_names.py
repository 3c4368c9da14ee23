"""Reliability (issue 20): the user's names and text in printed traces, aliasing of inputs.

Printed traces are compiled and run, so an argument named like one of their globals, two names
Python reads as one identifier, or a newline in a file name must neither break them nor
change what they compute.
"""

import linecache

import pytest
import torch

import fulmen
from fulmen.core import FulmenError

INF = float("inf")

# a body whose traces call every kind of global: ltorch/opaque/functionalized (traced), codegen,
# torchex and torch (claimed), the builtins float and slice, and prims (decompositions)
BODY = """\
    z = y.clone()
    z[0] = 1.0
    out = {a} * 2 + torch_.cumsum(z, 0) + torch_.special.i0(y[1:]).sum()
    return out.clamp(max=INF)
"""
GLOBAL_NAMES = ["codegen", "torchex", "torch", "prims", "ltorch", "opaque", "functionalized",
                "breaks", "slice", "float", "complex", "t0", "_c0"]


def _compiled(source: str, filename: str = "user_names.py", **globals_):
    namespace = {"torch": torch, "torch_": torch, "INF": INF, **globals_}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["f"]


def _assert_traces_run(jfn, args, expected) -> None:
    """Every trace of the last compilation, compiled from its printed source, gives eager's
    answer."""
    for trace in fulmen.last_traces(jfn):
        torch.testing.assert_close(trace.python_callable()(*args), expected, msg=trace.provenance)


@pytest.mark.parametrize("name", GLOBAL_NAMES)
def test_argument_named_like_a_trace_global(name):
    fn = _compiled(f"def f({name}, y):\n" + BODY.format(a=name))
    x, y = torch.randn(4), torch.randn(4)
    expected = fn(x.clone(), y.clone())
    jfn = fulmen.jit(fn)
    torch.testing.assert_close(jfn(x, y), expected)
    _assert_traces_run(jfn, (x, y), expected)
    torch.testing.assert_close(jfn(**{name: x, "y": y}), expected)
    assert name not in fulmen.last_traces(jfn)[-1].arg_names


def test_constant_name_argument_with_a_graph_break():
    # the break's guard calls the constant `_c0` (Tensor.__bool__) in the traced path
    fn = _compiled("def f(_c0, x):\n    if x.sum() > 0:\n        return x + _c0\n"
                   "    return x - _c0\n")
    a, x = torch.randn(4), torch.rand(4)
    jfn = fulmen.jit(fn)
    torch.testing.assert_close(jfn(a, x), fn(a, x))
    traced = fulmen.last_traces(jfn)[0]
    torch.testing.assert_close(traced.python_callable()(a, x), fn(a, x))


def test_names_equal_after_nfkc_normalisation():
    # Python reads `ﬁ` as `fi` and `𝐱` as `x`: as keyword arguments they are distinct keys
    fn = _compiled("def f(**kw):\n"
                   "    return kw['\\ufb01'] * 2 + kw['fi'] * 3 + kw['\\U0001d431'] - kw['x']\n")
    kwargs = {"\ufb01": torch.randn(3), "fi": torch.randn(3),
              "\U0001d431": torch.randn(3), "x": torch.randn(3)}
    jfn = fulmen.jit(fn)
    torch.testing.assert_close(jfn(**kwargs), fn(**kwargs))
    names = fulmen.last_traces(jfn)[0].arg_names
    assert len(set(names)) == 4 and {"fi", "x"} <= set(names)
    _assert_traces_run(jfn, tuple(kwargs.values()), fn(**kwargs))

    # dict keys name inputs too
    gn = _compiled("def f(d):\n    return d['\\ufb01'] - d['fi']\n")
    d = {"\ufb01": torch.randn(3), "fi": torch.randn(3)}
    torch.testing.assert_close(fulmen.jit(gn)(d), gn(d))


def test_parameters_equal_after_nfkc_normalisation():
    # source cannot spell them (Python normalises both to `fi`), a code object can
    import types

    plain = _compiled("def f(a, b):\n    return a * 2 - b\n")
    fn = types.FunctionType(plain.__code__.replace(co_varnames=("\ufb01", "fi")), {})
    x, y = torch.randn(3), torch.randn(3)
    jfn = fulmen.jit(fn)
    torch.testing.assert_close(jfn(x, y), x * 2 - y)
    torch.testing.assert_close(jfn(**{"\ufb01": x, "fi": y}), x * 2 - y)
    assert len(set(fulmen.last_traces(jfn)[0].arg_names)) == 2


def test_names_that_normalise_to_keywords():
    # `𝐢𝐟` is the parameter `if` (a keyword, so the signature cannot be read), `𝐍𝐨𝐧𝐞` is `None`
    if_, none = "\U0001d422\U0001d41f", "\U0001d40d\U0001d428\U0001d427\U0001d41e"
    fn = _compiled(f"def f({if_}, {none}):\n    return {if_} * 2 - {none}\n")
    a, b = torch.randn(3), torch.randn(3)
    jfn = fulmen.jit(fn)
    torch.testing.assert_close(jfn(a, b), fn(a, b))
    hn = _compiled("def f(**kw):\n    return kw['\U0001d422\U0001d41f'] + kw['lambda']\n")
    kwargs = {"\U0001d422\U0001d41f": a, "lambda": b}
    jhn = fulmen.jit(hn)
    torch.testing.assert_close(jhn(**kwargs), hn(**kwargs))
    _assert_traces_run(jhn, (a, b), hn(**kwargs))


def test_argument_named_like_a_symbolic_size():
    # a trace with symbolic sizes binds their symbols first thing: `s77 = x.shape[0]`
    import re

    source = "def f(x, {name}, {other}):\n    return x * x.shape[0] + {name}.sum() + {other}.sum()\n"
    probe = fulmen.jit(_compiled(source.format(name="y", other="z")), dynamic=True)
    args = (torch.randn(5, 3), torch.randn(2), torch.randn(2))
    probe(*args)
    symbol = re.search(r"(s\d+) = x\.shape\[0\]", str(fulmen.last_traces(probe)[0])).group(1)
    fn = _compiled(source.format(name=symbol, other="math"))  # math: symbolic sizes use it
    jfn = fulmen.jit(fn, dynamic=True)
    for n in (5, 7):
        args = (torch.randn(n, 3), torch.randn(2), torch.randn(2))
        torch.testing.assert_close(jfn(*args), fn(*args))
    assert f"{symbol} = x.shape[0]" in str(fulmen.last_traces(jfn)[0])
    assert fulmen.cache_misses(jfn) == 1


def test_argument_named_like_the_profilers_helpers():
    # fulmen.profile times each statement with `_fulmen_t = _fulmen_clock()`
    fn = _compiled("def f(_fulmen_t, _fulmen_clock):\n"
                   "    return (_fulmen_t * 2).sin() + _fulmen_clock.cos()\n")
    x, y = torch.randn(3), torch.randn(3)
    jfn = fulmen.jit(fn)
    prof = fulmen.profile(jfn, x, y, steps=2, warmup=1)
    assert prof.rows
    torch.testing.assert_close(jfn(x, y), fn(x, y))


class _Colliding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.torchex = torch.nn.Linear(4, 4)
        self.register_buffer("\ufb01", torch.randn(4))
        self.register_buffer("fi", torch.randn(4))

    def forward(self, codegen, slice, functionalized):
        out = self.torchex(codegen) + getattr(self, "\ufb01") - self.fi  # noqa: B009 (NFKC)
        functionalized = functionalized.clone()
        functionalized[0] = 2.0
        return torch.cumsum(out * slice[1:].sum(), 1) + functionalized


def test_module_forward_with_colliding_names():
    model = _Colliding()
    args = (torch.randn(2, 4), torch.randn(3), torch.randn(4))
    with torch.no_grad():
        expected = model(*args)
        jmodel = fulmen.jit(model)
        torch.testing.assert_close(jmodel(*args), expected)
        torch.testing.assert_close(jmodel(codegen=args[0], slice=args[1],
                                          functionalized=args[2]), expected)


# -- user text in printed traces ------------------------------------------------------------

_INJECTED = "  import builtins; builtins.fulmen_injected = True"  # indented as trace bodies are


@pytest.fixture
def no_injection():
    import builtins

    yield
    injected = getattr(builtins, "fulmen_injected", False)
    vars(builtins).pop("fulmen_injected", None)
    assert not injected, "text from the user's source ran as code of a printed trace"


@pytest.mark.parametrize("separator", ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e",
                                       "\x85", "\u2028", "\u2029"])
def test_file_name_with_line_separators(separator, no_injection):
    filename = f"evil.py{separator}{_INJECTED}{separator}#"
    fn = _compiled("def f(x):\n    return x * 2 + 1\n", filename)
    x = torch.randn(3)
    jfn = fulmen.jit(fn)
    torch.testing.assert_close(jfn(x), fn(x))
    _assert_traces_run(jfn, (x,), fn(x))
    for trace in fulmen.last_traces(jfn):
        source = str(trace)
        assert len(source.splitlines()) == source.count("\n"), "a separator reached the source"
        assert f"{separator}{_INJECTED}" not in source


@pytest.mark.parametrize("separator", ["\r", "\n", "\x0b", "\x0c", "\x1c", "\x85", "\u2028",
                                       "\u2029", "\x00", "\u202e"])
def test_source_line_with_line_separators(separator, no_injection):
    # what linecache shows for the line (an edited file, a notebook's cell) is user text
    filename = f"<reliability {ord(separator)}>"
    source = "def f(x):\n    return x * 2 + 1\n"
    fn = _compiled(source, filename)
    shown = ["def f(x):\n", f"    return x * 2 + 1  #{separator}{_INJECTED}\n"]
    linecache.cache[filename] = (len(source), None, shown, filename)
    try:
        x = torch.randn(3)
        jfn = fulmen.jit(fn)
        torch.testing.assert_close(jfn(x), fn(x))
        _assert_traces_run(jfn, (x,), fn(x))
        printed = str(fulmen.last_traces(jfn)[0])
    finally:
        del linecache.cache[filename]
    assert len(printed.splitlines()) == printed.count("\n")
    assert f"return x * 2 + 1  #{separator.encode('unicode_escape').decode()}  import" in printed


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_autograd_function_named_with_code(no_injection):
    # the op's name is the class's __name__, which can be any string
    odd = type(f"Double\n{_INJECTED}\n  x = ", (_Double,), {})

    def fn(x):
        return odd.apply(x) + 1

    x = torch.randn(3, requires_grad=True)
    jfn = fulmen.jit(fn)
    out = jfn(x)
    torch.testing.assert_close(out, fn(x))
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    with torch.no_grad():
        torch.testing.assert_close(fulmen.jit(fn)(x), fn(x))


# -- aliasing of inputs ---------------------------------------------------------------------

def _add_one_read_other(a, b):
    a.add_(1)
    return b * 2 + a.sum()


def _update_both(a, b):
    a.add_(1)
    b.mul_(2)
    return a + b.sum()


def _assert_same_as_eager(fn, make_inputs, jfn=None):
    eager_inputs, compiled_inputs = make_inputs(), make_inputs()
    expected = fn(*eager_inputs)
    out = (jfn or fulmen.jit(fn))(*compiled_inputs)
    torch.testing.assert_close(out, expected)
    for got, want in zip(compiled_inputs, eager_inputs):
        torch.testing.assert_close(got, want)
    return compiled_inputs


@pytest.mark.parametrize("fn", [_add_one_read_other, _update_both])
def test_empty_inputs_do_not_alias(fn):
    # distinct empty tensors may all have data_ptr 0; an empty view of a buffer has its storage
    _assert_same_as_eager(fn, lambda: (torch.empty(0), torch.empty(0)))
    _assert_same_as_eager(fn, lambda: (lambda buf: (buf[:0], buf))(torch.arange(6.0)))


@pytest.mark.parametrize("fn", [_add_one_read_other, _update_both])
def test_disjoint_views_of_one_storage(fn):
    buffers = []

    def halves():
        buf = torch.arange(8.0)
        buffers.append(buf)
        return buf[:4], buf[4:]

    jfn = fulmen.jit(fn)
    _assert_same_as_eager(fn, halves, jfn)
    torch.testing.assert_close(buffers[1], buffers[0])  # the write-backs reached the buffer
    _assert_same_as_eager(fn, halves, jfn)  # a cache hit checks the call's own inputs
    torch.testing.assert_close(buffers[3], buffers[2])
    # rows of a matrix, and views in an order where the mutated one comes second
    _assert_same_as_eager(fn, lambda: (lambda m: (m[1], m[0]))(torch.arange(6.0).view(2, 3)))


def _overlapping(views, buf=None):
    buf = torch.arange(8.0) if buf is None else buf
    return buf, (buf[views[0]], buf[views[1]])


@pytest.mark.parametrize("views", [(slice(0, 6), slice(4, 8)), (slice(0, 8, 2), slice(1, 8, 2)),
                                   (slice(0, 8), slice(0, 8))], ids=["overlap", "interleaved",
                                                                      "same"])
def test_overlapping_views_run_eagerly(views):
    # the compiled program treats its inputs as independent: a call whose mutated input
    # overlaps another one runs eagerly (decided before anything ran), and gives eager's answer
    buf, args = _overlapping(views)
    expected_buf, expected_args = _overlapping(views)
    expected = _add_one_read_other(*expected_args)
    jfn = fulmen.jit(_add_one_read_other)
    with pytest.warns(UserWarning, match=r"(?s)input 0 \(float32\[\d\].*input 1 .*may share memory, "
                      r"and input 0 is modified in place.*run eagerly"):
        out = jfn(*args)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(buf, expected_buf)
    assert fulmen.compile_stats(jfn).eager_calls == 1
    # the same program on independent inputs is the compiled one
    _assert_same_as_eager(_add_one_read_other, lambda: (torch.arange(4.0), torch.arange(4.0)),
                          jfn)
    assert fulmen.compile_stats(jfn).eager_calls == 1


def test_overlapping_views_are_refused_under_fullgraph():
    buf, args = _overlapping((slice(0, 6), slice(4, 8)))
    jfn = fulmen.jit(_add_one_read_other, fullgraph=True)
    jfn(torch.arange(6.0), torch.arange(4.0))  # compiled for these shapes
    with pytest.raises(fulmen.NotYetSupportedError, match="may share memory"):
        jfn(*args)
    torch.testing.assert_close(buf, torch.arange(8.0))  # refused before anything ran


def test_overlapping_memory_of_distinct_storages_runs_eagerly():
    # tensors over one numpy array have storages of their own: their memory is what counts
    import numpy as np

    array = np.arange(8.0, dtype=np.float32)
    a, b = torch.from_numpy(array[:6]), torch.from_numpy(array[4:])
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    expected_array = array.copy()
    expected = _add_one_read_other(torch.from_numpy(expected_array[:6]),
                                   torch.from_numpy(expected_array[4:]))
    with pytest.warns(UserWarning, match="may share memory"):
        out = fulmen.jit(_add_one_read_other)(a, b)
    torch.testing.assert_close(out, expected)
    np.testing.assert_array_equal(array, expected_array)
    first, second = torch.from_numpy(array[:4]), torch.from_numpy(array[4:])
    _assert_same_as_eager(_update_both, lambda: (torch.arange(4.0), torch.arange(4.0, 8.0)))
    fulmen.jit(_update_both)(first, second)  # disjoint halves: compiled, both written back
    _update_both(torch.from_numpy(expected_array[:4]), torch.from_numpy(expected_array[4:]))
    np.testing.assert_array_equal(array, expected_array)


# -- in-place updates of tensors whose elements share memory --------------------------------

def _expand_add_(x):
    y = x.expand(4, 3)
    y.add_(1)
    return y * 2


def _empty_strided_add_(x):
    y = torch.empty_strided((4,), (0,))
    y.zero_()
    y.add_(x.sum())
    return y


def _as_strided_mul_(x):
    y = torch.zeros(1).as_strided((4,), (0,))
    y.mul_(x)
    return y


@pytest.mark.parametrize("fn", [_expand_add_, _empty_strided_add_, _as_strided_mul_])
def test_self_overlapping_in_place_raises_as_eager(fn):
    with pytest.raises(RuntimeError, match="single memory location"):
        fn(torch.ones(3) if fn is _expand_add_ else torch.ones(4))
    with pytest.raises(RuntimeError, match="single memory location|may or may not alias"):
        fulmen.jit(fn)(torch.ones(3) if fn is _expand_add_ else torch.ones(4))


def _update_x_then_a(a, x):
    x.add_(1)  # eager fails here, before a changes
    a.add_(1)
    return a + x


def test_expanded_input_modified_in_place_changes_nothing():
    def inputs():
        return torch.zeros(4), torch.zeros(1).expand(4)

    a, x = inputs()
    with pytest.raises(RuntimeError, match="single memory location"):
        _update_x_then_a(a, x)
    jfn = fulmen.jit(_update_x_then_a)
    for _ in range(2):  # compiling call, then a cache hit
        a, x = inputs()
        with pytest.raises(RuntimeError, match="single memory location") as error:
            jfn(a, x)
        torch.testing.assert_close(a, torch.zeros(4))
        assert "input 1 (float32[4], strides (0,)" in str(error.value)
    torch.testing.assert_close(jfn(torch.zeros(4), torch.zeros(4)), torch.ones(4) * 2)


def _bad_matmul(x, w):
    return (x @ w).relu()


def _bad_view(x):
    return x.view(4, 4)


def test_shape_errors_name_the_op_and_the_users_line():
    """A meta kernel's shape check keeps PyTorch's error type and gets a note naming the op and
    the line; a decomposition's own check says where it was called."""
    with pytest.raises(RuntimeError) as info:
        fulmen.jit(_bad_matmul)(torch.randn(2, 3), torch.randn(4, 5))
    assert any("matmul" in note and "x @ w" in note for note in info.value.__notes__)
    with pytest.raises(FulmenError, match=r"(?s)invalid for input of size 15.*x\.view\(4, 4\)"):
        fulmen.jit(_bad_view)(torch.randn(3, 5))


def _bad_sum(x):
    return x.sum(5)


def test_an_op_eager_rejects_raises_eagers_error_type_with_the_users_line():
    """An op run on real values because PyTorch cannot describe it on proxies, that eager
    rejects too (`x.sum(5)` on a matrix), raises eager's own error (IndexError, as a user
    catching it expects), with a note naming the op and the line."""
    with pytest.raises(IndexError, match="Dimension out of range") as info:
        fulmen.jit(_bad_sum)(torch.randn(3, 4))
    assert any("sum" in note and "x.sum(5)" in note for note in info.value.__notes__)
