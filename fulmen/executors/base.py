"""The executor extension API.

An `OperatorExecutor` maps symbols to implementations. For each bound symbol of a trace, the
claim pass (`fulmen.executors.claim`) asks the executors in priority order; the first one whose
implementation's checker accepts the call site takes it, and the statement is replaced by a call
of that implementation. A symbol nobody claims is offered as its subsymbols (its decomposition).

    myex = OperatorExecutor("myex")
    my_gelu = myex.register_operator("my_gelu", like=F.gelu, fn=my_gelu_impl)
    myex.register_implementation(F.gelu, my_gelu, checker=lambda a, approximate="none":
                                 a.dtype == torch.float32)
    fulmen.jit(fn, executors=[myex, "torch"])

A torch callable and the fulmen symbol for it are interchangeable wherever a target is expected.
A `FusionExecutor` instead groups neighbouring claimable statements into fusion regions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fulmen.core import BoundSymbol, Symbol, Tag, Trace, TraceCtx, get_tracectx, tracing
from fulmen.core.symbol import Namespace
from fulmen.ops.opaque import opaque_symbol
from fulmen.ops.torch import symbol_for, torch_qualname
from fulmen.transforms.fusion import partition_for_fusion

TORCH_NAMESPACE = Namespace("torch", "torch", "import torch")


def resolve_target(target: Symbol | Callable) -> Symbol:
    """The fulmen symbol meant by `target`: a symbol itself, or the torch callable's symbol
    (its torch-level op, or else its opaque symbol)."""
    if isinstance(target, Symbol):
        return target
    if not callable(target):
        raise TypeError(f"{target!r} is neither a fulmen symbol nor a torch callable")
    return symbol_for(target) or opaque_symbol(target)


@dataclass(frozen=True)
class Implementation:
    """How an executor runs a symbol: `op` replaces it when `checker(*args, **kwargs)` holds."""

    op: Symbol
    checker: Callable[..., bool] | None = None


class Executor:
    """Base class of executors. `name` is how users refer to it in `executors=[...]`."""

    def __init__(self, name: str) -> None:
        if not name.isidentifier():
            raise ValueError(f"executor name {name!r} must be a Python identifier")
        self.name = name
        self.namespace = Namespace(
            name, self, f"from fulmen.extend import get_executor\n{name} = get_executor({name!r})"
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class OperatorExecutor(Executor):
    """An executor that runs individual operations (see the module docstring)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.implementations: dict[Symbol, Implementation] = {}
        self.operators: dict[str, Symbol] = {}

    def __getattr__(self, name: str) -> Symbol:
        operators = self.__dict__.get("operators", {})
        if name in operators:
            return operators[name]
        raise AttributeError(f"executor {self.__dict__.get('name')!r} has no operator {name!r}")

    def register_operator(
        self,
        name: str,
        *,
        fn: Callable,
        like: Symbol | Callable | None = None,
        meta: Callable | None = None,
        tags: set[str] | frozenset = frozenset(),
    ) -> Symbol:
        """Define a new operator of this executor and return its symbol.

        `fn` runs on real tensors. The trace-time meta function is `meta`, or that of `like`
        (a torch callable or symbol with the same signature). Calling the returned symbol inside
        a jitted function records it; printed traces call it as `<executor>.<name>(...)`.
        If `fn` is a public torch callable, printed traces call it by its torch name instead.

        Raises:
            ValueError: if neither `meta` nor `like` is given, or the name is taken.
        """
        if name in self.operators:
            raise ValueError(f"executor {self.name!r} already has an operator {name!r}")
        if meta is None:
            if like is None:
                raise ValueError("register_operator needs `like=` or `meta=`")
            meta = _meta_like(resolve_target(like))
        torch_name = torch_qualname(fn)
        if torch_name is not None:
            namespace, python_name = TORCH_NAMESPACE, torch_name
        else:
            namespace, python_name = self.namespace, f"{self.namespace.alias}.{name}"
        op = Symbol(name, meta, namespace=namespace, python_name=python_name, impl=fn,
                    tags=set(tags), executor=self)
        self.operators[name] = op
        return op

    def register_implementation(
        self,
        target: Symbol | Callable,
        op: Symbol | None = None,
        *,
        fn: Callable | None = None,
        checker: Callable[..., bool] | None = None,
    ) -> Implementation:
        """Claim `target` (a symbol or torch callable) for this executor.

        Give `op` (an operator from `register_operator`) or `fn` (an implementation with the
        target's signature). `checker(*args, **kwargs)` decides per call site; the call site's
        arguments are proxies and constants, so checkers test metadata (dtype, shape, device).
        """
        sym = resolve_target(target)
        if op is None:
            if fn is None:
                raise ValueError("register_implementation needs `op` or `fn`")
            # an implementation of a view is a view (`Tag.VIEW`: the memory estimate reads it)
            op = self.register_operator(sym.name, fn=fn, meta=sym.fn, tags=sym.tags & {Tag.VIEW})
        impl = Implementation(op, checker)
        self.implementations[sym] = impl
        return impl

    def implements(self, target: Symbol | Callable, *, checker: Callable[..., bool] | None = None):
        """Decorator form of `register_implementation(target, fn=...)`."""

        def decorate(fn: Callable) -> Callable:
            self.register_implementation(target, fn=fn, checker=checker)
            return fn

        return decorate

    def implementation_for(self, sym: Symbol) -> Implementation | None:
        """The implementation this executor has for `sym` (subclasses may compute it)."""
        if sym.executor is self:
            return Implementation(sym)
        return self.implementations.get(sym)

    def claim(self, bsym: BoundSymbol) -> BoundSymbol | None:
        """The statement rewritten to run on this executor, or None if it does not claim it."""
        impl = self.implementation_for(bsym.sym)
        if impl is None:
            return None
        if impl.checker is not None and not impl.checker(*bsym.args, **bsym.kwargs):
            return None
        return BoundSymbol(impl.op, bsym.args, bsym.kwargs, bsym.output, (), bsym.source,
                           bsym.tags)


