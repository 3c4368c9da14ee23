"""The claim pass: turn a trace of torch-level ops into an execution trace.

For each statement, the executors are asked in priority order; the first that claims it
(`OperatorExecutor.claim`) replaces it with a call of its implementation. A statement nobody
claims is replaced by its subsymbols, each offered in turn. Fusion executors run their fusion
pass over the trace first.
"""

from __future__ import annotations

from collections.abc import Sequence

from fulmen.core import BoundSymbol, FulmenError, Tag, Trace, TraceCtx, any_tagged
from fulmen.core.names import NameAllocator
from fulmen.core.proxy import iter_proxies
from fulmen.core.trace import reserved_names, tracing
from fulmen.executors.base import Executor, FusionExecutor, OperatorExecutor
from fulmen.executors.dense_layout import dense_order
from fulmen.executors.torch import AS_LAYOUT, torch_ex
from fulmen.proxies import TensorProxy
from fulmen.transforms.base import transform


def _claim(bsym: BoundSymbol, executors: Sequence[OperatorExecutor]) -> list[BoundSymbol]:
    for ex in executors:
        claimed = ex.claim(bsym)
        if claimed is not None:
            return [claimed]
    if bsym.sym.executor is not None and bsym.sym.executor not in executors:
        raise FulmenError(
            f"is an operator of executor {bsym.sym.executor.name!r}, which is not in the "
            "executor list",
            op=bsym.sym.python_name,
            where=bsym.source,
            hint=f"pass executors=[{bsym.sym.executor.name!r}, ...] to fulmen.jit",
        )
    if not bsym.subsymbols:
        names = [ex.name for ex in executors]
        raise FulmenError(f"no executor in {names} can run it", op=bsym.sym.id, where=bsym.source)
    claimed = []
    for sub in bsym.subsymbols:
        claimed.extend(_claim(sub.replace(source=bsym.source), executors))
    return claimed


@transform("claiming by executors")
def claim_executors(trace: Trace, executors: Sequence[Executor]) -> Trace:
    """Rewrite every statement to run on the first executor in `executors` that claims it."""
    for i, ex in enumerate(executors):
        if isinstance(ex, FusionExecutor):
            before = [e for e in executors[:i] if isinstance(e, OperatorExecutor)]
            trace = ex.fusion_pass(trace, before)
    operator_executors = [ex for ex in executors if isinstance(ex, OperatorExecutor)]
    bsyms = []
    eager_layout: set[str] = set()  # outputs of torch-level and opaque ops torch runs whole
    fused: set[str] = set()
    drifted: set[str] = set()  # fused outputs not laid out as eager's, and what reads them
    relayout = _Relayout(trace)
    for bsym in trace.bsyms:
        if bsym.is_del or isinstance(bsym.sym.executor, FusionExecutor):
            bsyms.append(bsym)
            fused |= bsym.output_names
            drifted |= {p.name for p in bsym.proxy_outputs if isinstance(p, TensorProxy)
                        and _needs_layout(p, row_major_ok=True)}
        else:
            # NOTE [random draws read their input's layout]
            if fused and any_tagged((bsym,), {Tag.RANDOM}):
                bsym = relayout.inputs_of(bsym, fused, bsyms)
            claimed = _claim(bsym, operator_executors)
            if (len(claimed) == 1 and not bsym.sym.is_prim
                    and claimed[0].sym.executor is torch_ex):
                eager_layout |= claimed[0].output_names
            if any(p.name in drifted for p in bsym.proxy_inputs):
                drifted |= bsym.output_names
            bsyms.extend(claimed)
    return _with_output_layouts(trace, bsyms, eager_layout - drifted, fused)


