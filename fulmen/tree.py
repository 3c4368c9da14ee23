"""The trace tree: how a program with graph breaks runs.

A program whose Python asked for tensor values while it was traced is compiled as segments
(`fulmen.transforms.segments`) arranged in a tree, as in tracing JITs (Gal et al., "Trace-based
Just-in-Time Type Specialization for Dynamic Languages", PLDI 2009): a node is one compiled
segment followed by a guard; its children are the continuations recorded for each answer the
guard has given. A call runs the root segment, evaluates its guard on the real values, and
continues with the child recorded for that answer, until a leaf assembles the output.

An answer never seen before raises `PathMiss`: the caller (`fulmen.jit`) retraces the program
from the root with the real inputs and grafts the new path with `TraceTree.graft`; segments
already compiled (same statements) are shared, not rebuilt.

Each differentiable segment runs inside its own `torch.autograd.Function` (its compiled callable
does that), so gradients flow through the values handed from segment to segment as in eager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.core import BoundSymbol, CallSiteTag, Trace
from fulmen.core.interpret import bind_outputs
from fulmen.core.proxy import iter_proxies, map_proxies
from fulmen.ops.breaks import answer_key, output_shapes
from fulmen.proxies import TensorProxy
from fulmen.tracer.break_sizes import (
    CountSites,
    generic_dims,
    generic_key,
    input_value_name,
    path_checks,
    site_of,
)
from fulmen.tracer.breaks import no_autocast
from fulmen.tracer.call_constants import copy_of
from fulmen.tracer.objects import TRACED_NUMBERS
from fulmen.tracer.symbolic import number_function
from fulmen.transforms.segments import Segment, guard_inputs, with_outputs

MAX_BRANCHES = 8  # distinct answers one guard may have before new ones run eagerly
MAX_VARIANTS = 4  # generic children of one key (each with its checks) before sizes refused


@dataclass
class CompiledSegment:
    """The output of compiling one segment's trace: the callable and every stage's trace."""

    fn: Callable
    traces: list[Trace]
    backward_traces: list[Trace] = field(default_factory=list)
    # unused-cotangent flags -> the stages of the backward compiled for them (`pipeline.py`)
    backward_variants: dict = field(default_factory=dict)
    # claims and compiles the backward, appending its last stages to `backward_traces`, if it
    # has not run yet (NOTE [the backward compiles when first needed] in `pipeline.py`)
    finish_backward: Callable | None = None

    def all_backward_traces(self) -> list[Trace]:
        """`backward_traces`, the backward claimed and compiled first if it was not yet."""
        if self.finish_backward is not None:
            self.finish_backward()
        return self.backward_traces


@dataclass(eq=False)
class SegmentNode:
    """One compiled segment of the tree, the guard after it and its continuations.

    Attributes:
        fingerprint: the segment's statements (see `Segment.fingerprint`).
        input_names / output_names: what it reads from and adds to the run's values.
        compiled: the compiled segment.
        constants: captured tensors (closures, globals) the segment reads, by input name.
        fresh: the names among `constants` of tensors the traced call made itself (NOTE
            [tensors made during the call]): each call of the tree gets a new copy of each,
            shared by the segments of that call.
        guard: `(fn, args, kwargs)` asked after the segment, or None at a leaf.
        children: answer key -> the node that continues the path for that answer.
        output / output_spec: at a leaf, the program's output built from the run's values.
        numbers: at a leaf whose output holds traced numbers (a symbolic size returned:
            `x.shape[0]`), `(positions among the output's leaves, their values' function of
            the values named, names)`: the call's inputs, then its data-dependent ops' outputs;
            each call computes them from its own sizes.
        closed: the guard has had `MAX_BRANCHES` answers; new ones are not compiled.
    """

    fingerprint: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    compiled: CompiledSegment
    constants: dict[str, torch.Tensor]
    guard: tuple | None
    children: dict = field(default_factory=dict)
    output: Any = None
    output_spec: Any = None
    closed: bool = False
    reason: str = ""
    op: BoundSymbol | None = None
    objects: Any = None  # at a leaf: the path's `ObjectInputs` (its epilogue)
    epilogue_spec: Any = None  # at a leaf whose epilogue rebuilds outputs: their treespec
    numbers: tuple | None = None
    fresh: frozenset[str] = frozenset()
    # NOTE [symbolic counts at a break site] in `fulmen.tracer.break_sizes`: the guard's site,
    # the answers its children were traced for, the `(output, dim)` pairs a generic child
    # leaves symbolic, and each generic key's checks of the sizes
    site: tuple | None = None
    answers: list = field(default_factory=list)
    generic: tuple = ()
    checks: dict = field(default_factory=dict)
    variants: dict = field(default_factory=dict)  # generic key -> its children's keys
    # at a leaf: the trace inputs, then the data-dependent ops' outputs (`numbers`' sources),
    # how many of them are inputs, and the outputs' names an epilogue reads counts from
    sources: tuple = ()
    inputs: int = 0
    count_names: tuple = ()
    bound: Any = None  # the `objects` whose epilogue `count_names` was set for


@dataclass(frozen=True)
class Variant:
    """The key of a generic child: its generic answer key and the texts of its checks (one
    key may hold several generic children, each where its own checks hold: `n % 2`)."""

    base: Any
    checks: tuple


class PathMiss(Exception):
    """A guard gave an answer with no compiled continuation (`node` is the guard's segment)."""

    def __init__(self, node: SegmentNode, answer: Any, refused: bool = False) -> None:
        super().__init__(f"no compiled path for answer {answer!r} of {node.reason}")
        self.node = node
        self.answer = answer
        self.refused = refused  # a generic path's checks refused the sizes


class OutputsDiffer(Exception):
    """A data-dependent op run between segments returned another number of results than when
    it was traced (`x.split(n)` with `n` a 0-d tensor): no path of the tree fits the call."""


def _real(env: dict[str, Any]):
    return lambda proxy: env[proxy.name]


class TraceTree:
    """The compiled segments of one cache entry. Call it with the trace inputs (the call's
    tensors, then the module's parameters and buffers); it returns the program's output and
    the leaf it reached.

    Raises:
        PathMiss: when a guard answers something no compiled path continues from.
        OutputsDiffer: when a data-dependent op returns another number of results.
    """

    def __init__(self, arg_names: tuple[str, ...]) -> None:
        self.arg_names = arg_names
        self.root: SegmentNode | None = None
        self.sites = CountSites()  # break sites whose counts are traced symbolic
        self.reads: tuple = ()  # `(input name, dim)` whose sizes the count checks read
        self.last_counts: list = []  # the op outputs the last call's leaf read counts from

    def __call__(self, *args):
        env = dict(zip(self.arg_names, args))
        real = _real(env)
        node = self.root
        own: dict[str, torch.Tensor] = {}  # this call's copies of the tensors it made
        depth = 0  # the break reached; the count symbols' and inputs' sizes (`_child`):
        values = {input_value_name(name, dim): env[name].shape[dim] for name, dim in self.reads}
        while True:
            for name, value in node.constants.items():
                if name in node.fresh:
                    if name not in own:
                        own[name] = copy_of(value)
                    value = own[name]
                env[name] = value
            outputs = node.compiled.fn(*[env[name] for name in node.input_names])
            env.update(zip(node.output_names, outputs))
            if node.guard is None:
                break
            if node.op is not None:
                _run_op(node.op, env)
            fn, guard_args, guard_kwargs = node.guard
            answer = fn(*map_proxies(real, guard_args), **map_proxies(real, guard_kwargs))
            node = self._child(node, answer, depth, values)
            depth += 1
        if node.objects is not node.bound:  # (a new path's epilogue: once)
            self._bind_epilogue(node)
        if node.count_names:  # (the epilogue's numbers hold counts: this call's)
            self.last_counts = [env[name] for name in node.count_names]
        out = map_proxies(real, node.output)
        if node.numbers is not None:  # symbolic sizes returned: this call's values
            positions, values, names = node.numbers
            leaves, spec = pytree.tree_flatten(out)
            for position, value in zip(positions, values(*[env[name] for name in names])):
                leaves[position] = value
            out = pytree.tree_unflatten(leaves, spec)
        if node.output_spec is not None:
            out = pytree.tree_unflatten(list(out), node.output_spec)
        return out, node

    def _child(self, node: SegmentNode, answer: Any, depth: int, values: dict) -> SegmentNode:
        """The child of `node` for its guard's `answer` at break `depth`: its generic child
        where the sizes pass its checks (their symbols bound in `values`), else the exact one.

        Raises:
            PathMiss: when neither fits (the tree's `sites` updated first)."""
        refused = False
        if node.generic:
            found = generic_key(answer, node.generic, depth)
            keys = node.variants.get(found[0], ()) if found is not None else ()
            if keys:
                values.update(found[1])
            for key in keys:  # (each generic child holds where its own checks do)
                try:
                    if all(check(values) for check in node.checks[key]):
                        return node.children[key]
                except ZeroDivisionError:  # a divisor the traced sizes had nonzero
                    pass
            # sizes no generic child's checks take: a new one, or after `MAX_VARIANTS`
            # the answer refused (traced exactly)
            refused = len(keys) >= MAX_VARIANTS
        child = node.children.get(answer_key(answer))
        if child is not None:
            return child
        if node.guard[0] is output_shapes:
            self.sites.note_miss(node.site, node.answers, answer, refused)
        raise PathMiss(node, answer, refused)

    @staticmethod
    def _node(segment: Segment, constants: dict[str, torch.Tensor], old: SegmentNode | None,
              compile_segment: Callable[[Trace], CompiledSegment]) -> SegmentNode:
        """A node for `segment`: `old` when it is the same segment and returns enough, else a
        freshly compiled one (keeping `old`'s continuations when only the outputs grew)."""
        needed = [p.name for p in segment.trace.output]
        if old is not None and old.fingerprint == segment.fingerprint:
            if set(needed) <= set(old.output_names):
                return old
            names = list(dict.fromkeys([*old.output_names, *needed]))
            segment = with_outputs(segment, names)
            children = old.children
        else:
            children = {}
        trace = segment.trace
        guard = guard_inputs(segment.guard) if segment.guard is not None else None
        return SegmentNode(
            segment.fingerprint, tuple(p.name for p in trace.args),
            tuple(p.name for p in trace.output), compile_segment(trace),
            {name: constants[name] for name in _reads(segment) if name in constants},
            guard, children, reason=_reason(segment), op=segment.op)

    def graft(self, segments: list[Segment], output: Any, output_spec: Any,
              constants: dict[str, torch.Tensor],
              compile_segment: Callable[[Trace], CompiledSegment],
              inputs: tuple = (), fresh: frozenset[str] = frozenset(),
              ) -> list[SegmentNode] | None:
        """Add the path `segments` (one traced path, cut at its breaks); return its nodes, or
        None when a guard on it already has `MAX_BRANCHES` answers (the node is closed).
        `compile_segment(trace)` runs the pass pipeline on a segment not compiled yet;
        `inputs` are the path's trace inputs the tree is called with (the symbolic sizes of a
        returned `x.shape[0]` are read from them); `fresh` names the captured tensors the
        traced call made itself (`TracedProgram.captured_fresh`), copied for each call."""
        path: list[SegmentNode] = []
        parent, key, old = None, None, self.root
        checks = self._checks(segments)
        for depth, segment in enumerate(segments):
            if parent is not None and old is None and len(parent.children) >= MAX_BRANCHES:
                parent.closed = True
                return None
            node = self._node(segment, constants, old, compile_segment)
            node.fresh = node.fresh | (fresh & node.constants.keys())
            if parent is None:
                self.root = node
            else:
                parent.children[key] = node
                if isinstance(key, Variant):
                    variants = parent.variants.setdefault(key.base, [])
                    if key not in variants:
                        variants.append(key)
            path.append(node)
            if segment.guard is None:
                node.output, node.output_spec = output, output_spec
                leaves = pytree.tree_leaves(output)
                positions = [i for i, leaf in enumerate(leaves)
                             if isinstance(leaf, TRACED_NUMBERS)]
                # (a count made symbolic at a break is read from its op's output)
                sources = [*inputs, *(p for s in segments if s.op is not None
                                      for p in s.op.proxy_outputs if isinstance(p, TensorProxy))]
                node.sources, node.inputs = tuple(sources), len(inputs)
                node.numbers = (positions, number_function(
                    [leaves[i] for i in positions], sources),
                    [p.name for p in sources]) if positions else None
                # a captured tensor returned as it is (`torch.from_numpy(t.numpy())` after a
                # break): no segment reads it, the leaf does
                node.constants = {**node.constants, **{
                    p.name: constants[p.name] for p in iter_proxies(output)
                    if p.name in constants}}
                node.fresh = node.fresh | (fresh & node.constants.keys())
                break
            parent, key = node, self._key(node, segment, depth, checks.get(depth, []))
            old = node.children.get(key)
        return path

    def _checks(self, segments: list[Segment]) -> dict[int, list[Callable]]:
        """The checks of a path's count symbols (`path_checks`), by the break depth whose
        generic key holds them (the input sizes they read bound at each call: `reads`)."""
        symbols: list[tuple] = []  # (SymInt, depth, output, dim) of each count symbol
        for depth, segment in enumerate(segments):
            if segment.guard is None:
                break
            fn, args, _ = guard_inputs(segment.guard)
            if fn is output_shapes:
                symbols += [(args[i].shape[d], depth, i, d) for i, d in generic_dims(args)]
        found, reads = path_checks(symbols, self.arg_names)
        self.reads = tuple(sorted({*self.reads, *reads}))
        return found

    @staticmethod
    def _key(node: SegmentNode, segment: Segment, depth: int, checks: list) -> Any:
        """The key of the child continuing `segment`'s answer at `node` (break `depth`):
        a `Variant` of the generic key where the trace gave the op's counts symbols, told
        apart by the path's `checks` there (NOTE [symbolic counts at a break site])."""
        fn, args, _ = guard_inputs(segment.guard)  # (this path's proxies: `node` may be older)
        shapes = fn is output_shapes
        node.site = site_of(segment.guard.source, fn,
                            segment.op.sym.name if shapes and segment.op is not None else "",
                            len(segment.answer) if shapes else 0)
        node.answers.append(segment.answer)
        dims = generic_dims(args) if shapes else ()
        if not dims:
            return answer_key(segment.answer)
        node.generic = dims
        key = Variant(generic_key(segment.answer, dims, depth)[0],
                      tuple(sorted(check.text for check in checks)))
        node.checks[key] = checks
        return key

    def _bind_epilogue(self, leaf: SegmentNode) -> None:
        """Where the epilogue of `leaf`'s path stores numbers holding a count after a break
        (`obj.seen += idx.shape[0]`: `symbolic._counts_unbound`), compute them from the
        inputs and this call's op outputs (`last_counts`), as a returned count is."""
        objects, leaf.count_names = leaf.objects, ()
        leaf.bound, epilogue = objects, objects.epilogue if objects is not None else None
        numbers = getattr(epilogue.number_fn, "counts", None) if epilogue else None
        if numbers is None:
            return
        function, inputs = number_function(numbers, list(leaf.sources)), leaf.inputs
        leaf.count_names = tuple(p.name for p in leaf.sources[inputs:])

        def counted(*args):
            return function(*args[:inputs], *self.last_counts)

        epilogue.number_fn = counted

    def paths(self) -> int:
        """How many paths (leaves) the tree holds."""
        def count(node: SegmentNode | None) -> int:
            if node is None:
                return 0
            if node.guard is None:
                return 1
            return sum(count(child) for child in node.children.values())
        return count(self.root)




def _reads(segment: Segment) -> list[str]:
    """Names a node reads from the run's values: its trace's inputs, its op's and guard's."""
    names = [p.name for p in segment.trace.args]
    for bsym in (segment.op, segment.guard):
        if bsym is not None:
            names += [p.name for p in bsym.proxy_inputs]
    return names


def _run_op(op: BoundSymbol, env: dict[str, Any]) -> None:
    """Run a data-dependent op eagerly (recording autograd as eager does, in the grad mode it
    was traced in, without autocast: its arguments were cast when it was traced)."""
    args, kwargs = map_proxies(_real(env), (op.args, op.kwargs))
    grad = CallSiteTag.GRAD in op.tags and torch.is_grad_enabled()
    with torch.set_grad_enabled(grad), no_autocast():
        out = op.sym.impl(*args, **kwargs)
    got, traced = len(pytree.tree_leaves(out)), len(pytree.tree_leaves(op.output))
    if got < traced:  # (more results: the guard on the traced ones' shapes tells the paths)
        raise OutputsDiffer(f"{op.sym.name} returned {got} results where it returned {traced} "
                            "when traced")
    bind_outputs(op.output, out, env)


def _reason(segment: Segment) -> str:
    if segment.guard is None:
        return "the end of the program"
    where = f" at {segment.guard.source}" if segment.guard.source is not None else ""
    return f"{segment.guard.args[0]}{where}"