class FusionExecutor(Executor):
    """An executor that fuses regions of claimable statements into single kernels.

    Subclasses implement `can_fuse(bsym)` (may this statement join a region?) and
    `fuse(region, outputs) -> BoundSymbol | None` (the fused statement computing `outputs`
    from the region's inputs, or None to leave the region unfused); `can_fuse_region(region)`
    may veto a merge. The shared partitioner (`fulmen.transforms.fusion`) calls them.

    The fusion-symbol registry is shared: `fusion_statement` makes the symbol
    `<executor>.fusionN` of a region (printed traces find it as an attribute of the executor)
    and the statement calling it; `fallback_callable` runs a region's own trace with an operator
    executor, for fusions that cannot run their kernel.

        name = self.next_fusion_name()
        return self.fusion_statement(name, MyRegion(name, ...), region, inputs, outputs)
    """

    symbolic_sizes = False  # whether regions with symbolic sizes (`torch.SymInt`) are offered

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.fusions: dict[str, Symbol] = {}
        self._fusion_ids = itertools.count()

    def __getattr__(self, name: str) -> Symbol:
        fusions = self.__dict__.get("fusions", {})
        if name in fusions:
            return fusions[name]
        raise AttributeError(f"executor {self.__dict__.get('name')!r} has no fusion {name!r}")

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        raise NotImplementedError

    def can_fuse_region(self, region: list[BoundSymbol]) -> bool:
        return True

    def fuse(self, region: list[BoundSymbol], outputs: list) -> BoundSymbol | None:
        raise NotImplementedError

    def fusion_pass(self, trace: Trace, before: Sequence[OperatorExecutor] = ()) -> Trace:
        """Fuse the regions of `trace` this executor can fuse; statements claimed by the
        operator executors `before` (ahead of this one in the priority list) stay as they are."""
        return partition_for_fusion(trace, self, before)

    def next_fusion_name(self) -> str:
        """A fresh fusion name of this executor: `fusion0`, `fusion1`, ..."""
        return f"fusion{next(self._fusion_ids)}"

    def fusion_statement(self, name: str, impl: Callable, region: list[BoundSymbol],
                         inputs: Sequence, outputs: Sequence) -> BoundSymbol:
        """Register the fusion symbol `name` running `impl` and return the statement that calls
        it on `inputs`, computing `outputs`, with the region as its subsymbols."""
        output = outputs[0] if len(outputs) == 1 else tuple(outputs)
        sym = Symbol(name, None, namespace=self.namespace, python_name=f"{self.name}.{name}",
                     impl=impl, tags={"fusion"}, executor=self)
        self.fusions[name] = sym
        return BoundSymbol(sym, tuple(inputs), {}, output, tuple(region), region[0].source)

    @staticmethod
    def fallback_callable(body: Trace, executor: OperatorExecutor) -> Callable:
        """A callable running `body` (a fusion region's own trace) with `executor`, which
        claims every statement of it (the torch executor runs every prim).

        Raises:
            ValueError: if `executor` leaves a statement of `body` unclaimed.
        """
        bsyms = []
        for bsym in body.bsyms:
            claimed = executor.claim(bsym)
            if claimed is None:
                raise ValueError(f"{executor.name} cannot run {bsym.sym.name} of {body.name}")
            bsyms.append(claimed)
        return body.replace(bsyms=tuple(bsyms)).python_callable()


def _meta_like(sym: Symbol) -> Callable[..., Any]:
    """A meta function that traces `sym` on throwaway proxies and keeps only its outputs."""

    def meta(*args, **kwargs):
        outer = get_tracectx()
        scratch = TraceCtx("scratch")
        if outer is not None:
            scratch.names = outer.names
            scratch.torch_function = outer.torch_function
        with tracing(scratch):
            return sym.fn(*args, **kwargs)

    return meta