def _with_output_layouts(trace: Trace, bsyms: list[BoundSymbol], eager_layout: set[str],
                         fused: set[str]) -> Trace:
    """NOTE [output layout]: the tensors a program returns have eager's strides.

    Traced proxies report eager's strides (NOTE [layout truth] in `fulmen.tracer.layout_truth`),
    and torch running an op whole produces them; a fusion (whose kernels write contiguous
    outputs) or an op's prims run one by one may not. So each returned tensor with a dense
    eager layout that is not computed by torch running its op whole goes through
    `torchex.as_layout(t, strides)`: the tensor itself when its strides already match, else a
    copy with eager's strides. Outputs of fusions are taken to be row-major, so only those whose
    eager layout is not (channels_last, a permutation) get the step. Torch running an op whole
    follows the layout it is handed, so an op reading (directly or through other ops) a fused
    tensor whose eager layout is not row-major is not trusted either: a conv of a fused `relu`
    of a channels-last tensor came back row-major (`eager_layout` excludes those). Residuals of a forward
    trace and the gradients of a backward trace are left alone (autograd lays gradients out
    as their parameters).
    """
    if trace.name == "backward":
        return trace.replace(bsyms=tuple(bsyms))
    returned = trace.output[0] if trace.name == "forward" else trace.output
    inputs = set(trace.arg_names)
    targets = {}
    for proxy in iter_proxies(returned):
        if (isinstance(proxy, TensorProxy) and proxy.name not in inputs
                and proxy.name not in eager_layout
                and _needs_layout(proxy, row_major_ok=proxy.name in fused)):
            targets[proxy.name] = proxy
    if not targets:
        return trace.replace(bsyms=tuple(bsyms))
    names = reserved_names(trace.args, bsyms)
    relaid = {}
    for name, proxy in targets.items():
        with tracing(_NamingCtx(names)):
            relaid[name] = AS_LAYOUT(proxy, tuple(proxy.stride()))
    bsyms = list(bsyms)
    for name, proxy in targets.items():
        bsyms.append(BoundSymbol(AS_LAYOUT, (proxy, tuple(proxy.stride())), {}, relaid[name]))
    output = _replace_proxies(trace.output, relaid)
    return trace.replace(bsyms=tuple(bsyms), output=output)


class _Relayout:
    """NOTE [random draws read their input's layout]: `F.dropout`, `bernoulli`, `rand_like`
    draw into a tensor laid out as their input and fill it in memory order, so the mask eager
    draws for a transposed input is not the one drawn for a row-major copy of it. A fusion
    writes row-major outputs whatever eager's layout (NOTE [output layout]), so the input of a
    random op that a fusion computed goes through `torchex.as_layout` first (a copy exactly
    where eager's layout is dense and not row-major; `F.dropout(x.t() * 2)` with a fused
    `x.t() * 2` drew another mask than eager once its kernel was ready)."""

    def __init__(self, trace: Trace) -> None:
        self._trace = trace
        self._names: NameAllocator | None = None

    def inputs_of(self, bsym: BoundSymbol, fused: set[str], bsyms: list) -> BoundSymbol:
        """`bsym` reading its fused inputs in eager's layout; the `as_layout` statements are
        appended to `bsyms`."""
        targets = {p.name: p for p in bsym.proxy_inputs
                   if p.name in fused and isinstance(p, TensorProxy)
                   and _needs_layout(p, row_major_ok=True)}
        if not targets:
            return bsym
        if self._names is None:
            self._names = reserved_names(self._trace.args, self._trace.bsyms)
        relaid = {}
        for name, proxy in targets.items():
            with tracing(_NamingCtx(self._names)):
                relaid[name] = AS_LAYOUT(proxy, tuple(proxy.stride()))
            bsyms.append(BoundSymbol(AS_LAYOUT, (proxy, tuple(proxy.stride())), {},
                                     relaid[name]))
        return bsym.replace(args=_replace_proxies(bsym.args, relaid),
                            kwargs=_replace_proxies(bsym.kwargs, relaid))


def _needs_layout(proxy: TensorProxy, row_major_ok: bool) -> bool:
    """Whether `proxy` reports eager's strides, dense and non-overlapping (and, with
    `row_major_ok`, not row-major). Symbolic sizes and strides are compared as expressions
    (`dense_order`), never evaluated: no guard is added."""
    if not getattr(proxy, "_fulmen_exact_strides", False):
        return False
    order = dense_order(tuple(proxy.shape), tuple(proxy.stride()))
    if order is None:
        return False
    return not (row_major_ok and order == sorted(order, reverse=True))


class _NamingCtx(TraceCtx):
    """A recording context that only hands out names (for proxies made by a pass)."""

    def __init__(self, names: NameAllocator) -> None:
        super().__init__("naming")
        self.names = names

    def record(self, sym, args, kwargs):
        return sym.fn(*args, **kwargs)


def _replace_proxies(value, mapping: dict):
    if isinstance(value, TensorProxy):
        return mapping.get(value.name, value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_replace_proxies(v, mapping) for v in value)
    if isinstance(value, list):
        return [_replace_proxies(v, mapping) for v in value]
    if isinstance(value, dict):
        return {k: _replace_proxies(v, mapping) for k, v in value.items()}
    return value


