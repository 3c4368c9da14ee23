"""Values while tracing: answering value-dependent Python with the real inputs (graph breaks).

The tracer holds the real inputs of the call it traces. When the traced code needs a value
(`bool(t)`, `t.item()`, `t in x`, `torch.equal`) or calls an op whose output shape depends on
values (`nonzero`, `x[mask]`, `unique`), `BreakRecorder`:

1. runs the statements recorded so far on the real inputs (a *shadow run*: the recorded symbols'
   implementations, under `no_grad`, without autocast, with its own copy of the random generator
   state taken when tracing started, so random ops draw exactly what the compiled run will draw);
2. computes the real answer and hands it to the Python code (for a data-dependent op: runs the op
   for real and records it with output proxies of the real shapes);
3. records a guard statement (`fulmen.ops.breaks.GUARD`) that re-asks the question at run time.

The trace then goes on as usual; `fulmen.transforms.segments` later cuts it after each guard.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.core import (
    BoundSymbol,
    CallSiteTag,
    FulmenError,
    NotYetSupportedError,
    SourceLocation,
    TraceCtx,
)
from fulmen.core.interpret import bind_outputs
from fulmen.core.proxy import Proxy, iter_proxies, map_proxies
from fulmen.core.source import user_source_location
from fulmen.core.trace import not_tracing
from fulmen.ops.breaks import GRAPH_BREAK_TAG, GUARD, output_shapes
from fulmen.ops.torch import torch_qualname
from fulmen.proxies import TensorProxy
from fulmen.tracer.break_sizes import count_shape
from fulmen.tracer.objects import TRACED_NUMBERS
from fulmen.tracer.symbolic import is_symbolic

_READABLE = {
    torch.Tensor.__bool__: "bool", torch.Tensor.item: "item", torch.Tensor.tolist: "tolist",
    torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
    torch.Tensor.__contains__: "contains", torch.is_nonzero: "is_nonzero",
    torch.Tensor.__format__: "format", torch.Tensor.__repr__: "repr",
    output_shapes: "shapes",
}  # fmt: skip


def describe_question(fn, args: tuple, kwargs: dict) -> str:
    """`bool(t17)`, `torch.nonzero(t3)`: a call as the break's reason names it."""
    name = _READABLE.get(fn) or torch_qualname(fn) or getattr(fn, "__qualname__", repr(fn))
    parts = [p.name if isinstance(p, Proxy) else repr(p) for p in args]
    parts += [f"{key}={value.name if isinstance(value, Proxy) else value!r}"
              for key, value in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _is_symbolic_number(value) -> bool:
    """A SymInt, SymFloat or SymBool whose expression still has a symbol."""
    return isinstance(value, TRACED_NUMBERS) and bool(value.node.expr.free_symbols)


@dataclass(frozen=True)
class BreakInfo:
    """One graph break: what was asked (`bool(t17)`), the answer, and the user's line."""

    reason: str
    answer: Any
    source: SourceLocation | None

    def __str__(self) -> str:
        where = f" at {self.source}" if self.source is not None else ""
        return f"{self.reason}{where}"


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Autocast off for CPU and CUDA inside the block (free when it is off already)."""
    if not torch._C._is_any_autocast_enabled():
        yield
        return
    with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
        yield


def concrete_sizes(value: Any) -> Any:
    """`value` with each symbolic size (`fulmen.tracer.symbolic`) replaced by its value in the
    call being traced (the ShapeEnv's hint, read without recording a guard)."""
    if isinstance(value, torch.SymInt):
        return value.node.hint  # the value in the traced call (no guard recorded)
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(concrete_sizes(item) for item in value)
    if isinstance(value, dict):
        return {key: concrete_sizes(item) for key, item in value.items()}
    if isinstance(value, slice):
        return slice(*concrete_sizes((value.start, value.stop, value.step)))
    return value


class BreakRecorder:
    """Real values of a trace being recorded, and the graph breaks taken (see module docstring).

    `inputs` maps the names of the trace's input proxies to the real tensors; tensors captured
    later (closures, globals) are read from the context's `captured` table.
    """

    def __init__(self, ctx: TraceCtx, inputs: dict[str, torch.Tensor]) -> None:
        self.ctx = ctx
        self.env: dict[str, Any] = dict(inputs)
        self.done = 0
        self.rng = torch.default_generator.get_state()
        self.breaks: list[BreakInfo] = []

    @contextlib.contextmanager
    def _shadow(self) -> Iterator[None]:
        """Real computation inside tracing: no recording, no grad, no autocast, own RNG."""
        user_rng = torch.default_generator.get_state()
        torch.default_generator.set_state(self.rng)
        try:
            with not_tracing(), torch._C.DisableTorchFunction(), torch.no_grad(), no_autocast():
                yield
        finally:
            self.rng = torch.default_generator.get_state()
            torch.default_generator.set_state(user_rng)

    def _catch_up(self) -> None:
        """Run the statements recorded since the last shadow run."""
        for tensor, proxy in getattr(self.ctx, "captured", {}).values():
            self.env.setdefault(proxy.name, tensor)
        bsyms = self.ctx.bsyms
        if self.done == len(bsyms):
            return
        with self._shadow():
            for bsym in bsyms[self.done:]:
                if GRAPH_BREAK_TAG in bsym.sym.tags:
                    continue
                args, kwargs = concrete_sizes(
                    map_proxies(lambda p: self.env[p.name], (bsym.args, bsym.kwargs)))
                try:
                    value = bsym.sym.impl(*args, **kwargs)
                except Exception as error:
                    names = ", ".join(p.name for p in iter_proxies(bsym.output))
                    raise FulmenError(
                        f"computing {names} on the real inputs, to answer a value-dependent "
                        f"question later in the program, failed: {error}", op=bsym.sym.id,
                        where=bsym.source) from error
                bind_outputs(bsym.output, value, self.env)
        self.done = len(bsyms)

    def real(self, tree: Any) -> Any:
        """`tree` with every proxy replaced by its real value (and symbolic sizes by theirs)."""
        self._catch_up()
        return concrete_sizes(map_proxies(lambda p: self.env[p.name], tree))

    def _record_guard(self, fn, expected: Any, args: tuple, kwargs: dict) -> None:
        source = user_source_location()
        question = describe_question(fn, args, kwargs)
        self.ctx.bsyms.append(BoundSymbol(GUARD, (question, fn, expected, *args), dict(kwargs),
                                          None, (), source, frozenset()))
        self.breaks.append(BreakInfo(question, expected, source))

    def take_value(self, fn, args: tuple, kwargs: dict) -> Any:
        """The real answer of `fn(*args, **kwargs)` (e.g. `Tensor.__bool__(t)`), recorded as a
        graph break whose guard re-asks it at run time."""
        real_args, real_kwargs = self.real((args, kwargs))
        with self._shadow():
            answer = fn(*real_args, **real_kwargs)
        self._record_guard(fn, copy.deepcopy(answer), args, kwargs)
        return answer

    def run_for_real(self, sym, fn, args: tuple, kwargs: dict) -> Any:
        """Record `sym` (the opaque symbol of torch callable `fn`, whose output metadata
        PyTorch cannot compute without values) with outputs shaped as the real run's, followed
        by a guard on those shapes.

        Raises:
            NotYetSupportedError: an argument is a symbolic number (`F.pad(x, (0, x.shape[0]))`
                with a symbolic size, whose meta kernel needs the number): the statement would
                run with the symbol itself, so the symbolic trace fails and the call is traced
                for its exact sizes.
        """
        symbolic = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if _is_symbolic_number(leaf)]
        if symbolic:
            raise NotYetSupportedError(
                f"an op whose output PyTorch describes only from values got the symbolic size "
                f"{symbolic[0]} as an argument", op=torch_qualname(fn), where=user_source_location())
        real_args, real_kwargs = self.real((args, kwargs))
        with self._shadow():
            out = fn(*real_args, **real_kwargs)
        tensors = [leaf for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        if not tensors:  # a Python answer, such as a count
            self._record_guard(fn, copy.deepcopy(out), args, kwargs)
            return out
        proxies: dict[int, TensorProxy] = {}
        answer, source, depth = output_shapes(*tensors), user_source_location(), len(self.breaks)
        indices = {id(t): i for i, t in enumerate(tensors)}

        def to_proxy(leaf):
            if not isinstance(leaf, torch.Tensor):
                return leaf
            # NOTE [symbolic counts at a break site]
            shape, strides = count_shape(output_shapes, source, indices[id(leaf)], leaf,
                                         depth, answer, lambda: _inputs_shape_env(self.ctx),
                                         sym.name)
            proxy = TensorProxy(self.ctx.names.new(), shape, leaf.dtype, leaf.device,
                                strides=strides)
            proxies[id(proxy)] = proxy
            self.env[proxy.name] = leaf
            return proxy

        proxy_out = pytree.tree_map(to_proxy, out)
        tags = self.ctx.call_site_tags() | ({CallSiteTag.GRAD} if torch.is_grad_enabled() else set())
        self.ctx.bsyms.append(BoundSymbol(sym, args, dict(kwargs), proxy_out, (),
                                          user_source_location(), frozenset(tags)))
        self.done = len(self.ctx.bsyms)
        outs = [leaf for leaf in pytree.tree_leaves(proxy_out) if isinstance(leaf, TensorProxy)]
        self._record_guard(output_shapes, answer, tuple(outs), {})
        return proxy_out


def _inputs_shape_env(ctx):
    """The ShapeEnv of the trace's symbolic input sizes, or None where it has none: a count
    symbol lives in it (NOTE [symbolic counts at a break site])."""
    for proxy in ctx.mutation.inputs.values():
        for size in proxy.shape:
            if is_symbolic(size):
                return size.node.shape_env
    return None
