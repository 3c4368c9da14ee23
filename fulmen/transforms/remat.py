"""Rematerialization: choose what the forward saves for the backward by a minimum cut.

After the autodiff split, the backward reads some forward values (the residuals). Any of them
that can be recomputed cheaply from other values may be recomputed in the backward instead of
saved. The choice is a minimum s-t cut on the forward dataflow graph, following the min-cut
formulation of AOTAutograd's partitioner (Horace He, "Min-cut optimal recomputation (i.e.
activation checkpointing) with AOTAutograd", PyTorch dev discussions, 2022):

- every value v is an edge in(v) -> out(v) whose capacity is the bytes that saving it keeps
  alive (cutting it = saving it); forward inputs cost 0 (the caller keeps them alive anyway);
- a recomputable statement connects out(input) -> in(output) for each of its inputs, with
  infinite capacity; a statement that must not be recomputed (matmul, convolution, opaque ops,
  random ops, large reductions) is fed from the source, so its outputs can only be saved;
- every value the backward needs connects out(v) -> sink;
- values computed inside a `torch.utils.checkpoint` region (non-reentrant) are recomputable
  whatever the op (as eager's checkpoint recomputes them) and expensive to save.

Storages, not tensors. A view op (`view`, `transpose`, `split`, basic indexing, `expand`, ...)
returns a tensor that shares its input's storage, so saving a view keeps the whole base alive,
and saving two views of one base costs the base once. Such outputs get an infinite capacity
(when the view op is recomputable): the cut then falls on the base, which is exactly the
storage that saving the view would keep, counted once however many of its views the backward
reads; the backward re-takes the views (free). (Example: attention's `q, k, v = qkv.split(...)`;
saving `v` keeps all of `qkv` alive, so saving `qkv` and recomputing rotary-embedded `q` and `k`
from it costs less than saving `q`, `k` and `v`.) `reshape`/`flatten` may copy, so their outputs
are charged their own bytes; an executor that materializes a view makes this an upper bound.

Host time. Recomputing a statement costs the backward one more statement to run from Python,
whatever the bytes of its output. Values computed only from forward inputs that need no
gradient (an attention mask built from `arange`, index views, comparisons, `full` and `where`
over an integer padding mask; rotary cos/sin tables from a buffer; position ids) are typically
small, their statements form chains of their own that no backward kernel absorbs, and
rebuilding them on every backward costs more host time than keeping a few KiB. So every
recomputable statement that is not a view and reads only such inputs and values
(`input_derived`) is also charged `STATEMENT_BYTES` (NOTE [remat statement cost]): it is a node
fed from the source by an edge of that capacity, which the cut crosses exactly when the
statement is recomputed, once however many of its outputs the backward needs. Statements on a
gradient's path (activations: RMSNorm's statistic of an input that requires grad, anything
after a matmul or a gather) are not charged: their recomputation sits next to the backward
kernels that fuse it, at no host cost (charging it split RMSNorm's backward into five more
statements), and at real sizes they are far larger than the charge anyway.

The cut is exact for this objective (bytes of distinct storages saved, plus the statement
charge). Among the cuts of minimum cost, `networkx.minimum_cut` returns the one closest to the
sink (its sink side is the set of nodes that still reach the sink in the max-flow residual
network), whose recomputed set is contained in that of every other minimum cut: on a tie in bytes (saving `exp(a)` or its input
`a`), the backward is given the value it reads rather than recomputing it.

From the saved values, the backward recomputes each value it needs just before its first use
(dependencies first; dead code elimination drops the rest), so a recomputed value is alive only
while the backward needs it (recomputing everything up front would hold all of it at once
through the backward) and sits next to its consumers, where a fusion executor can fuse the
recomputation into the backward's kernels.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import networkx as nx

from fulmen.core import BoundSymbol, CallSiteTag, Trace, flatten
from fulmen.core.proxy import Proxy
from fulmen.proxies import TensorProxy
from fulmen.proxies.tensor import size_hints
from fulmen.transforms.autodiff.split import ForwardBackward
from fulmen.transforms.base import transform
from fulmen.transforms.dce import free_values, live_bsyms

_CHEAP_TAGS = {"elementwise", "shape"}
CHECKPOINT_WEIGHT = 10**6
# a reduction is recomputed only when each output element reads at most this many elements
MAX_RECOMPUTED_REDUCTION = 4096
# NOTE [remat statement cost]: what recomputing one statement of `input_derived` costs the
# backward, counted in saved bytes. A statement run from Python costs a few µs of host time on
# CPU; at 2 KiB, such a value is saved rather than rebuilt when rebuilding it takes more
# statements than its size in KiB over two (tiny HF Llama: the attention mask and the rotary
# cos/sin, rebuilt by ~20 torch statements per backward, are saved instead: 4.2 KiB).
STATEMENT_BYTES = 2048


def _numel_hint(proxy: TensorProxy) -> int:
    """The number of elements of `proxy` at the traced call's sizes. NOTE [remat on hints]: what
    to save and what to recompute changes no value, only bytes and time, so with symbolic sizes
    the choice is made for the sizes of the call being compiled, as plain ints: no guard, and
    no sympy arithmetic inside the max-flow (which did thousands of SymInt operations, a third
    of a tiny HF llama's symbolic training compile)."""
    return math.prod(size_hints(proxy.shape))


def _reduced_per_output(bsym: BoundSymbol) -> int:
    inputs = [p for p in bsym.proxy_inputs if isinstance(p, TensorProxy)]
    outputs = [p for p in bsym.proxy_outputs if isinstance(p, TensorProxy)]
    if not inputs or not outputs:
        return 0
    return _numel_hint(inputs[0]) // max(_numel_hint(outputs[0]), 1)


def is_recomputable(bsym: BoundSymbol) -> bool:
    """Whether the backward may recompute `bsym` instead of the forward saving its outputs:
    elementwise and shape prims, small reductions, and torch-level ops made only of those, and
    anything inside a `torch.utils.checkpoint` region. Never random or opaque ops; outside
    checkpoint regions, never contractions or gathers."""
    if bsym.has_side_effects or "opaque" in bsym.sym.tags:
        return False
    if CallSiteTag.CHECKPOINT in bsym.tags:
        return True
    if bsym.sym.is_prim:
        if "reduction" in bsym.sym.tags:
            return _reduced_per_output(bsym) <= MAX_RECOMPUTED_REDUCTION
        return bool(bsym.sym.tags & _CHEAP_TAGS) or bsym.sym.name in ("full", "iota")
    return bool(bsym.subsymbols) and all(is_recomputable(sub) for sub in bsym.subsymbols)


def is_view(bsym: BoundSymbol) -> bool:
    """Whether the outputs of `bsym` share their input's storage when the torch executor runs
    it (`BoundSymbol.is_view`: `Tag.VIEW`, declared with the op: the view prims, `view`,
    `transpose`, `split`, basic indexing...; not `reshape`/`flatten`, which copy a tensor they
    cannot view)."""
    return bsym.is_view


def nbytes(proxy: Proxy) -> int:
    """Bytes of a tensor value (0 for other values, which are never worth recomputing), at the
    traced call's sizes (NOTE [remat on hints])."""
    if isinstance(proxy, TensorProxy):
        return _numel_hint(proxy) * proxy.dtype.itemsize
    return 0


def input_derived(forward_inputs: Iterable[Proxy], bsyms: Iterable[BoundSymbol]) -> set[int]:
    """The ids of the recomputable, non-view statements outside checkpoint regions that read
    only forward inputs that do not require grad and outputs of recomputable statements that
    do the same (masks, rotary tables, position ids): those `choose_saved` charges
    `STATEMENT_BYTES` for recomputing."""
    derived = {p.name for p in forward_inputs if not getattr(p, "requires_grad", False)}
    charged = set()
    for bsym in bsyms:
        if not is_recomputable(bsym) or not all(p.name in derived for p in bsym.proxy_inputs):
            continue
        derived |= bsym.output_names
        if not is_view(bsym) and CallSiteTag.CHECKPOINT not in bsym.tags and bsym.proxy_outputs:
            charged.add(id(bsym))
    return charged


def _in(name: str) -> str:
    return f"{name}:in"


def _out(name: str) -> str:
    return f"{name}:out"


def choose_saved(forward_inputs: Iterable[Proxy], bsyms: Iterable[BoundSymbol],
                 needed: Iterable[Proxy]) -> list[Proxy]:
    """The set of values of fewest saved bytes (distinct storages: a recomputable view costs
    its base) plus `STATEMENT_BYTES` per recomputed statement of `input_derived`, from which
    every `needed` value can be recomputed, and among those the one that recomputes least (see
    the module docstring). Forward inputs in the result cost nothing."""
    bsyms, forward_inputs = list(bsyms), list(forward_inputs)
    charged_ids = input_derived(forward_inputs, bsyms)
    graph = nx.DiGraph()
    values: dict[str, Proxy] = {}

    def add_value(proxy: Proxy, capacity: float) -> None:
        values[proxy.name] = proxy
        graph.add_edge(_in(proxy.name), _out(proxy.name), capacity=capacity)

    for proxy in forward_inputs:
        add_value(proxy, 0)
        graph.add_edge("source", _in(proxy.name), capacity=math.inf)
    for bsym in bsyms:
        recomputable = is_recomputable(bsym)
        view = recomputable and is_view(bsym)
        # the user asked for a checkpoint region's values to be recomputed: saving them costs
        # far more than their bytes (finite, so a region with an opaque op stays feasible)
        checkpoint = recomputable and CallSiteTag.CHECKPOINT in bsym.tags
        weight = CHECKPOINT_WEIGHT if checkpoint else 1
        statement = f"{id(bsym)}:statement"
        charged = id(bsym) in charged_ids
        if charged:
            graph.add_edge("source", statement, capacity=STATEMENT_BYTES)
        for output in bsym.proxy_outputs:
            add_value(output, math.inf if view and isinstance(output, TensorProxy)
                      else nbytes(output) * weight)
            if not recomputable:
                graph.add_edge("source", _in(output.name), capacity=math.inf)
                continue
            if charged:
                graph.add_edge(statement, _in(output.name), capacity=math.inf)
            for proxy in bsym.proxy_inputs:
                graph.add_edge(_out(proxy.name), _in(output.name), capacity=math.inf)
    for proxy in needed:
        graph.add_edge(_out(proxy.name), "sink", capacity=math.inf)
    if "sink" not in graph:
        return []
    # networkx returns the minimum cut closest to the sink: its sink side is the set of nodes
    # that still reach the sink in the residual network
    _, (_, sink_side) = nx.minimum_cut(graph, "source", "sink")
    return [proxy for name, proxy in values.items()
            if _in(name) not in sink_side and _out(name) in sink_side]


def _all_names(bsym: BoundSymbol) -> set[str]:
    names = set(bsym.output_names)
    for sub in bsym.subsymbols:
        names |= _all_names(sub)
    return names


def _just_in_time(recomputed: list[BoundSymbol], rest: list[BoundSymbol]) -> list[BoundSymbol]:
    """`rest` in order, each statement of `recomputed` placed just before the first statement
    that reads one of its outputs (its own recomputed inputs before it)."""
    producer = {name: bsym for bsym in recomputed for name in bsym.output_names}
    placed: set[int] = set()
    order: list[BoundSymbol] = []

    def place_inputs_of(bsym: BoundSymbol) -> None:
        # iterative depth-first walk: recomputed chains can be long
        stack = [(bsym, iter(bsym.proxy_inputs))]
        while stack:
            current, inputs = stack[-1]
            for proxy in inputs:
                source = producer.get(proxy.name)
                if source is not None and id(source) not in placed:
                    placed.add(id(source))
                    stack.append((source, iter(source.proxy_inputs)))
                    break
            else:
                stack.pop()
                if current is not bsym:
                    order.append(current)

    for bsym in rest:
        place_inputs_of(bsym)
        order.append(bsym)
    # recomputed values the backward returns as they are (dead code elimination drops the rest)
    for bsym in recomputed:
        if id(bsym) not in placed:
            placed.add(id(bsym))
            place_inputs_of(bsym)
            order.append(bsym)
    return order


@transform("rematerialization")
def _rebuild_backward(backward: Trace, recompute: tuple[BoundSymbol, ...], saved_names: set[str],
                      cotangents: tuple) -> Trace:
    # The backward may already recompute some intermediates of a decomposition (autodiff does,
    # for ops without a rule). A recomputed op whose decomposition assigns one of those names
    # goes in as its parts, and the backward's own later copies of them are dropped: the same
    # name is the same forward value, so the trace stays SSA.
    defined = set().union(*(_all_names(b) for b in backward.bsyms)) if backward.bsyms else set()
    recomputed = []
    for bsym in recompute:
        recomputed.extend(flatten(bsym) if (_all_names(bsym) - bsym.output_names) & defined
                          else [bsym])
    early = {name for b in recomputed for name in _all_names(b)}
    rest = [b for b in backward.bsyms if not (b.output_names and b.output_names <= early)]
    bsyms = live_bsyms(_just_in_time(recomputed, rest), backward.output)
    residuals = free_values(bsyms, backward.output, cotangents, sizes_from=backward.args)
    return backward.replace(args=(*residuals, *cotangents), bsyms=bsyms)


def rematerialize(split: ForwardBackward) -> ForwardBackward:
    """Save the min-cut set of values instead of the split's residuals; the backward recomputes
    each other value it needs just before its first use. Returns `split` itself when nothing
    changes.

    Example:
        >>> split = rematerialize(split_forward_backward(trace))
    """
    forward, backward = split.forward, split.backward
    output_leaves, residuals = forward.output
    if not residuals:
        return split
    saved = choose_saved(forward.args, forward.bsyms, residuals)
    saved_names = {p.name for p in saved}
    if saved_names >= {p.name for p in residuals}:
        return split
    residual_count = len(residuals)
    cotangents = backward.args[residual_count:]
    recompute = tuple(b for b in forward.bsyms
                      if is_recomputable(b) and not b.output_names & saved_names)
    new_backward = _rebuild_backward(backward, recompute, saved_names, cotangents)
    new_residuals = new_backward.args[: len(new_backward.args) - len(cotangents)]
    new_forward = forward.replace(output=(output_leaves, tuple(new_residuals)),
                                  provenance="after rematerialization")
    return ForwardBackward(new_forward, new_backward, split.output_spec,
                           split.differentiable_outputs)


def saved_bytes(residuals: Iterable[Proxy], forward_inputs: Iterable[Proxy] = ()) -> int:
    """Bytes of the residuals that are not forward inputs."""
    inputs = {p.name for p in forward_inputs}
    return sum(nbytes(p) for p in residuals if p.name not in inputs)


__all__ = ["STATEMENT_BYTES", "choose_saved", "input_derived", "is_recomputable", "is_view", "nbytes", "rematerialize", "saved_bytes"]
