"""Trace -> Python source. A pure function of the trace; IR objects carry no printing state.

Layout of a printed trace (valid Python first, commentary second):

    # fulmen · computation · constructed by tracing (0.41 ms)
    import torch
    from fulmen.ops import ltorch, prims

    def computation(x, w):
      # x: "cpu f32[8, 16]"
      # w: "cpu f32[16]"

      # model.py:12  y = (x * w).sum(dim=1)
      t0 = ltorch.mul(x, w)  # t0: "cpu f32[8, 16]"
        # t1 = prims.broadcast_in_dim(w, (8, 16), (1,))
        # t0 = prims.mul(x, t1)
      return t0

Values that have no literal form (an arbitrary Python object passed to an opaque op) are bound
to names `_c0, _c1, ...` in the namespace `python_callable` executes the source in; so is a
symbol whose `python_name` is not a dotted Python name (a custom `autograd.Function` class can
be named anything).

The printed source is compiled, so no user text reaches it unescaped: comments (source lines,
file names, graph-break questions, statements of decompositions, types) go through
`printable`, strings through `repr`. Local names (inputs and outputs) must not shadow the
globals the body uses (`torch`, `prims`, `codegen`, `_c0`, `float`) or the symbols of symbolic
sizes it binds (`s0`): the tracer never hands such names out (`fulmen.core.names`), and
`print_trace` raises if a trace has one anyway.
"""

from __future__ import annotations

import enum
import functools
import keyword
import math
import unicodedata
from collections.abc import Callable
from typing import Any

import torch

from fulmen.core.errors import FulmenError
from fulmen.core.names import PRINTED_BUILTINS
from fulmen.core.proxy import Proxy, iter_proxies, strides_of
from fulmen.core.source import printable
from fulmen.core.symbol import BoundSymbol, Symbol

INDENT = "  "
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
GRAPH_BREAK_TAG = "graph_break"  # tag of the guard statement a graph break records

_DTYPE_NAMES = {
    dtype: str(dtype).removeprefix("torch.")
    for dtype in vars(torch).values()
    if isinstance(dtype, torch.dtype)
}


