"""Cutting a traced path at its graph breaks into segments.

A trace recorded with graph breaks (`fulmen.tracer.breaks`) is one straight-line path through
the program, with a guard statement (`breaks.guard(...)`) at each point where Python needed a
value. `split_at_breaks` cuts it after each guard: segment *i* holds the statements between
guard *i-1* and guard *i*, takes every earlier value it reads as an input, and returns every
value it defines that a later segment, a guard or the program's output reads. Each segment is an
ordinary trace that the usual passes (autodiff, fusion, rematerialization) compile on its own;
`fulmen.tree` runs them one after another, evaluating each guard between them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fulmen.core import BoundSymbol, Trace
from fulmen.core.printer import statement_source, type_comment
from fulmen.core.proxy import Proxy, iter_proxies
from fulmen.ops.breaks import GRAPH_BREAK_TAG, output_shapes
from fulmen.proxies import TensorProxy
from fulmen.transforms.dce import size_sources


@dataclass(frozen=True)
class Segment:
    """One piece of a path: its trace and the guard evaluated after it (None for the last).

    `op` is the statement of an op whose output shape depends on values (`nonzero`, `x[mask]`):
    it runs eagerly between this segment and the guard on its output shapes, so the segment
    before it never depends on those shapes. `fingerprint` identifies the statements (and the
    guard's question, not its answer), so a retrace that reaches the same segment again can
    share the compiled one.
    """

    trace: Trace
    guard: BoundSymbol | None
    fingerprint: str
    op: BoundSymbol | None = None

    @property
    def answer(self):
        """The answer the rest of the path was recorded under."""
        return self.guard.args[2] if self.guard is not None else None


def is_guard(bsym: BoundSymbol) -> bool:
    return GRAPH_BREAK_TAG in bsym.sym.tags


def _fingerprint(bsyms, guard: BoundSymbol | None, op: BoundSymbol | None) -> str:
    lines = [f"{statement_source(b)}  # {type_comment(b.output)}" for b in bsyms]
    if op is not None:
        lines.append(f"then {statement_source(op)}")
    if guard is not None:
        question, fn, _, *args = guard.args
        lines.append(f"guard {question} {fn!r} {[getattr(a, 'name', a) for a in args]} "
                     f"{guard.kwargs}")
    return "\n".join(lines)


def _as_input(proxy: Proxy, requires_grad: set[str]) -> Proxy:
    """The input proxy of a later segment for a value an earlier one computed: the same name and
    metadata, requiring grad when the value depends on an input that does."""
    if not isinstance(proxy, TensorProxy):
        return proxy
    differentiable = proxy.dtype.is_floating_point or proxy.dtype.is_complex
    flag = differentiable and proxy.name in requires_grad
    if flag == proxy.requires_grad:
        return proxy
    return TensorProxy(proxy.name, proxy.shape, proxy.dtype, proxy.device,
                       requires_grad=flag, strides=proxy.stride())


def split_at_breaks(trace: Trace, requires_grad: frozenset[str] | set[str] = frozenset()
                    ) -> list[Segment]:
    """Cut `trace` after each guard statement (see the module docstring).

    `requires_grad` names the values that depend on an input requiring grad; a later segment's
    input for such a value requires grad, so the segment is differentiated with respect to it.
    """
    pieces: list[tuple[list[BoundSymbol], BoundSymbol | None, BoundSymbol | None]] = []
    current: list[BoundSymbol] = []
    for bsym in trace.bsyms:
        if not is_guard(bsym):
            current.append(bsym)
            continue
        op = None
        if bsym.args[1] is output_shapes and current and \
                [p.name for p in current[-1].proxy_outputs] == [p.name for p in bsym.proxy_inputs]:
            op = current.pop()
        pieces.append((current, bsym, op))
        current = []
    pieces.append((current, None, None))
    # names read at or after each piece: later statements, ops, guards and the program's output
    read_later: list[set[str]] = [set() for _ in pieces]
    reads = {p.name for p in iter_proxies(trace.output)}
    for index in range(len(pieces) - 1, -1, -1):
        bsyms, guard, op = pieces[index]
        if guard is not None:
            reads |= guard.input_names
        if op is not None:
            reads = (reads - op.output_names) | op.input_names
        read_later[index] = set(reads)
        for bsym in bsyms:
            reads |= bsym.input_names
    by_name = {p.name: p for p in trace.args}
    segments = []
    made: list[Proxy] = []  # the outputs of the data-dependent ops run so far
    for index, (bsyms, guard, op) in enumerate(pieces):
        defined: dict[str, Proxy] = {}
        inputs: dict[str, Proxy] = {}
        for bsym in bsyms:
            for proxy in bsym.proxy_inputs:
                if proxy.name not in defined and proxy.name not in inputs:
                    arg = by_name.get(proxy.name)
                    inputs[proxy.name] = arg if arg is not None else _as_input(proxy, requires_grad)
            for proxy in bsym.proxy_outputs:
                defined[proxy.name] = proxy
        # a count made symbolic at a break (NOTE [symbolic counts at a break site]) is read
        # from the op's output that holds it
        for arg in size_sources(bsyms, (), tuple(inputs.values()), (*trace.args, *made)):
            inputs.setdefault(arg.name, arg)
        outputs = tuple(p for name, p in defined.items() if name in read_later[index])
        segment_trace = Trace(f"{trace.name}_segment{index}", tuple(inputs.values()),
                              tuple(bsyms), outputs, provenance=f"segment {index} of the path",
                              seconds=trace.seconds)
        segments.append(Segment(segment_trace, guard, _fingerprint(bsyms, guard, op), op))
        if op is not None:
            made += [_as_input(p, requires_grad) for p in op.proxy_outputs
                     if isinstance(p, TensorProxy)]
    return segments


def with_outputs(segment: Segment, names: list[str]) -> Segment:
    """`segment` returning the values `names` (each defined by one of its statements)."""
    defined = {p.name: p for b in segment.trace.bsyms for p in b.proxy_outputs}
    outputs = tuple(defined[name] for name in names)
    return Segment(segment.trace.replace(output=outputs), segment.guard, segment.fingerprint,
                   segment.op)


def guard_inputs(guard: BoundSymbol) -> tuple:
    """`(fn, args, kwargs)` of a guard statement: the question and what it is asked of."""
    _, fn, _, *args = guard.args
    return fn, tuple(args), dict(guard.kwargs)


__all__ = ["Segment", "guard_inputs", "split_at_breaks", "with_outputs"]
