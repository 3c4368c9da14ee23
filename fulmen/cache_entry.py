"""What a jitted callable keeps per specialisation (`CacheEntry`: the compiled callable, its
traces and how to feed it) and what `fulmen.compile_stats` reports (`CompileStats`)."""

from __future__ import annotations

import keyword
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fulmen.core import Trace
from fulmen.tracer.call_constants import copy_of
from fulmen.tracer.input_aliasing import AliasingMemo
from fulmen.tracer.object_inputs import ObjectInputs


@dataclass
class CacheEntry:
    """A compiled specialisation: the callable, its traces and how to feed it."""

    fn: Callable
    traces: list[Trace]
    tensor_positions: tuple[int, ...]
    captured: tuple[torch.Tensor, ...]
    output_spec: Any
    stage_seconds: dict[str, float]
    grad_specs: list | None = None
    all_leaves_are_inputs: bool = False
    mutated_inputs: tuple[int, ...] = ()
    tree: bool = False  # `fn` is a TraceTree (the program has graph breaks)
    objects: ObjectInputs | None = None  # object arguments: inputs read through them, epilogue
    offset_reads: frozenset[int] = frozenset()  # arguments whose storage_offset() was read
    # with symbolic sizes: the check of the ShapeEnv's guards on the call's arguments, and the
    # dimensions (by argument position) left out of the cache key
    shape_guard: Callable | None = None
    symbolic_dims: tuple = ()
    # a trace tree's floats read at run time (positions, left out of the key): a new path is
    # traced with them read so too, never with this call's values as constants
    float_positions: tuple = ()
    # stores of Python constants the forward makes on its modules, replayed after each call
    module_stores: tuple = ()
    # `(index, module, attribute)`: captured tensors read afresh from the module on each call
    captured_attributes: tuple = ()
    # indices of captured tensors the traced call made itself: copied for each call
    captured_fresh: tuple = ()
    # `(index, tensor)`: captured gradients read afresh as `tensor.grad` on each call
    captured_grads: tuple = ()
    # integers traced as symbols: passed as carriers after the object tensors
    int_positions: tuple = ()
    # a static entry: the sizes of the call it was compiled for (`subsumed.call_sizes`)
    sizes: list | None = None
    # the call structure it was compiled for (`fulmen.cache_policy.CacheLimits`)
    structure: int = -1
    # the input-aliasing check of `mutated_inputs`, remembering the last call that passed
    aliasing: AliasingMemo = field(default_factory=AliasingMemo, repr=False)
    _object_reader: Callable | None = field(default=None, repr=False)

    def read_object_tensors(self, roots: dict[int, Any]) -> list[torch.Tensor]:
        """`self.objects.read_tensors(roots)` (the tensors inside the call's objects, in input
        order), by a function generated once per entry (`object_reader`)."""
        if self._object_reader is None:
            self._object_reader = object_reader(self.objects.tensor_paths)
        return self._object_reader(roots)

    def captured_now(self) -> tuple:
        """The captured tensors for this call (module tensor attributes as they are now, a new
        copy of each tensor the traced call made itself: `TracedProgram.captured_fresh`)."""
        if not self.captured_attributes and not self.captured_fresh and not self.captured_grads:
            return self.captured
        values = list(self.captured)
        for index, owner, name in self.captured_attributes:
            values[index] = vars(owner)[name]
        for index, owner in self.captured_grads:  # NOTE [flags of closed-over tensors]
            values[index] = owner.grad
        for index in self.captured_fresh:
            values[index] = copy_of(values[index])
        return tuple(values)


def object_reader(tensor_paths: list[tuple[int, tuple]]) -> Callable:
    """A function of `roots` returning `[follow(roots[root], path) for root, path in
    tensor_paths]`, written out as one Python expression per path (`roots[-1].param_groups[0]
    [K[0]][3]`: every step read in the same order, through the same `getattr` and `[]`), so a
    call does not loop over the steps of ~100 optimizer paths in Python. Keys and attribute
    names that are not plain identifiers are passed as constants `K`."""
    constants: list = []

    def constant(value: Any) -> str:
        constants.append(value)
        return f"K[{len(constants) - 1}]"

    roots = sorted({root for root, _ in tensor_paths})
    lines = ["def read(roots):"]
    lines += [f"    r{j} = roots[{root!r}]" for j, root in enumerate(roots)]
    local = {root: f"r{j}" for j, root in enumerate(roots)}
    exprs = []
    for root, path in tensor_paths:
        expr = local[root]
        for kind, key in path:
            if kind == "attr" and type(key) is str and key.isidentifier() \
                    and not keyword.iskeyword(key):
                expr += f".{key}"
            elif kind == "attr":
                expr = f"getattr({expr}, {constant(key)})"
            else:
                expr += f"[{constant(key)}]"
        exprs.append(expr)
    lines.append(f"    return [{', '.join(exprs)}]")
    namespace = {"K": tuple(constants)}
    exec(compile("\n".join(lines), "<fulmen object tensors>", "exec"), namespace)  # noqa: S102
    return namespace["read"]


@dataclass
class CompileStats:
    """Counters and timings of one jitted callable.

    `stage_seconds` maps each stage of the last compilation (tracing, each pass, Python
    compilation) to seconds; `calls`, `cache_hits` and `cache_misses` count calls.
    `graph_breaks` names the breaks of the path last compiled (`bool(t17) at model.py:12 ...`),
    `branches` counts the compiled paths, `eager_calls` the calls that ran eagerly because a
    guard had too many different answers (`fulmen.tree.MAX_BRANCHES`).
    """

    calls: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    last_traces: list[Trace] = field(default_factory=list)
    # the compiled segments of the last compilation (their backward stages: see below)
    last_segments: list = field(default_factory=list)
    # unused-cotangent flags -> stages of the backward compiled for calls with unused outputs
    # (of the last compilation without graph breaks; filled as such calls run)
    last_backward_variants: dict = field(default_factory=dict)
    recompile_reasons: list[list[str]] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    graph_breaks: list[str] = field(default_factory=list)
    eager_calls: int = 0
    cache: dict = field(default_factory=dict)  # the jitted callable's cache entries, by key

    @property
    def last_backward_traces(self) -> list[Trace]:
        """The backward stages of the last compilation, each backward claimed and compiled
        first if no call has needed it yet (NOTE [the backward compiles when first needed])."""
        return [trace for segment in self.last_segments
                for trace in segment.all_backward_traces()]

    @property
    def branches(self) -> int:
        """Compiled paths through programs with graph breaks, over all cache entries."""
        return sum(entry.fn.paths() for entry in self.cache.values() if entry.tree)


__all__ = ["CacheEntry", "CompileStats", "object_reader"]