class _Printer:
    def __init__(self, executable: bool = False) -> None:
        self.namespace: dict[str, Any] = {"torch": torch}
        self.imports: set[str] = {"import torch"}
        self.symbols: set = set()  # the sympy symbols of the symbolic sizes printed
        # NOTE [executable source]: with `executable`, `body` also writes the lines
        # `executable_source` compiles, each top-level call as (text before the callee, the
        # callee's text, the text after it), the callee bound once the whole trace is printed
        self.calls: list[tuple[str, str, str] | str] | None = [] if executable else None

    def constant(self, value: Any) -> str:
        name = f"_c{sum(key.startswith('_c') for key in self.namespace)}"
        self.namespace[name] = value
        return name

    def value(self, value: Any) -> str:
        """A Python expression for `value`."""
        if isinstance(value, Proxy):
            return value.name
        if isinstance(value, _SYMBOLIC):
            return self.symbolic(value)
        if isinstance(value, Symbol):
            return self.symbol(value)
        if value is None or isinstance(value, (bool, int, str)) and not isinstance(value, enum.Enum):
            return repr(value)
        if isinstance(value, float):
            if math.isnan(value):
                return "float('nan')"
            if math.isinf(value):
                return "float('inf')" if value > 0 else "-float('inf')"
            return repr(float(value))  # a float subclass (np.float64) as the float it holds
        if isinstance(value, complex):
            return f"complex({self.value(value.real)}, {self.value(value.imag)})"
        if isinstance(value, torch.dtype):
            return f"torch.{_DTYPE_NAMES.get(value, value)}"
        if isinstance(value, torch.device):
            return f"torch.device({str(value)!r})"
        if isinstance(value, (torch.memory_format, torch.layout)):
            return str(value)
        if value is Ellipsis:
            return "..."
        if isinstance(value, slice):
            return f"slice({self.value(value.start)}, {self.value(value.stop)}, {self.value(value.step)})"
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            items = [self.value(item) for item in value]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if isinstance(value, list):
            return f"[{', '.join(self.value(item) for item in value)}]"
        if isinstance(value, dict) and all(isinstance(key, (str, int)) for key in value):
            return "{" + ", ".join(f"{key!r}: {self.value(item)}" for key, item in value.items()) + "}"
        return self.constant(value)

    def symbolic(self, value) -> str:
        """A symbolic size (`torch.SymInt`, `fulmen.tracer.symbolic`) as a Python expression of
        its symbols (`4*s0`), which `print_trace` binds from the inputs' shapes."""
        expr = value.node.expr
        if not expr.free_symbols:
            return repr(value.node.pytype(expr))
        self.symbols.update(expr.free_symbols)
        self.namespace.setdefault("math", math)
        return f"({_python_text(expr)})"

    def target(self, output: Any) -> str:
        """An assignment target for `output` (`t0`, `(t0, t1)`); constants become `_`."""
        if isinstance(output, Proxy):
            return output.name
        if isinstance(output, (tuple, list)):
            items = [self.target(item) for item in output]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        return "_"

    def symbol(self, sym: Symbol) -> str:
        """How the source names `sym`: its `python_name`, or a constant when that is not a
        dotted Python name."""
        if not _is_dotted_name(sym.python_name):
            return self.constant(sym)
        self.use_namespace(sym)
        return sym.python_name

    def use_namespace(self, sym: Symbol) -> None:
        if sym.namespace.value is not None:
            self.namespace[sym.namespace.alias] = sym.namespace.resolve()
        if sym.namespace.import_line:
            self.imports.update(sym.namespace.import_line.split("\n"))

    def call(self, bsym: BoundSymbol) -> str:
        return "".join(self._call(bsym))

    def _call(self, bsym: BoundSymbol) -> tuple[str, str]:
        """`(callee, "(arguments)")` of `bsym`'s call."""
        name = self.symbol(bsym.sym)
        args = [self.value(arg) for arg in bsym.args]
        args += [f"{key}={self.value(arg)}" for key, arg in bsym.kwargs.items()]
        return name, f"({', '.join(args)})"

    def statement(self, bsym: BoundSymbol) -> str:
        """One line of Python for `bsym`, without its comments."""
        return "".join(self._statement(bsym))

    def _statement(self, bsym: BoundSymbol) -> tuple[str, str, str]:
        """`statement` as (text before the callee, the callee, the text after it); a `del`
        has no callee (`""`)."""
        if bsym.is_del:
            return "del " + ", ".join(proxy.name for proxy in iter_proxies(bsym.args)), "", ""
        name, args = self._call(bsym)
        if not list(iter_proxies(bsym.output)):
            return "", name, args
        return f"{self.target(bsym.output)} = ", name, args

    def body(self, bsyms, depth: int, lines: list[str]) -> None:
        last_source = None
        calls = self.calls
        for bsym in bsyms:
            pad = INDENT * depth
            start = len(lines)
            if depth == 1 and bsym.source is not None and bsym.source != last_source:
                lines.append(f"{pad}# {bsym.source}")  # str() escapes the user's text
                last_source = bsym.source
            if GRAPH_BREAK_TAG in bsym.sym.tags:  # args: (question, fn, expected, *values)
                lines.append(pad + "# " + printable(
                    f"graph break: {bsym.args[0]}, answered {bsym.args[2]!r}"))
            if calls is not None:
                calls.extend([""] * (len(lines) - start))
            before, callee, after = self._statement(bsym)
            line = pad + before + callee + after
            if calls is not None:
                calls.append((pad + before, callee, after) if callee else line)
            types = type_comment(bsym.output)
            if types:
                line += f"  # {printable(types)}"
            lines.append(line)
            start = len(lines)
            self.decomposition(bsym.subsymbols, depth + 1, lines)
            if calls is not None:
                calls.extend([""] * (len(lines) - start))

    def decomposition(self, bsyms, depth: int, lines: list[str]) -> None:
        for bsym in bsyms:
            lines.append(f"{INDENT * depth}# {printable(self.statement(bsym))}")
            self.decomposition(bsym.subsymbols, depth + 1, lines)


