"""Traces and the context that records them.

A `Trace` is an immutable value: a name, the input proxies (its signature), a tuple of bound
symbols, and an output (a proxy, a constant, or tuples/lists/dicts of them). It prints as Python
(`str(trace)`) and runs (`trace.python_callable()`).

A `TraceCtx` is the mutable recorder used while tracing: it allocates names and collects the
bound symbols that symbol calls produce.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import itertools
import linecache
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fulmen.core.errors import FulmenError
from fulmen.core.names import NameAllocator
from fulmen.core.printer import (
    BOUND_PREFIX,
    bindable,
    binder,
    executable_source,
    highlight_html,
    print_trace,
    resolve_dotted,
)
from fulmen.core.proxy import Proxy, iter_proxies
from fulmen.core.source import user_source_location
from fulmen.core.symbol import _TRACECTX, BoundSymbol, CallSiteTag, Symbol

_callable_ids = itertools.count()
_COMPILE_LOCK = threading.Lock()  # see `Trace.python_callable`


@dataclass(frozen=True, eq=False)
class Trace:
    """A program in SSA form. See the module docstring.

    Example:
        >>> trace = fulmen.last_traces(jfn)[-1]
        >>> print(trace)          # Python source
        >>> trace.python_callable()(x, w)
    """

    name: str
    args: tuple[Proxy, ...]
    bsyms: tuple[BoundSymbol, ...]
    output: Any
    provenance: str = "constructed by tracing"
    seconds: float = 0.0

    def replace(self, **changes) -> Trace:
        """A copy with the given fields changed (traces are never mutated)."""
        return dataclasses.replace(self, **changes)

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(proxy.name for proxy in self.args)

    @property
    def output_names(self) -> set[str]:
        return {proxy.name for proxy in iter_proxies(self.output)}

    def source(self) -> str:
        """The trace as a Python module."""
        return print_trace(self)[0]

    def __str__(self) -> str:
        return self.source()

    def __repr__(self) -> str:
        return f"<Trace {self.name!r}: {len(self.bsyms)} statements, {self.provenance}>"

    def python_callable(self) -> Callable:
        """Compile the printed trace and return its function.

        The source is registered with `linecache` under a unique file name, so tracebacks and
        debuggers show the trace's lines. The code compiled is the source with its callables
        bound once (`bind_callables`), on the same lines, printed as such (NOTE [executable
        source] in `fulmen.core.printer`).
        """
        source, executable, namespace = executable_source(self)
        filename = f"<fulmen {self.name} #{next(_callable_ids)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        with _COMPILE_LOCK:  # CPython 3.11 checks the recursion depth of an AST it compiles
            # in state shared by threads: two at once raise "AST constructor recursion depth
            # mismatch" (SystemError), seen with two threads compiling a jitted function
            code = compile(executable, filename, "exec")
        exec(code, namespace)
        fn = namespace[self.name]
        fn.__fulmen_trace__ = self
        return fn

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.source())

    def _repr_html_(self) -> str:
        return highlight_html(self.source())


def _resolve(node: ast.expr, namespace: dict) -> Any:
    """The object a dotted name (`torch.nn.functional.linear`, `codegen.fusion3`) stands for
    in `namespace`, or None."""
    if not isinstance(node, (ast.Name, ast.Attribute)):
        return None
    return resolve_dotted(ast.unparse(node), namespace)


def bind_callables(module: ast.Module, namespace: dict) -> ast.Module:
    """NOTE [bound callables]: a printed trace calls `torchex.full(...)`,
    `torch.nn.functional.linear(...)`, `codegen.fusion3(...)`: every call would look the dotted
    name up again and go through `Symbol.__call__` (a context-variable read and a second call).
    This rewrites the top-level statement calls of the trace function in `module` (in place)
    to names bound once in `namespace` to what they resolve to, keeping every line where it
    was, so tracebacks, `linecache` and the printed trace still agree. Arguments (a symbol
    passed to `autograd_vjp`) are left alone. Returns `module`."""
    bind = binder(namespace)
    for function in module.body:
        if not isinstance(function, ast.FunctionDef):
            continue
        for statement in function.body:
            call = getattr(statement, "value", None)
            if not isinstance(call, ast.Call) or isinstance(call.func, ast.Name) \
                    and call.func.id.startswith(BOUND_PREFIX):
                continue
            target = bindable(_resolve(call.func, namespace))
            if target is None:
                continue
            call.func = ast.copy_location(ast.Name(bind(target), ast.Load()), call.func)
    return module


class TraceCtx:
    """Records symbol calls while a function runs on proxies.

    `scopes` is a stack of statement lists: the bottom one is the trace body; a symbol's
    decomposition runs with a fresh list on top, which becomes its `subsymbols`.
    The tracer sets `torch_function` to route torch calls on proxies.
    """

    def __init__(self, name: str = "computation") -> None:
        self.name = name
        self.names = NameAllocator()
        self.scopes: list[list[BoundSymbol]] = [[]]
        self.torch_function: Callable | None = None
        # proxies whose strides and storage offset eager decides only at run time, and those
        # computed from them (NOTE [contiguous of a batch of 1] in `fulmen.ops.opaque`)
        self.undecided_layouts: set[str] = set()

    @property
    def bsyms(self) -> list[BoundSymbol]:
        return self.scopes[0]

    def record(self, sym: Symbol, args: tuple, kwargs: dict) -> Any:
        """Run `sym.fn` on proxies and append the resulting bound symbol to the open scope.

        A call whose outputs are all proxies that existed before it (an identity such as
        `x.float()` on a float tensor) records nothing and returns those proxies, as eager
        returns the same tensor.
        """
        if sym.fn is None:
            raise FulmenError("cannot be traced (no meta function)", op=sym.id)
        start = self.names.serial
        scope: list[BoundSymbol] = []
        self.scopes.append(scope)
        try:
            output = sym.fn(*args, **kwargs)
        finally:
            self.scopes.pop()
        if sym.is_prim and scope:
            raise FulmenError("a prim's meta function must not call other symbols", op=sym.id)
        if not any(self.names.serial_of(p.name) >= start for p in iter_proxies(output)):
            return output
        source = user_source_location(3) if len(self.scopes) == 1 else None
        tags = self.call_site_tags() if len(self.scopes) == 1 else frozenset()
        self.scopes[-1].append(BoundSymbol(sym, args, kwargs, output, tuple(scope), source, tags))
        return output

    def check_layout_read(self, proxy, what: str, caller) -> None:
        """Called when code reads the strides or storage offset (`what`) of `proxy` while
        `undecided_layouts` is not empty, from the Python frame `caller`; the tracer raises
        where that layout is not eager's."""

    def call_site_tags(self) -> frozenset[CallSiteTag]:
        """Tags for a top-level statement being recorded now (the tracer adds some)."""
        return frozenset()

    def to_trace(self, args: tuple[Proxy, ...], output: Any, **fields) -> Trace:
        return Trace(self.name, tuple(args), tuple(self.scopes[0]), output, **fields)


def reserved_names(args, bsyms) -> NameAllocator:
    """A name allocator holding every name `args` and `bsyms` (their decompositions too) read
    or write, so that statements recorded with it into that program never reuse one."""
    names = NameAllocator()
    for proxy in iter_proxies(args):
        names.reserve(proxy.name)
    stack = list(bsyms)
    while stack:
        bsym = stack.pop()
        for name in bsym.input_names | bsym.output_names:  # kept by the statement
            names.reserve(name)
        stack.extend(bsym.subsymbols)
    return names


def get_tracectx() -> TraceCtx | None:
    """The trace being recorded in this context, or None outside tracing."""
    return _TRACECTX.get()


@contextlib.contextmanager
def tracing(ctx: TraceCtx) -> Iterator[TraceCtx]:
    """Make `ctx` the recording context for symbol calls inside the block."""
    token = _TRACECTX.set(ctx)
    try:
        yield ctx
    finally:
        _TRACECTX.reset(token)


@contextlib.contextmanager
def not_tracing() -> Iterator[None]:
    """Run a block with no recording context (symbols called inside run their implementation)."""
    token = _TRACECTX.set(None)
    try:
        yield
    finally:
        _TRACECTX.reset(token)
