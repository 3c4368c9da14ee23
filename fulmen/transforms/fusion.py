"""Fusion partitioning, shared by every fusion executor.

`partition_for_fusion(trace, executor)` groups the statements a `FusionExecutor` can fuse into
regions and replaces each region by the one bound symbol `executor.fuse` returns.

1. Flatten: a torch-level op the executor cannot fuse whole, but whose decomposition consists
   only of fusible prims, is replaced by those prims (flattened recursively); so is one whose
   prims include a fusible reduction (the rest of its prims run on their own) when a fusible
   statement computes one of its inputs, unless they include a matmul (attention runs whole,
   as eager's fused kernel). Ops claimed by a
   higher-priority operator executor stay whole and unfused.
2. Merge: on the dataflow graph (one node per region), each fusible statement is
   merged with the regions of its fusible producers (a second pass retries what the order of
   the first refused; merges are tried in the order of the producing statements), then
   regions reading a common input are merged horizontally. A merge happens only if it
   creates no cycle (no path between the two regions through a third node), the region stays
   under `max_region_size` statements, and `executor.can_fuse_region` accepts the union. A
   broadcast that makes more elements than it reads joins its consumers' region, never its
   producer's (NOTE [a broadcast joins its consumers]).
3. Emit: regions in a topological order of the region graph (ties by first statement);
   `executor.fuse(region, outputs)` returns the fused bound symbol, or None to keep the
   statements. A tiny CPU region is not offered (`is_tiny_region`): one region call costs
   more than the few torch ops it would replace. Flattened ops none of whose prims ended in a
   fused region are restored whole.

NOTE [fusion never crosses unfusible ops]: a region is connected through fusible statements
only, and the cycle check forbids merging two regions when a path between them runs through
anything else (a matmul, an opaque op, a random op), so such an op is never moved across.

NOTE [fusion keeps the order of draws]: statements that draw from the global generator (a
`bernoulli` of a dropout, an attention with `dropout_p`, a random opaque op) are chained by
order edges besides the dataflow ones, so neither a merge nor the emitted order puts one draw
before an earlier one: the random stream is consumed as in eager, and every mask equals
eager's under the same seed (HF UMT5 emitted its attention's dropout after three later
dropouts once a horizontal merge made the attention wait for a later statement).
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol

import networkx as nx
import torch

from fulmen.core import BoundSymbol, Tag, Trace, flatten
from fulmen.core.symbol import free_inputs
from fulmen.ops import prims
from fulmen.proxies import TensorProxy
from fulmen.transforms.region_size import is_tiny_region

_LOG = logging.getLogger("fulmen.fusion")  # FULMEN_LOGS=fusion (fulmen/logs.py)


class FusionExecutor(Protocol):
    """What the partitioner needs of a fusion executor (`fulmen.executors.FusionExecutor`)."""

    symbolic_sizes: bool  # whether it fuses statements with symbolic sizes

    def can_fuse(self, bsym: BoundSymbol) -> bool: ...

    def can_fuse_region(self, region: list[BoundSymbol]) -> bool: ...
    # an executor with `asks_escapes = True` is called `can_fuse_region(region, escapes)`,
    # `escapes(name)` telling whether a value of the region is read after it (codegen: a value
    # computed only where a pad or cat reads it cannot leave its kernel)

    def fuse(self, region: list[BoundSymbol], outputs: list) -> BoundSymbol | None: ...


OperatorExecutor = Any  # anything with `claim(bsym) -> BoundSymbol | None`

MAX_REGION_SIZE = 256

def _worth_splitting(flat: list[BoundSymbol], fusible: list[bool]) -> bool:
    """Whether to flatten an op only part of whose prims are fusible (asked only when a fusible
    statement computes one of its inputs): when a fusible reduction is among them
    (cross_entropy = log_softmax + a gather: the log_softmax then fuses with the producer of
    the logits, a cast or a scaling, saving a pass over them), and everything else is a prim
    (which every operator executor runs). Without such a producer the op runs whole: its
    unfusible rest would run as many small torch statements (cross_entropy's 16 on the
    logits of a language model cost more than eager's whole op). Other mixed ops stay whole,
    and so does one whose prims include a matmul: attention's fused kernel (flash attention)
    never materialises the `(L, S)` scores, mask fill and weights that its split form does
    (about 1.6x faster forward+backward at L=512 on CPU)."""
    if any(sub.sym.is_prim and sub.sym.name == "matmul" for sub in flat):
        return False
    return any(ok and "reduction" in sub.sym.tags for sub, ok in zip(flat, fusible)) and all(
        sub.sym.is_prim for sub in flat)


class _Node:
    """One statement of the partition: a bound symbol or a prim of a flattened op. `inputs`:
    the names it reads; the last prim of a flattened op also reads the op's own inputs, since
    the op is restored whole in its place when none of its prims is fused (a shape-only
    argument, such as `expand_as`'s `other`, is read by no prim)."""

    __slots__ = ("bsym", "origin", "fusible", "inputs")

    def __init__(self, bsym: BoundSymbol, origin: int, fusible: bool,
                 inputs: set[str] | None = None) -> None:
        self.bsym, self.origin, self.fusible = bsym, origin, fusible
        self.inputs = bsym.input_names if inputs is None else inputs


def _has_symbolic_sizes(bsym: BoundSymbol) -> bool:
    """Whether a statement computes with symbolic sizes (`fulmen.tracer.symbolic`): such
    statements stay unfused unless the executor says it handles them (`symbolic_sizes`)."""
    for value in (*bsym.read_proxies, *bsym.proxy_outputs):
        if any(isinstance(size, torch.SymInt) for size in getattr(value, "shape", ())):
            return True
    return any(isinstance(arg, torch.SymInt) for arg in bsym.args)


def _flatten_for(trace: Trace, executor: FusionExecutor,
                 before: Sequence[OperatorExecutor]) -> list[_Node]:
    nodes: list[_Node] = []
    symbolic_unfused = not getattr(executor, "symbolic_sizes", False)
    computed: set[str] = set()  # outputs of fusible statements that compute (and their views)

    def note(bsym: BoundSymbol) -> None:
        if not _moves_only(bsym) or bsym.input_names & computed:
            computed.update(bsym.output_names)

    for origin, bsym in enumerate(trace.bsyms):
        if bsym.is_del or (symbolic_unfused and _has_symbolic_sizes(bsym)) \
                or any(ex.claim(bsym) is not None for ex in before):
            nodes.append(_Node(bsym, origin, False))
        elif executor.can_fuse(bsym):
            nodes.append(_Node(bsym, origin, True))
            note(bsym)
        else:
            flat = flatten(bsym)
            fusible = [executor.can_fuse(sub) for sub in flat]
            if flat[0] is not bsym and (all(fusible) or (
                    bsym.input_names & computed and _worth_splitting(flat, fusible))):
                nodes.extend(_Node(sub, origin, ok) for sub, ok in zip(flat, fusible))
                last = nodes[-1]
                last.inputs = last.inputs | bsym.input_names
                for sub, ok in zip(flat, fusible):
                    if ok:
                        note(sub)
            else:
                nodes.append(_Node(bsym, origin, False))
    return nodes


def _moves_only(bsym: BoundSymbol) -> bool:
    """Whether a statement only moves or views elements (reshape, permute, a view)."""
    return Tag.SHAPE in bsym.sym.tags or Tag.VIEW in bsym.sym.tags


def _draw_order(bsyms: Sequence[BoundSymbol]) -> list[tuple[int, int]]:
    """`(earlier, later)` positions of consecutive statements of `bsyms` that draw from the
    global generator: order edges a reordering must keep (NOTE [fusion keeps the order of
    draws])."""
    draws = [i for i, bsym in enumerate(bsyms) if Tag.RANDOM in bsym.sym.tags]
    return list(zip(draws, draws[1:]))


class _Partition:
    """Regions as nodes of a dataflow graph: successor and predecessor sets per region and the
    descendants of each as a bitset, so the cycle check of a merge reads a few bits instead of
    searching the graph; the final order is a networkx topological sort."""

    def __init__(self, nodes: list[_Node], executor: FusionExecutor, max_size: int,
                 trace_outputs: set[str]) -> None:
        self.nodes = nodes
        self.trace_outputs = trace_outputs
        self.executor = executor
        self.max_size = max_size
        self.succ: dict[int, set[int]] = {i: set() for i in range(len(nodes))}
        self.pred: dict[int, set[int]] = {i: set() for i in range(len(nodes))}
        self.region_of = list(range(len(nodes)))
        self.members: dict[int, list[int]] = {i: [i] for i in range(len(nodes))}
        self.producer: dict[str, int] = {}
        self.consumers: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            for name in node.inputs:
                self.consumers.setdefault(name, []).append(i)
                if name in self.producer:
                    self.succ[self.producer[name]].add(i)
                    self.pred[i].add(self.producer[name])
            for name in node.bsym.output_names:
                self.producer[name] = i
        for earlier, later in _draw_order([node.bsym for node in nodes]):
            self.succ[earlier].add(later)
            self.pred[later].add(earlier)
        # descendants of each region as a bitset (statement order is topological)
        self.reach: dict[int, int] = {}
        for i in range(len(nodes) - 1, -1, -1):
            bits = 0
            for nxt in self.succ[i]:
                bits |= self.reach[nxt] | 1 << nxt
            self.reach[i] = bits

    def fusible(self, region: int) -> bool:
        return self.nodes[region].fusible

    def _would_cycle(self, a: int, b: int) -> bool:
        """Whether a path joins a and b through a third region."""
        reach = self.reach
        return (any(reach[s] >> b & 1 for s in self.succ[a] if s != b)
                or any(reach[s] >> a & 1 for s in self.succ[b] if s != a))

    def _contract(self, keep: int, gone: int) -> None:
        """Merge region `gone` into `keep`: edges, and the descendants of every region that
        reached either (they now reach `keep` and all it reaches; after the edges are moved,
        those regions are the ancestors of `keep`)."""
        for nxt in self.succ.pop(gone):
            self.pred[nxt].discard(gone)
            if nxt != keep:
                self.pred[nxt].add(keep)
                self.succ[keep].add(nxt)
        for prev in self.pred.pop(gone):
            self.succ[prev].discard(gone)
            if prev != keep:
                self.succ[prev].add(keep)
                self.pred[keep].add(prev)
        reach = self.reach
        merged = (reach[keep] | reach.pop(gone)) & ~(1 << keep | 1 << gone)
        reach[keep] = merged
        grown = merged | 1 << keep
        # the regions that reached `keep` or `gone` are the ancestors of the merged region:
        # a search up its predecessors visits only them, where a scan of every region's bits
        # visited all (tiny HF Llama: about 20 ancestors of 170 regions per merge). A region
        # that already reaches all of `grown` is not passed: each of its ancestors reaches
        # what it reaches (of the live regions, the only bits `_would_cycle` reads; a merged
        # region's id may stay set in some regions' bits and not in others').
        seen = {keep}
        stack = list(self.pred[keep])
        while stack:
            region = stack.pop()
            if region not in seen:
                seen.add(region)
                if reach[region] | grown != reach[region]:
                    reach[region] |= grown
                    stack.extend(self.pred[region])

    def try_merge(self, a: int, b: int) -> bool:
        a, b = self.region_of[a], self.region_of[b]
        if a == b or not (self.fusible(a) and self.fusible(b)):
            return False
        members = sorted(self.members[a] + self.members[b])
        if len(members) > self.max_size or self._would_cycle(a, b):
            return False
        if not self._accepts(members):
            return False
        keep, gone = (a, b) if a < b else (b, a)
        self._contract(keep, gone)
        for i in self.members.pop(gone):
            self.region_of[i] = keep
        self.members[keep] = members
        return True

    def _accepts(self, members: list[int]) -> bool:
        """Whether the executor accepts the statements `members` as one region."""
        bsyms = [self.nodes[i].bsym for i in members]
        if not getattr(self.executor, "asks_escapes", False):
            return self.executor.can_fuse_region(bsyms)
        inside = set(members)
        return self.executor.can_fuse_region(bsyms, lambda name: self._escapes(name, inside))

    def _escapes(self, name: str, inside: set[int]) -> bool:
        """Whether the value `name` is read after the statements `inside` (a trace output, or
        read by a statement not among them)."""
        return name in self.trace_outputs or any(
            reader not in inside for reader in self.consumers.get(name, ()))

    def _by_position(self, names) -> list[str]:
        """`names` (a set) in the order of their producing statements: merges are tried in
        the same order in every process (a set of strings iterates in an order that changes
        with the hash seed, and the partition with it)."""
        return sorted(names, key=lambda name: self.producer.get(name, -1))

    def _producers(self, names, i: int) -> list[int]:
        """The statements before `i` producing `names`, each followed, when it is a broadcast
        that expands (NOTE [a broadcast joins its consumers]), by its own producers: those
        join the consumer's region together with the broadcast, or not at all."""
        found = []
        for name in names:
            producer = self.producer.get(name)
            if producer is not None and producer < i:
                found.append(producer)
                if _expands(self.nodes[producer].bsym):
                    found += self._producers(
                        self._by_position(self.nodes[producer].bsym.input_names), producer)
        return found

    def merge_all(self) -> None:
        # a second pass takes the merges the first refused for its order: a statement reading
        # two regions (a `cat` of a slice and of a negated slice) first met the one that would
        # have closed a cycle through the other (NOTE [pad and cat in pointwise kernels])
        for _ in range(2):
            merged = False
            for i, node in enumerate(self.nodes):
                if not node.fusible or _expands(node.bsym):
                    continue
                for producer in self._producers(self._by_position(node.bsym.input_names), i):
                    merged |= self.try_merge(producer, i)
            if not merged:
                break
        for readers in self.consumers.values():
            for other in readers[1:]:
                self.try_merge(readers[0], other)

    def outputs(self, region: int) -> list:
        """The values `region` computes that are read after it."""
        inside = set(self.members[region])
        return [proxy for i in self.members[region] for proxy in self.nodes[i].bsym.proxy_outputs
                if self._escapes(proxy.name, inside)]

    def order(self) -> list[int]:
        graph = nx.DiGraph()
        graph.add_nodes_from(self.succ)
        graph.add_edges_from((a, b) for a, nexts in self.succ.items() for b in nexts)
        return list(nx.lexicographical_topological_sort(graph, key=lambda r: r))


def _expands(bsym: BoundSymbol) -> bool:
    """Whether `bsym` is a broadcast that makes more elements than it reads, with static sizes.

    NOTE [a broadcast joins its consumers]: such a broadcast is not merged into the region
    of its producer; it joins a region only as the producer of a statement reading it, that
    is with its consumers. Merged into the producer's region, a broadcast read by another
    region is an output of the producer's kernel, written at full size: tiny HF Llama's
    rotary cos and sin, (1, 1, 64, 16), went out of the query's rotary kernel as six
    (2, 4|2, 64, 16) copies for the keys of layer 0 and the queries and keys of layer 1 (in
    the backward likewise); now each of those kernels broadcasts the small tensor itself.
    A broadcast read by no fused region runs on its own, as `expand`, a view.
    """
    if bsym.sym is not prims.broadcast_in_dim:
        return False
    source, out = bsym.args[0], bsym.output
    shapes = (*getattr(source, "shape", (None,)), *out.shape)
    if not all(type(size) is int for size in shapes):
        return False
    return math.prod(out.shape) > math.prod(source.shape)


def _eager_layout_outputs(trace: Trace) -> dict[str, TensorProxy]:
    """The tensors `trace`'s statements compute whose strides are eager's, by name.

    NOTE [a fusion's outputs report eager's layout]: a flattened op's last prim computes the
    op's output under its name, but with the prim's strides (`x - x.mean(1, keepdim=True)` of
    a channels-last `x` ends in a `sub` of a row-major broadcast: row-major), not marked
    exact. A region returning that value returns the op's own proxy, with eager's strides, so
    the claim pass sees that the kernel's row-major result is not laid out as eager's (NOTE
    [output layout] in `fulmen.executors.claim`): a conv of it returned row-major where eager
    is channels-last, unnoticed.
    """
    return {proxy.name: proxy for bsym in trace.bsyms for proxy in bsym.proxy_outputs
            if isinstance(proxy, TensorProxy) and getattr(proxy, "_fulmen_exact_strides", False)}


def partition_for_fusion(
    trace: Trace,
    executor: FusionExecutor,
    before: Sequence[OperatorExecutor] = (),
    max_region_size: int = MAX_REGION_SIZE,
) -> Trace:
    """Replace the regions `executor` can fuse by fused bound symbols (see module docstring).

    `before` are the operator executors ahead of `executor` in the priority list: statements
    they claim are left alone. Returns `trace` itself when nothing was fused.
    """
    nodes = _flatten_for(trace, executor, before)
    part = _Partition(nodes, executor, max_region_size, trace.output_names)
    part.merge_all()
    eager = _eager_layout_outputs(trace)
    emitted: list[tuple[int, list[BoundSymbol]]] = []
    fused_origins: set[int] = set()
    for region in part.order():
        members = part.members[region]
        fused = None
        region_bsyms = [nodes[i].bsym for i in members]
        if part.fusible(region) and not is_tiny_region(
                region_bsyms, len({nodes[i].origin for i in members})):
            outputs = [eager.get(proxy.name, proxy)
                       for proxy in part.outputs(region)]
            fused = executor.fuse(region_bsyms, outputs)
        if fused is not None:
            emitted.append((-1, [fused]))
            fused_origins.update(nodes[i].origin for i in members)
            _LOG.info("%s: %s fuses %d statements (%s) -> %s", trace.name, executor.name,
                      len(members), ", ".join(nodes[i].bsym.sym.name for i in members),
                      fused.sym.python_name)
        else:
            emitted.extend((i, [nodes[i].bsym]) for i in members)
            if len(members) > 1 or part.fusible(region):
                _LOG.info("%s: %s leaves %d statements unfused (%s)", trace.name, executor.name,
                          len(members), ", ".join(nodes[i].bsym.sym.name for i in members))
    if not fused_origins:
        return trace
    last_index = {node.origin: i for i, node in enumerate(nodes)}
    bsyms: list[BoundSymbol] = []
    for index, group in emitted:
        if index < 0:
            bsyms.extend(group)
            continue
        origin = nodes[index].origin
        original = trace.bsyms[origin]
        if origin in fused_origins or nodes[index].bsym is original:
            bsyms.extend(group)
        elif last_index[origin] == index:
            bsyms.append(original)  # none of its prims were fused: restore the op whole
    return trace.replace(bsyms=tuple(_defined_before_use(bsyms)))


def _defined_before_use(bsyms: list[BoundSymbol]) -> list[BoundSymbol]:
    """`bsyms` with each statement after the producers of what it reads, moving as few as
    possible (a stable topological order: lowest position first). An op restored whole is
    emitted where its last prim was, and a consumer of its first prim's output may have been
    emitted before that (HF Switch Transformers' router: `torch.max(p, dim=-1).values`
    unsqueezed while the max's `argmax` prim waited for a later region). Draws stay in their
    order, as in the partition."""
    producer = {name: i for i, bsym in enumerate(bsyms) for name in bsym.output_names}
    deps = [{producer[name] for name in bsym.input_names if producer.get(name, i) != i}
            for i, bsym in enumerate(bsyms)]
    for earlier, later in _draw_order(bsyms):
        deps[later].add(earlier)
    if all(max(needed, default=-1) < i for i, needed in enumerate(deps)):
        return bsyms
    users: dict[int, list[int]] = {}
    for i, needed in enumerate(deps):
        for j in needed:
            users.setdefault(j, []).append(i)
    waiting = [len(needed) for needed in deps]
    ready = [i for i, count in enumerate(waiting) if not count]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(bsyms[i])
        for user in users.get(i, ()):
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, user)
    return order if len(order) == len(bsyms) else bsyms  # a cycle: check_trace names it


def region_inputs(region: Sequence[BoundSymbol]) -> list:
    """Proxies a region reads that it does not produce, in first-use order."""
    return free_inputs(region)