def _symbol_bindings(trace, symbols: set) -> list[str]:
    """The lines binding `symbols` at the top of `trace`'s function (`symbol_bindings`)."""
    if not symbols:
        return []
    return [""] + [INDENT + line for line in symbol_bindings(trace.args, symbols, trace.name)]


def symbol_bindings(proxies, symbols: set, name: str = "trace",
                    strides: bool = True) -> list[str]:
    """Python statements `s0 = x.shape[0]` binding each of `symbols` (sympy symbols of
    symbolic sizes) from the sizes of `proxies` (the arguments of a function, by their names):
    read from a proxy whose size (or stride) is the symbol, or else solved from a linear
    expression of it and of symbols already bound (a backward trace may see only `s0 - 1`:
    `s0 = t3.shape[0] + 1`). `name` names the function in the error; with `strides=False`
    only sizes are read.

    Raises:
        FulmenError: when no proxy's sizes determine a symbol.

    Example:
        >>> symbol_bindings([x], {s0})  # x: f32[s0, 4]
        ['s0 = x.shape[0]']
    """
    if not symbols:
        return []
    lines, bound = _bind(proxies, symbols, strides)
    if symbols - bound:
        raise FulmenError(f"the symbolic sizes {sorted(map(str, symbols - bound))} are not a "
                          "size of any input", op=f"print {name}")
    return lines


def bindable_symbols(proxies, symbols: set, strides: bool = True) -> set:
    """Those of `symbols` that `symbol_bindings` can bind from the sizes of `proxies` (a size
    that is the symbol, or linear in it: `(s0 - 1) // 2` binds nothing)."""
    return _bind(proxies, symbols, strides)[1] if symbols else set()


def _bind(proxies, symbols: set, strides: bool) -> tuple[list[str], set]:
    from torch.utils._sympy.printers import PythonPrinter

    sources = []  # (expression, Python text of the value)
    for proxy in proxies:
        if isinstance(getattr(proxy, "shape", None), torch.Size):
            kinds = [("shape", proxy.shape)]
            if strides:
                kinds.append(("stride()", strides_of(proxy)))
            for kind, values in kinds:
                for dim, size in enumerate(values):
                    if isinstance(size, torch.SymInt) and size.node.expr.free_symbols:
                        sources.append((size.node.expr, f"{proxy.name}.{kind}[{dim}]"))
    lines, bound = [], set()
    for expr, text in sources:  # the symbols themselves first
        if expr in symbols and expr not in bound:
            bound.add(expr)
            lines.append(f"{expr} = {text}")
    progress = True
    while symbols - bound and progress:
        progress = False
        for expr, text in sources:
            unknown = expr.free_symbols - bound
            if len(unknown) != 1 or not unknown <= symbols:
                continue
            solved = _solve_linear(expr, unknown.pop(), text, PythonPrinter())
            if solved is not None:
                bound.add(solved[0])
                lines.append(f"{solved[0]} = {solved[1]}")
                progress = True
    return lines, bound


def _solve_linear(expr, symbol, text: str, printer) -> tuple[Any, str] | None:
    """`(symbol, python)` solving `expr == value_of(text)` for `symbol` when `expr` is
    `a * symbol + rest` with an integer `a` (`rest` of bound symbols), else None."""
    import sympy

    coefficient = expr.diff(symbol)
    if not coefficient.is_Integer or coefficient == 0 or expr.has(sympy.Function):
        return None
    value = sympy.Symbol("_fulmen_value", integer=True)
    rest = sympy.expand(expr - coefficient * symbol)
    if rest.has(symbol):
        return None
    numerator = printer.doprint(value - rest).replace("_fulmen_value", f"({text})")
    return symbol, f"({numerator}) // {int(coefficient)}"


