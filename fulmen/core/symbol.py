"""Symbols and bound symbols: the statements of a trace.

A `Symbol` is an operation: a prim (its function is a meta function), a torch-level op (its
function is a decomposition into other symbols), or an executor's operation (it prints as the
executor's callable and runs its implementation). A `BoundSymbol` is one call of a symbol in a
trace: arguments (proxies and constants), output, the symbols its decomposition called
(`subsymbols`) and the user's source line.

Calling a symbol while a trace is being recorded records a bound symbol; calling it outside
tracing runs its implementation (`Symbol.impl`) on real values, which is what lets every printed
trace run as Python.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import importlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from fulmen.core.errors import FulmenError
from fulmen.core.names import reserve_global
from fulmen.core.proxy import Proxy, iter_proxies, map_proxies
from fulmen.core.source import SourceLocation


@dataclass(frozen=True, slots=True)
class Namespace:
    """How a printed trace reaches a symbol: `import_line` binds `alias` to `value`.

    `value` is the object itself, or the dotted path of a module to import.
    """

    alias: str
    value: Any
    import_line: str

    def __post_init__(self) -> None:
        reserve_global(self.alias)  # no trace variable may shadow the alias

    def resolve(self) -> Any:
        if isinstance(self.value, str):  # an imported module from `sys.modules` (the printer
            # resolves every statement's namespace): `import_module` answers the same, slower
            return sys.modules.get(self.value) or importlib.import_module(self.value)
        return self.value


class Tag(enum.StrEnum):
    """What a symbol is, declared with it (`@prim(..., tags=...)`, `@torch_op(..., tags=...)`)
    and read by every pass. A member equals its string (`"opaque" in sym.tags` holds), and a
    symbol refuses a tag that is not a member, so a misspelt tag fails where it is declared.

    `VIEW`: when torch runs the statement, its outputs share the storage of its (first) tensor
    input: the view prims (`broadcast_in_dim`, `permute`, `slice`, `squeeze`) and the
    torch-level ops whose decomposition is made of view prims and `prims.reshape` only and that
    PyTorch documents as views (`view`, `transpose`, `split`, basic indexing, ...). Not
    `reshape`/`flatten`/`contiguous`, which copy a tensor they cannot view, nor
    `functionalized.view_scatter`, which writes into a copy of its base. Remat, the memory
    estimate and fusion read it (`BoundSymbol.is_view`).
    """

    ELEMENTWISE = "elementwise"
    UNARY = "unary"
    BINARY = "binary"
    TERNARY = "ternary"
    REDUCTION = "reduction"
    INDEX = "index"  # returns indices (argmax)
    SHAPE = "shape"  # moves elements without computing (reshape, cat, pad, flip)
    VIEW = "view"
    GATHER = "gather"
    SCATTER = "scatter"
    MATMUL = "matmul"
    CREATION = "creation"  # a prim making a tensor from numbers
    FACTORY = "factory"  # a torch factory (torch.zeros, torch.rand, ...)
    # reads only its tensor argument's metadata: eager's result never requires grad
    # (torch.zeros_like, Tensor.new_ones, ...)
    NOT_DIFFERENTIABLE = "not_differentiable"
    RANDOM = "random"  # draws from the global generator
    OPAQUE = "opaque"  # runs a torch callable fulmen does not decompose
    SIDE_EFFECT = "side_effect"  # dead code elimination keeps it
    WRITE_BACK = "write_back"  # the copy of a mutated input back into it
    FUNCTIONALIZED = "functionalized"  # an in-place call's functional form
    FUSION = "fusion"  # a fusion executor's region
    AUTOGRAD_FUNCTION = "autograd_function"  # a user torch.autograd.Function
    GRAPH_BREAK = "graph_break"  # the guard statement a graph break records


class CallSiteTag(enum.StrEnum):
    """What the tracer knew where it recorded a statement (`BoundSymbol.tags`), set by the
    tracer (`TracerCtx.call_site_tags`, the graph-break recorder) and read by passes. A
    statement refuses a tag that is not a member, so a misspelt one fails where it is written.

    `CHECKPOINT`: inside a non-reentrant `torch.utils.checkpoint` region (rematerialization
    recomputes its values); `NO_GRAD`: recorded under `torch.no_grad()` in a differentiated
    trace; `NO_GRAD_DETACH`: the detach the tracer adds there (NOTE [a view of an input
    returned] in `fulmen.returned_views`); `GRAD`: a data-dependent op run between segments,
    called with grad mode on (`fulmen.tree`); `TRACED_BACKWARD`: the seed or a statement of a
    `loss.backward()` traced inside the function (`fulmen.tracer.backward_in_trace`), which a
    later backward in the same trace does not differentiate (eager's `.grad` has no graph).
    """

    CHECKPOINT = "checkpoint"
    NO_GRAD = "no_grad"
    NO_GRAD_DETACH = "no_grad_detach"
    GRAD = "grad"
    TRACED_BACKWARD = "traced_backward"


class Symbol:
    """An operation that can appear in a trace.

    Attributes:
        name: short name, e.g. `"add"`.
        fn: at trace time, the meta function (prims) or decomposition (torch-level ops) called
            on proxies; it returns the output proxies.
        namespace: where printed traces find the symbol (`prims`, `ltorch`, `torch`, ...).
        python_name: the dotted expression a printed trace calls, e.g. `"torch.add"`.
        is_prim: prims have no decomposition; their `fn` must not call other symbols.
        impl: what runs on real tensors when the symbol is called outside tracing.
        tags: `Tag` members (strings naming them are accepted; others raise ValueError).
        torch_fn: for torch-level ops, the torch callable the symbol stands for.
    """

    __slots__ = ("name", "fn", "namespace", "python_name", "is_prim", "impl", "tags", "torch_fn",
                 "executor", "__weakref__")

    def __init__(
        self,
        name: str,
        fn: Callable | None,
        *,
        namespace: Namespace,
        python_name: str | None = None,
        is_prim: bool = False,
        impl: Callable | None = None,
        tags: Iterable[Tag | str] = frozenset(),
        torch_fn: Callable | None = None,
        executor: Any = None,
    ):
        self.name = name
        self.fn = fn
        self.namespace = namespace
        self.python_name = python_name or f"{namespace.alias}.{name}"
        self.is_prim = is_prim
        self.impl = impl
        self.tags = frozenset(map(Tag, tags))
        self.torch_fn = torch_fn
        self.executor = executor

    @property
    def id(self) -> str:
        return f"{self.namespace.alias}.{self.name}"

    def __repr__(self) -> str:
        return f"<Symbol {self.python_name}>"

    def __call__(self, *args, **kwargs):
        ctx = _TRACECTX.get()
        if ctx is None:
            if self.impl is None:
                raise FulmenError("has no implementation to run outside tracing", op=self.id)
            return self.impl(*args, **kwargs)
        return ctx.record(self, args, kwargs)


@dataclass(frozen=True, slots=True)
class BoundSymbol:
    """One statement of a trace: `output = sym(*args, **kwargs)`.

    `subsymbols` are the bound symbols the symbol's decomposition recorded (empty for prims and
    executor operations); `source` is the user's line, set on top-level statements; `tags` mark
    the call site (`CallSiteTag` members: `CHECKPOINT` inside a `torch.utils.checkpoint`
    region, ...).
    """

    sym: Symbol
    args: tuple
    kwargs: dict = field(default_factory=dict)
    output: Any = None
    subsymbols: tuple[BoundSymbol, ...] = ()
    source: SourceLocation | None = None
    tags: frozenset[CallSiteTag] = frozenset()
    # NOTE [names of a statement, kept]: the names it reads and writes, computed at the first
    # question (passes ask tens of thousands of times per compile) and kept. A statement is
    # frozen and its arguments are not changed after it is recorded; the kept sets are
    # frozensets, so code that tried to change one would raise, not corrupt the statement.
    _names: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # the proxies it reads (with repeats, in argument order) and writes, kept alike
    _proxies: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tags:  # members only: a misspelt tag fails where the statement is made
            object.__setattr__(self, "tags", frozenset(map(CallSiteTag, self.tags)))

    def replace(self, **changes) -> BoundSymbol:
        return dataclasses.replace(self, **changes)

    def renamed(self, rename: Callable[[Proxy], Proxy], *, outputs: bool = False) -> BoundSymbol:
        """This statement reading `rename(p)` for each proxy `p` it reads, its decomposition
        too; with `outputs`, its decomposition's and its own outputs renamed as well."""
        changes = {"output": map_proxies(rename, self.output)} if outputs else {}
        return self.replace(args=map_proxies(rename, self.args),
                            kwargs=map_proxies(rename, self.kwargs),
                            subsymbols=tuple(sub.renamed(rename, outputs=outputs)
                                             for sub in self.subsymbols), **changes)

    @property
    def is_view(self) -> bool:
        """Whether torch returns the outputs as views of an input (`Tag.VIEW`): saving one
        keeps its base's storage alive, and it allocates nothing."""
        return Tag.VIEW in self.sym.tags

    @property
    def is_del(self) -> bool:
        """Whether this is a `del a, b` statement (frees names; `DEL` below)."""
        return self.sym is DEL

    @property
    def read_proxies(self) -> tuple[Proxy, ...]:
        """Every proxy in its arguments, in argument order, repeats included (kept: NOTE
        [names of a statement, kept])."""
        return (self._proxies or self._keep_proxies())[0]

    @property
    def proxy_inputs(self) -> list[Proxy]:
        """Proxies read by this statement, in argument order, without repeats."""
        seen: dict[str, Proxy] = {}
        for proxy in self.read_proxies:
            seen.setdefault(proxy.name, proxy)
        return list(seen.values())

    @property
    def proxy_outputs(self) -> list[Proxy]:
        return list((self._proxies or self._keep_proxies())[1])

    def _keep_proxies(self) -> tuple[tuple[Proxy, ...], tuple[Proxy, ...]]:
        proxies = (tuple(iter_proxies((self.args, self.kwargs))),
                   tuple(iter_proxies(self.output)))
        object.__setattr__(self, "_proxies", proxies)
        return proxies

    @property
    def input_names(self) -> frozenset[str]:
        """The names of the proxies it reads (kept: NOTE [names of a statement, kept])."""
        return (self._names or self._keep_names())[0]

    @property
    def output_names(self) -> frozenset[str]:
        """The names of the proxies it writes (kept: NOTE [names of a statement, kept])."""
        return (self._names or self._keep_names())[1]

    def _keep_names(self) -> tuple[frozenset[str], frozenset[str]]:
        reads, writes = self._proxies or self._keep_proxies()
        names = (frozenset(proxy.name for proxy in reads),
                 frozenset(proxy.name for proxy in writes))
        object.__setattr__(self, "_names", names)
        return names

    @property
    def has_side_effects(self) -> bool:
        """Whether dead code elimination must keep it: tagged `side_effect`, or `random` (it
        advances the global generator), itself or anywhere in its decomposition."""
        if self.sym.tags & _EFFECT_TAGS:
            return True
        return any(sub.has_side_effects for sub in self.subsymbols)


