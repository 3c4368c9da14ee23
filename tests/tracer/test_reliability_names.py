"""Reliability (issue 20): the user's names and text in printed traces, aliasing of inputs.

Printed traces are compiled and run, so an argument named like one of their globals, two names
Python reads as one identifier, or a newline in a file name must neither break them nor
change what they compute.
"""

import linecache

import pytest
import torch

import fulmen

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


def test_names_that_normalise_to_keywords():
    # `𝐢𝐟` is the parameter `if` (a keyword, so the signature cannot be read), `𝐍𝐨𝐧𝐞` is `None`
    fn = _compiled("def f(\U0001d422\U0001d41f, \U0001d40d\U0001d428\U0001d427\U0001d41e):\n"
                   "    return \U0001d422\U0001d41f * 2 - \U0001d40d\U0001d428\U0001d427\U0001d41e\n")
    a, b = torch.randn(3), torch.randn(3)
    jfn = fulmen.jit(fn)
    torch.testing.assert_close(jfn(a, b), fn(a, b))
    hn = _compiled("def f(**kw):\n    return kw['\U0001d422\U0001d41f'] + kw['lambda']\n")
    kwargs = {"\U0001d422\U0001d41f": a, "lambda": b}
    jhn = fulmen.jit(hn)
    torch.testing.assert_close(jhn(**kwargs), hn(**kwargs))
    _assert_traces_run(jhn, (a, b), hn(**kwargs))


class _Colliding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.torchex = torch.nn.Linear(4, 4)
        self.register_buffer("\ufb01", torch.randn(4))
        self.register_buffer("fi", torch.randn(4))

    def forward(self, codegen, slice, functionalized):
        out = self.torchex(codegen) + getattr(self, "\ufb01") - self.fi
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