# NOTE [printed expressions kept]: a trace with symbolic sizes prints the same few expressions
# hundreds of times (every size argument as Python, every type comment with sympy's own
# spelling), each through a new sympy printer (~50 us); the text is a function of the
# expression alone (sympy's `==` is structural), so it is kept, keyed by the expression, in one
# dict emptied when full
_TEXTS: dict[tuple[str, Any], str] = {}
_TEXTS_LIMIT = 8192


def _python_text(expr) -> str:
    """`expr` (a sympy expression of size symbols) as Python (`4*s0`, `(s0 + 1)//2`)."""
    key = ("python", expr)
    text = _TEXTS.get(key)
    if text is None:
        from torch.utils._sympy.printers import PythonPrinter

        text = _keep_text(key, PythonPrinter().doprint(expr))
    return text


def size_text(size) -> str:
    """`str(size)` for a size of a shape: a symbolic size prints its expression (`s0 + 1`), as
    PyTorch's `str` and `repr` of a SymInt do (NOTE [the text of a symbolic size] in
    `fulmen.tracer.formatting`)."""
    if not isinstance(size, torch.SymInt):
        return str(size)
    key = ("str", size.node.expr)
    text = _TEXTS.get(key)
    if text is None:
        text = _keep_text(key, size.node.str())  # PyTorch's text of a SymInt
    return text


def _keep_text(key: tuple[str, Any], text: str) -> str:
    if len(_TEXTS) >= _TEXTS_LIMIT:
        _TEXTS.clear()
    _TEXTS[key] = text
    return text


@functools.lru_cache(maxsize=4096)
def _is_dotted_name(text: str) -> bool:
    """`torch.Tensor.copy_`: identifiers (as Python spells them) joined by dots; `del` too."""
    if text == "del":
        return True
    return unicodedata.normalize("NFKC", text) == text and all(
        part.isidentifier() and not keyword.iskeyword(part) for part in text.split("."))


def _check_locals(trace, printer: _Printer) -> None:
    """Raise if an input or output name of `trace` is not an identifier or shadows a global
    its body uses or a symbol of a symbolic size it binds (the tracer's names never do:
    `fulmen.core.names`)."""
    shadowed = {*printer.namespace, *PRINTED_BUILTINS, *map(str, printer.symbols)}
    names = [proxy.name for proxy in trace.args]
    names += [proxy.name for bsym in trace.bsyms for proxy in iter_proxies(bsym.output)]
    for name in names:
        if not _is_dotted_name(name) or "." in name or name == "del" or name in shadowed:
            raise FulmenError(f"the trace variable {printable(name)!r} cannot be printed: it is "
                              "not an identifier or shadows a global of the printed trace",
                              op=f"print {trace.name}")


def statement_source(bsym: BoundSymbol) -> str:
    """One statement as Python, e.g. `t3 = torch.add(t1, t2)`."""
    return _Printer().statement(bsym)


def type_comment(output: Any) -> str:
    """`t0: "cpu f32[4, 4]"` for each proxy in `output`."""
    return ", ".join(f'{p.name}: "{p.type_string()}"' for p in iter_proxies(output))


def print_trace(trace) -> tuple[str, dict[str, Any]]:
    """Return `(source, namespace)`: the trace as a Python module and the globals it needs."""
    source, _, namespace = _print(trace, _Printer())
    return source, namespace