_EFFECT_TAGS = frozenset({"side_effect", "random"})

# The trace being recorded in this thread/context, or None. Set by `fulmen.core.trace.tracing`.
_TRACECTX: contextvars.ContextVar = contextvars.ContextVar("fulmen_tracectx", default=None)


CORE_NAMESPACE = Namespace("fulmen_core", None, "")

# `del a, b`: frees the named tensors. Inserted by the delete-last-used pass; prints specially.
DEL = Symbol("del", None, namespace=CORE_NAMESPACE, python_name="del", tags={"side_effect"})


def any_tagged(bsyms: Iterable[BoundSymbol], tags: Iterable[Tag | str]) -> bool:
    """Whether a statement among `bsyms`, or inside their decompositions at any depth, carries
    one of `tags` (random draws, write-backs, side effects)."""
    return _any_tagged(bsyms, frozenset(map(Tag, tags)))


def _any_tagged(bsyms: Iterable[BoundSymbol], tags: frozenset[Tag]) -> bool:
    return any(bsym.sym.tags & tags or _any_tagged(bsym.subsymbols, tags) for bsym in bsyms)


def flatten(bsym: BoundSymbol, stop: Callable[[BoundSymbol], bool] | None = None,
            ) -> list[BoundSymbol]:
    """`bsym` as the statements of its decomposition, recursively, in order: a statement
    without subsymbols (a prim, an opaque or executor op) or one for which `stop(statement)`
    holds stays whole. Every part carries the source line of `bsym`; `[bsym]` itself (the same
    object) when nothing is expanded."""
    if not bsym.subsymbols or (stop is not None and stop(bsym)):
        return [bsym]
    return [part for sub in bsym.subsymbols
            for part in flatten(sub.replace(source=bsym.source), stop)]


def free_inputs(bsyms: Iterable[BoundSymbol]) -> list[Proxy]:
    """The proxies the statements `bsyms` read that none of them defines, in order of first
    read (a fusion region's inputs; the values a trace prefix reads from outside it)."""
    defined: set[str] = set()
    free: dict[str, Proxy] = {}
    for bsym in bsyms:
        for proxy in bsym.read_proxies:
            if proxy.name not in defined:
                free.setdefault(proxy.name, proxy)
        defined |= bsym.output_names
    return list(free.values())