def executable_source(trace) -> tuple[str, str, dict[str, Any]]:
    """`(source, executable, namespace)`: `print_trace`'s source and namespace, and the module
    `Trace.python_callable` compiles.

    NOTE [executable source]: the executable module has the source's statements on the same
    lines (tracebacks and `linecache` show the source), with every comment line left empty and
    each top-level call of a bindable callable spelled by its bound name, the module
    `bind_callables` (`fulmen.core.trace`, NOTE [bound callables]) makes of the parsed source:
    made in the same printing, it is compiled from text, without parsing the source into
    Python's AST objects and compiling those (half the cost of compiling a trace, whose
    decompositions print as comments). The names are bound as `bind_callables` binds them:
    each callee resolved through the namespace once the trace is printed, numbered in order."""
    printer = _Printer(executable=True)
    source, lines, namespace = _print(trace, printer)
    bind = binder(namespace)
    for i, call in enumerate(lines):
        if isinstance(call, str):
            continue
        before, callee, after = call
        target = bindable(resolve_dotted(callee, namespace))
        if target is not None and not callee.startswith(BOUND_PREFIX):
            callee = bind(target)
        lines[i] = before + callee + after
    return source, "\n".join(lines) + "\n", namespace


BOUND_PREFIX = "_fulmen_bound"


def binder(namespace: dict) -> Callable[[Any], str]:
    """`bind(target)`: the name `target` is bound to in `namespace` (NOTE [bound callables]),
    `_fulmen_bound<n>` numbered in order of first use, added to `namespace` the first time;
    the names already there are reused."""
    bound: dict[int, str] = {id(v): k for k, v in namespace.items()
                             if k.startswith(BOUND_PREFIX)}

    def bind(target: Any) -> str:
        name = bound.get(id(target))
        if name is None:
            name = bound[id(target)] = f"{BOUND_PREFIX}{len(bound)}"
            namespace[name] = target
        return name

    return bind


def resolve_dotted(text: str, namespace: dict) -> Any:
    """The object a dotted name (`torch.nn.functional.linear`, `_c0`) stands for in
    `namespace`, or None."""
    first, *attrs = text.split(".")
    value = namespace.get(first)
    for attr in attrs:
        if value is None:
            return None
        value = getattr(value, attr, None)
    return value


def bindable(value: Any) -> Any:
    """What a statement calling `value` may call directly: an executor operator's
    implementation (what `Symbol.__call__` runs outside tracing), or a plain callable such as a
    torch function. Symbols without an executor (prims, torch-level ops: traces before the
    executors claim them) keep their call, which records them when a trace is being traced."""
    if isinstance(value, Symbol):
        return value.impl if value.executor is not None else None
    return value if callable(value) and not isinstance(value, type) else None


def _print(trace, printer: _Printer) -> tuple[str, list, dict[str, Any]]:
    """`(source, lines, namespace)`: `print_trace`'s source and namespace; with an executable
    `printer`, the lines of the executable module (NOTE [executable source]), its top-level
    calls still split around their callees."""
    lines: list[str] = []
    printer.body(trace.bsyms, 1, lines)
    ret = f"{INDENT}return {printer.value(trace.output)}"
    signature = ", ".join(trace.arg_names)
    _check_locals(trace, printer)
    arg_comments = [f"{INDENT}# {printable(type_comment(proxy))}" for proxy in trace.args]
    arg_comments += _symbol_bindings(trace, printer.symbols)
    header = printable(f"# fulmen · {trace.name} · {trace.provenance}")
    if trace.seconds:
        header += f" ({trace.seconds * 1e3:.2f} ms)"
    order = ("import ", "from ")
    imports = sorted(printer.imports, key=lambda line: (
        next((i for i, prefix in enumerate(order) if line.startswith(prefix)), len(order)), line))
    parts = [header, *imports, "", f"def {trace.name}({signature}):", *arg_comments]
    if arg_comments:
        parts.append("")
    source = "\n".join([*parts, *lines, ret]) + "\n"
    executable = None if printer.calls is None else [*parts, *printer.calls, ret]
    return source, executable, printer.namespace


def highlight_html(source: str) -> str:
    """Syntax-highlighted HTML for notebooks (pygments when installed, else a plain <pre>)."""
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer
    except ImportError:
        import html

        return f"<pre>{html.escape(source)}</pre>"
    return highlight(source, PythonLexer(), HtmlFormatter(noclasses=True))
