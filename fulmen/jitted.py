"""The runtime of a compiled function: the cache of compiled entries and the call path.

`_Jitted` is what `fulmen.jit` returns for a function (`JittedFunction`) and what a jitted
module holds (`JittedModule._jit`): each call computes the cache key (`fulmen.tracer.guards`),
runs the cached entry on a hit, and on a miss traces (`fulmen.tracer.trace_program`), compiles
(`fulmen.pipeline`) and caches a `CacheEntry`; calls fulmen does not compile run eagerly
(`RunsEagerly`), with one warning per reason. `CompileStats` is what `fulmen.compile_stats`
reports.
"""

from __future__ import annotations

import contextlib
import operator
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen import config
from fulmen.core import FulmenError, NotYetSupportedError, Proxy, RunsEagerly, Trace, get_tracectx
from fulmen.eager_streak import EagerStreak
from fulmen.executors import resolve_executors
from fulmen.logs import get_logger
from fulmen.pipeline import collector_paused, compile_trace
from fulmen.tools.examine import examine_quietly
from fulmen.tracer import CacheKeyBuilder, trace_program
from fulmen.tracer.call_constants import copy_of
from fulmen.tracer.explain import describe_call, explain_change
from fulmen.tracer.guards import (
    GlobalStore,
    changed_classes,
    restore_classes,
    stored_proxies,
)
from fulmen.tracer.host_random import (
    HostRandomState,
    refuse_private_generators,
)
from fulmen.tracer.library_flags import answers_given, library_answers_off
from fulmen.tracer.module_hooks import (
    HeldModulesWatch,
)
from fulmen.tracer.module_stores import (
    make_module_stores,
    replay_module_stores,
)
from fulmen.tracer.objects import ARGUMENTS, MODULE, ObjectInputs, path_text
from fulmen.tracer.seeding import seeds_inside
from fulmen.tracer.shape_policy import DynamicDims
from fulmen.tracer.subsumed import accepts, call_sizes, erased_key
from fulmen.tracer.sym_ops import memoized_symbolic_ops
from fulmen.tracer.symbolic import carrier, tensor_at
from fulmen.tracer.tracer import (
    AliasedInputs,
    _path_name,
    _positional_names,
    check_no_input_aliasing,
    state_slots,
)
from fulmen.transforms.segments import split_at_breaks
from fulmen.tree import MAX_BRANCHES, CompiledSegment, PathMiss, TraceTree

_RECOMPILES = get_logger("recompiles")
_getitem = operator.getitem
_functorch_active = torch._C._are_functorch_transforms_active
# Held while a call reads module state or object tensors, and while a program is traced.
_TRACING = threading.RLock()
_BREAKS = get_logger("breaks")


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
    # stores of Python constants the forward makes on its modules, replayed after each call
    module_stores: tuple = ()
    # `(index, module, attribute)`: captured tensors read afresh from the module on each call
    captured_attributes: tuple = ()
    # indices of captured tensors the traced call made itself: copied for each call
    captured_fresh: tuple = ()
    # integers traced as symbols: passed as carriers after the object tensors
    int_positions: tuple = ()
    # a static entry: the sizes of the call it was compiled for (`subsumed.call_sizes`)
    sizes: list | None = None

    def captured_now(self) -> tuple:
        """The captured tensors for this call (module tensor attributes as they are now, a new
        copy of each tensor the traced call made itself: `TracedProgram.captured_fresh`)."""
        if not self.captured_attributes and not self.captured_fresh:
            return self.captured
        values = list(self.captured)
        for index, owner, name in self.captured_attributes:
            values[index] = vars(owner)[name]
        for index in self.captured_fresh:
            values[index] = copy_of(values[index])
        return tuple(values)


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


class _Jitted:
    """Shared machinery of `JittedFunction` and `JittedModule`."""

    def _setup(self, fn, module, executors, transforms, grad_argnums=None,
               rematerialize=True, fullgraph=False, cache_size_limit=None,
               dynamic=None) -> None:
        self._fn = fn
        self._fullgraph = fullgraph
        self._held_watch = HeldModulesWatch()  # modules reached besides a jitted one
        # symbolic sizes (fulmen.tracer.symbolic): the policy, and the dimensions found to vary
        setting = config.get("FULMEN_DYNAMIC")
        if dynamic is None:
            dynamic = {"1": True, "strict": True, "0": False}.get(setting)
        self._shapes = DynamicDims(dynamic)
        self._strict_dynamic = setting == "strict"  # conformance runs: symbolic, no fallback
        if cache_size_limit is None:
            cache_size_limit = config.get("FULMEN_CACHE_SIZE_LIMIT")
        # functional autodiff returns (value, grads): no eager fallback has that structure
        self._cache_size_limit = cache_size_limit if grad_argnums is None else sys.maxsize
        self._warned: set[str] = set()  # the eager-fallback warnings given
        # keys whose calls run eagerly (`RunsEagerly`: a backward inside, Python's random
        # generator): the kind of reason and its warning
        self._eager_keys: dict = {}
        self._eager_streak = EagerStreak()  # misses that keep running eagerly, new keys each
        # False once a trace failed after libraries were told a proxy is traced (below)
        self._library_answers = True
        self._running_eagerly = False
        self.after_buffer_stores = None  # called after a compiled call replaced module buffers
        self._rematerialize = rematerialize
        self._grad_argnums = grad_argnums
        self._module = module
        self._executors = resolve_executors(executors)
        self._transforms = list(transforms or ())
        self._cache: dict[tuple, CacheEntry] = {}
        self._stats = CompileStats(cache=self._cache)
        modules = tuple(module.modules()) if module is not None else ()
        self._guard = CacheKeyBuilder(modules, fn if module is None else module.forward)
        self._state_slots = state_slots(module) if module is not None else []
        # where each slot's tensor is read on every call (`_call`), in one C-level `map`
        self._state_owners = tuple(slot.owner for slot in self._state_slots)
        self._state_keys = tuple(slot.key for slot in self._state_slots)
        self._last_described: dict | None = None

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if get_tracectx() is not None and any(
                isinstance(leaf, Proxy) for leaf in pytree.tree_leaves((args, kwargs))):
            # called while an outer jitted function is being traced (recursion, nesting): trace
            # through the Python source, so the outer trace records the ops themselves
            return (self._module if self._module is not None else self._fn)(*args, **kwargs)
        if _functorch_active():  # torch.func.grad / vmap / jacrev around the call
            return self._eagerly_or_raise(args, kwargs, FunctorchTransform(
                "called inside a torch.func transform (grad, vjp, jacrev, vmap, ...): a compiled "
                "program runs outside the transform's levels", op="torch.func",
                hint="for compiled gradients use fulmen.grad, fulmen.vjp or "
                "fulmen.value_and_grad"))
        # a trace swaps proxies into argument objects and undoes stores into modules: every
        # read of module state and objects (and every trace) holds the tracing lock, so no
        # thread ever sees a proxy
        with _TRACING:
            if self._held_watch.changed():  # a hook or submodule of a held module changed
                _RECOMPILES.info("a module the function reaches changed its hooks, submodules, "
                                 "parameters or buffers; compiling anew")
                self.forget_compiled()
            state = list(map(_getitem, self._state_owners, self._state_keys)) \
                if self._state_slots else ()
            key, leaves = self._guard.key(args, kwargs, state)
            stats = self._stats
            stats.calls += 1
            entry = self._cache.get(key)
            if entry is None and self._shapes.entries:
                entry = self._shapes.lookup(self._guard, args, kwargs, state, leaves)
            self._guard.forget_walks()
            if entry is None:
                stats.cache_misses += 1
                reasons = self._explain_miss(args, kwargs)
                if len(self._cache) + len(self._shapes.entries) >= self._cache_size_limit:
                    return self._over_limit(args, kwargs, reasons)
                if key in self._eager_keys:
                    kind, warning = self._eager_keys[key]
                    return self._run_eagerly(args, kwargs, kind, warning)
                if self._eager_streak.skip_trace():
                    return self._run_eagerly(args, kwargs, *self._eager_streak.reason)
                self._guard.functions_swapped()
                try:
                    with collector_paused(), memoized_symbolic_ops():
                        entry = self._compile_call(args, kwargs, leaves)
                except (StoresDifferPerPath, RunsEagerly) as error:  # such calls never compile
                    return self._eagerly_or_raise(
                        args, kwargs, error, key if isinstance(error, RunsEagerly) else None,
                        streak=True)
                self._eager_streak.end()
                # offsets the program read, attributes it wrote: keyed from now on
                if self._guard.guard_offsets(entry.offset_reads) | self._guard.take_stale():
                    key, leaves = self._guard.key(args, kwargs, state)
                if entry.shape_guard is not None:
                    self._shapes.add(entry, self._guard, args, kwargs, state)
                    self._drop_subsumed(entry, key)
                else:
                    entry.sizes = call_sizes(leaves, self._guard.offset_positions)
                    self._cache[key] = entry
                self._guard.forget_walks()  # (the keys just computed walked the objects again)
            else:
                stats.cache_hits += 1
            objects = entry.objects
            roots = {}
            if objects is not None:
                roots = {i: leaves[i] if i >= 0 else self._guard.fn_roots[-1 - i]
                         for i in objects.roots}
                object_tensors = objects.read_tensors(roots)
            if entry.int_positions:  # (read before the epilogue stores new values)
                carriers = [carrier(tensor_at(leaves, p)) for p in entry.int_positions]
        if objects is None and not entry.mutated_inputs and not entry.tree \
                and not entry.int_positions:  # the common case
            if entry.all_leaves_are_inputs:
                out = entry.fn(*leaves, *state, *entry.captured_now())
            else:
                out = entry.fn(*[leaves[i] for i in entry.tensor_positions], *state,
                               *entry.captured_now())
            return self._finish(entry, out)
        inputs = [leaves[i] for i in entry.tensor_positions]
        if objects is not None:
            inputs += object_tensors
        if entry.int_positions:
            inputs += carriers
        inputs += [*state, *entry.captured_now()]
        if entry.mutated_inputs:  # in-place updates of inputs: they must not alias each other
            try:
                check_no_input_aliasing(inputs, entry.mutated_inputs)
            except AliasedInputs as error:  # checked before anything ran: eager's answer
                return self._eagerly_or_raise(args, kwargs, error)
        if entry.tree:
            out = self._run_tree(entry, args, kwargs, inputs)
            if isinstance(out, _RanEagerly):
                return out.value
            out, leaf = out
            objects = leaf.objects  # each path has the epilogue of its own trace
        else:
            out = entry.fn(*inputs)
        if objects is not None and objects.epilogue:
            out_leaves, extras = out
            out = list(out_leaves)
            objects.epilogue.run(out, extras, {**roots, ARGUMENTS: (args, kwargs),
                                                MODULE: self._module}, inputs)
            if objects.epilogue.replaces_buffers and self.after_buffer_stores is not None:
                self.after_buffer_stores()
            if entry.tree:  # (a path with layers skipped returns a cache holding fewer)
                out = pytree.tree_unflatten(out, leaf.epilogue_spec)
        return self._finish(entry, out)

    def _finish(self, entry: CacheEntry, out):
        if entry.module_stores:
            replay_module_stores(entry.module_stores)
        if entry.output_spec is not None:
            out = pytree.tree_unflatten(list(out), entry.output_spec)
        if entry.grad_specs is not None:
            out = _restructure_grads(out, entry.grad_specs, self._grad_argnums)
        return out

    def _drop_subsumed(self, entry: CacheEntry, key: tuple) -> None:
        """Drop the static entries whose every call the new symbolic `entry` (made for a call
        whose static key is `key`) takes: NOTE [subsumed entries]."""
        dims = dict(entry.symbolic_dims)
        offsets = self._guard.offset_positions
        erased = erased_key(key, dims, offsets)
        if erased is None:
            return
        for old_key, old in list(self._cache.items()):
            if old.sizes is not None and erased_key(old_key, dims, offsets) == erased \
                    and accepts(entry.shape_guard, old.sizes):
                del self._cache[old_key]
                _RECOMPILES.info("an entry with symbolic sizes takes the calls of an entry "
                                 "for exact sizes; dropped that entry")

    def _explain_miss(self, args: tuple, kwargs: dict) -> list[str]:
        """Record (and log to `fulmen.recompiles`) why this call missed the cache."""
        target = self._module.forward if self._module is not None else self._fn
        names = [name for name, _ in self._module.named_modules()] if self._module else []
        described = describe_call(_positional_names(target), args, kwargs,
                                  self._guard.modules, names, self._guard.scalar_sources)
        reasons = ["first call"]
        if self._last_described is not None:
            reasons = explain_change(self._last_described, described)
            self._stats.recompile_reasons.append(reasons)
            _RECOMPILES.info("retracing %s: %s", getattr(target, "__qualname__", target),
                             "; ".join(reasons))
        self._last_described = described
        return reasons

    def _over_limit(self, args: tuple, kwargs: dict, reasons: list[str]):
        """A call past `cache_size_limit` specialisations: run it eagerly (warning once)."""
        target = self._module if self._module is not None else self._fn
        name = getattr(getattr(target, "forward", target), "__qualname__", repr(target))
        return self._run_eagerly(args, kwargs, "cache_size_limit", (
            f"fulmen: {name} has been compiled for {self._cache_size_limit} different calls "
            f"(cache_size_limit); calls matching none of them run eagerly. The last "
            f"retrace was because {'; '.join(reasons)}. Raise the limit with "
            "fulmen.jit(..., cache_size_limit=N) or FULMEN_CACHE_SIZE_LIMIT, or keep that "
            "value fixed between calls"))

    def _compile_call(self, args: tuple, kwargs: dict, leaves: list) -> CacheEntry:
        """Compile a call that missed the cache: with symbolic sizes in the dimensions the
        policy makes dynamic (`DynamicDims`), else for its exact shapes. A symbolic trace that
        fails anywhere is logged and replaced by a static one (never an error of its own)."""
        dims = self._shapes.dims_for(leaves, lambda i: self._leaf_name(args, kwargs, i))
        if dims:
            rng_state = torch.random.get_rng_state()
            try:
                return self._compile(args, kwargs, dims)
            except (StoresDifferPerPath, RunsEagerly):  # the call runs eagerly (`_call`)
                raise
            except Exception as error:  # noqa: BLE001 - the static trace decides what is raised
                if self._strict_dynamic:
                    raise
                torch.random.set_rng_state(rng_state)
                if self._shapes.drop_ints(dims):  # the integers given symbols: constants again
                    _RECOMPILES.info("symbolic integers failed (%s: %s); tracing again with "
                                     "them constant", type(error).__name__, error)
                    return self._compile_call(args, kwargs, leaves)
                if self._shapes.drop_ones():  # the sizes of 1 it generalised: specialise them
                    _RECOMPILES.info("symbolic sizes with generalised 1s failed (%s: %s); "
                                     "tracing again with the 1s specialised",
                                     type(error).__name__, error)
                    return self._compile_call(args, kwargs, leaves)
                self._shapes.failed()
                _RECOMPILES.info("symbolic sizes failed (%s: %s); compiling for these shapes",
                                 type(error).__name__, error)
        return self._compile(args, kwargs)

    def _leaf_name(self, args: tuple, kwargs: dict, position) -> str:
        """The name of the flattened argument at `position` (as the trace's inputs are named),
        or of the tensor at `(position, path)` inside an object argument."""
        target = self._module.forward if self._module is not None else self._fn
        position, steps = position if isinstance(position, tuple) else (position, ())
        path = pytree.tree_flatten_with_path((args, kwargs))[0][position][0]
        return _path_name(path, _positional_names(target)) + path_text(steps)

    def _trace(self, args: tuple, kwargs: dict, dynamic=None, settle: bool = False):
        """Trace one call (graph breaks allowed unless `fullgraph` or functional autodiff);
        `dynamic` maps argument positions to the dimensions given symbolic sizes.

        A program with graph breaks that stores constants on its modules may store different
        ones per path. With `settle` (a call that compiles a new cache entry), the stores are
        made and the call traced again: a lazy initialisation (HF's
        `_output_capturing_hooks_installed`) then stores nothing, the stores count as this
        call's, and the stored attributes are keyed from then on, so the entry serves only
        calls that start from these values; a path that stores is never grafted onto it.

        Raises:
            StoresDifferPerPath: the program (after settling) stores on its modules and has
                graph breaks.
        """
        rng_state = torch.random.get_rng_state()
        host_random = HostRandomState()
        classes = self._guard.class_snapshots()
        global_holders = self._guard.global_snapshots()
        given = answers_given()
        try:
            with contextlib.nullcontext() if self._library_answers else library_answers_off():
                program = trace_program(self._fn, args, kwargs, module=self._module,
                                        allow_breaks=self._eager_allowed,
                                        dynamic=dynamic, replay_stores=True)
        except FulmenError as error:
            restore_classes(classes)
            stored_proxies(global_holders)
            host_random.restore()  # an eager run (`RunsEagerly`) draws what the trace drew
            if isinstance(error, RunsEagerly) and self._eager_allowed:
                raise  # the call runs eagerly: no report to write
            if settle and answers_given() != given and self._library_answers:
                # an answer led where eager does not go (library_flags.py): from now on the
                # libraries read values, as eager does; entries traced with answers are dropped
                # (a tree's new path must be traced as its old ones were)
                _RECOMPILES.info("tracing failed after a library was told a tensor is traced "
                                 "(%s); tracing again without such answers", error)
                self._library_answers = False
                self.forget_compiled()
                torch.random.set_rng_state(rng_state)
                return self._trace(args, kwargs, dynamic, settle=True)
            raise _with_examine_report(error, self._module or self._fn, args, kwargs) from None
        except BaseException:
            host_random.restore()  # the generators left at their sentinel states otherwise
            raise
        leaked = stored_proxies(global_holders)
        if leaked:
            restore_classes(classes)
            host_random.restore()
            raise GlobalStore(
                f"the function stores a traced tensor into {leaked[0]}; a compiled call would "
                "leave a placeholder there", op="store",
                hint="return the tensor instead, or keep it in a module attribute or an "
                "argument object, whose stores fulmen replays")
        self._guard.add_modules(program.held_modules)
        self._guard.add_functions(pytree.tree_leaves((args, kwargs)))
        self._held_watch.add(program.held_modules)
        host_random.refuse_draws()
        refuse_private_generators(program.trace, (args, kwargs))
        changed = changed_classes(classes)
        if changed:  # `CFG.calls += 1`: a compiled call would not repeat it
            restore_classes(classes)
            raise StoresDifferPerPath(
                f"the function stores attributes of the class {changed[0].__qualname__}",
                op="setattr", hint="keep changing state in module attributes or arguments")
        with torch._C.DisableTorchFunction():  # also when compiling inside another trace
            reseeded = not torch.equal(rng_state, torch.random.get_rng_state())
        # seeding through torch's Python functions raises where it happens
        # (`fulmen.tracer.seeding`); a changed state is then another thread's draws, unless this
        # is the only thread (`torch.default_generator.set_state` called directly)
        if reseeded and threading.active_count() == 1:
            # tracing draws no random numbers, so the code reseeded or set the generator
            torch.random.set_rng_state(rng_state)
            raise seeds_inside("torch.manual_seed")
        self._guard.note_module_writes(program.module_writes, program.captured,
                                       fresh=not program.breaks)
        if program.module_stores and program.breaks and program.module_writes:
            # the traced tensors it stored (`self.inv_freq = self.original_inv_freq` beside
            # `self.max_seq_len_cached = 8`, HF's dynamic RoPE reset) are made by the epilogue
            # of this trace only: settling would trace again without them
            raise StoresDifferPerPath(
                f"the forward stores {program.module_stores[0].key!r} and a traced tensor in "
                f"{sorted(program.module_writes)[0][1]!r} on a module and has graph breaks "
                f"({program.breaks[0]})", op="setattr",
                hint="keep the value outside the module, or avoid the break")
        if program.module_stores and program.breaks and settle:
            undo = make_module_stores(program.module_stores)
            torch.random.set_rng_state(rng_state)
            try:
                settled = self._trace(args, kwargs, dynamic)
            except BaseException:
                undo()
                raise
            self._guard.watch_attributes([(store.module, store.key)
                                          for store in program.module_stores])
            return settled
        if program.module_stores and program.breaks:
            raise StoresDifferPerPath(
                f"the forward stores {program.module_stores[0].key!r} on a module and has graph "
                f"breaks ({program.breaks[0]}); the store may differ per path",
                op="setattr", hint="keep the value outside the module, or avoid the break")
        return program

    def _compile(self, args: tuple, kwargs: dict, dynamic=None) -> CacheEntry:
        program = self._trace(args, kwargs, dynamic, settle=True)
        if program.breaks:
            entry = self._compile_tree(program, args, kwargs)
            for name, value in self._shapes.entry_fields(program).items():
                setattr(entry, name, value)
            return entry
        grad_specs = wrt = None
        if self._grad_argnums is not None:
            wrt, grad_specs = _grad_inputs(program, args, kwargs, self._grad_argnums)
        compiled, seconds = self._compile_trace(program.trace, wrt)
        # tracing first, in the dict the backward adds its stages to when it compiles
        stages = dict(seconds)
        seconds.clear()
        seconds.update({"tracing": program.seconds, **stages})
        self._stats.last_traces = compiled.traces
        self._stats.last_segments = [compiled]
        self._stats.last_backward_variants = compiled.backward_variants
        self._stats.stage_seconds = seconds
        self._stats.graph_breaks = []
        return CacheEntry(compiled.fn, compiled.traces, program.tensor_positions, program.captured,
                          program.output_spec, seconds, grad_specs=grad_specs,
                          mutated_inputs=program.mutated_inputs, objects=program.objects,
                          all_leaves_are_inputs=_all_leaves_are_inputs(program, args, kwargs),
                          offset_reads=program.offset_reads,
                          module_stores=program.module_stores,
                          captured_attributes=program.captured_attributes,
                          captured_fresh=program.captured_fresh,
                          int_positions=program.int_positions,
                          **self._shapes.entry_fields(program))

    def _compile_trace(self, trace: Trace, wrt=None) -> tuple[CompiledSegment, dict[str, float]]:
        """The pass pipeline (`fulmen.pipeline`) on one trace with this callable's options."""
        return compile_trace(trace, self._executors, transforms=self._transforms, wrt=wrt,
                             rematerialize=self._rematerialize)

    def _compile_tree(self, program, args: tuple, kwargs: dict,
                      entry: CacheEntry | None = None) -> CacheEntry:
        """Compile a traced path with graph breaks into a new trace tree (or graft it onto the
        tree of `entry`)."""
        captured = len(program.captured)
        arg_proxies = program.trace.args[:len(program.trace.args) - captured]
        constants = {p.name: t for p, t in zip(program.trace.args[len(arg_proxies):],
                                               program.captured)}
        seconds: dict[str, float] = {"tracing": program.seconds}

        def compile_segment(trace: Trace) -> CompiledSegment:
            compiled, stage_seconds = self._compile_trace(trace)
            for stage, value in stage_seconds.items():
                seconds[stage] = seconds.get(stage, 0.0) + value
            return compiled

        tree = entry.fn if entry is not None else TraceTree(tuple(p.name for p in arg_proxies))
        segments = split_at_breaks(program.trace, program.requires_grad_names)
        epilogue = program.objects is not None and bool(program.objects.epilogue)
        path = tree.graft(segments, program.trace.output,
                          None if epilogue else program.output_spec, constants, compile_segment)
        if path is not None:  # each path has its own epilogue (one may rebuild a cache object)
            path[-1].objects = program.objects
            path[-1].epilogue_spec = program.output_spec if epilogue else None
        _log_breaks(program.breaks)
        stats = self._stats
        stats.graph_breaks = [str(info) for info in program.breaks]
        if path is not None:
            stats.last_traces = [program.trace] + [t for n in path for t in n.compiled.traces]
            stats.last_segments = [n.compiled for n in path]
            stats.stage_seconds = seconds
        mutated = tuple(i for i in program.mutated_inputs if i < len(arg_proxies))
        if entry is not None:
            entry.mutated_inputs = tuple(sorted({*entry.mutated_inputs, *mutated}))
            return entry
        return CacheEntry(tree, [program.trace], program.tensor_positions, (), None, seconds,
                          mutated_inputs=mutated, tree=True, objects=program.objects,
                          all_leaves_are_inputs=_all_leaves_are_inputs(program, args, kwargs),
                          offset_reads=program.offset_reads, int_positions=program.int_positions)

    def _run_tree(self, entry: CacheEntry, args: tuple, kwargs: dict, inputs: list):
        """Run a trace tree; on a new answer, retrace from the root, graft, run again. A call
        whose path cannot be compiled (a guard with too many answers) runs eagerly."""
        rng_state = torch.random.get_rng_state()
        for attempt in range(2):
            try:
                return entry.fn(*inputs)
            except PathMiss as error:
                miss = error
                torch.random.set_rng_state(rng_state)  # the next run draws the same numbers
                if miss.node.closed or attempt == 1:
                    break
                _RECOMPILES.info("new branch of %s: %r", miss.node.reason, miss.answer)
                self._stats.recompile_reasons.append(
                    [f"graph break {miss.node.reason} answered {miss.answer!r}"])
                with _TRACING, collector_paused(), memoized_symbolic_ops():
                    try:
                        program = self._trace(args, kwargs, dict(entry.symbolic_dims) or None)
                    except (StoresDifferPerPath, RunsEagerly) as error:  # this path runs eagerly
                        torch.random.set_rng_state(rng_state)
                        return _RanEagerly(self._run_eagerly(args, kwargs, "stores", (
                            f"fulmen: the graph break {miss.node.reason} answered "
                            f"{miss.answer!r} on a path that cannot be compiled ({error}); "
                            "such calls run eagerly")))
                    torch.random.set_rng_state(rng_state)
                    self._compile_tree(program, args, kwargs, entry)
                    self._shapes.graft(entry, program)
                    # a new path that read offsets: later calls are keyed by them (this entry,
                    # keyed without, is then never hit again)
                    self._guard.guard_offsets(program.offset_reads)
        return _RanEagerly(self._run_eagerly(args, kwargs, "branches", (
            f"fulmen: the graph break {miss.node.reason} gave more than {MAX_BRANCHES} "
            "different answers; calls taking a new answer run eagerly")))

    @property
    def _eager_allowed(self) -> bool:
        """Whether a call may break the graph or run eagerly: not under `fullgraph=True`, nor
        for functional autodiff, whose results no eager call has."""
        return not self._fullgraph and self._grad_argnums is None

    def forget_compiled(self) -> None:
        """Drop every compiled entry (those with symbolic sizes too) and the keys remembered to
        run eagerly: what they were made for changed (a hook, a submodule). The sources of the
        key are collected again (a new hook reads its own globals and closure cells)."""
        self._cache.clear()
        self._shapes.clear()
        self._eager_keys.clear()
        self._eager_streak.end()
        self._guard.hooks_changed()  # what the hooks read is keyed

    def _eagerly_or_raise(self, args: tuple, kwargs: dict, error: NotYetSupportedError,
                          key=None, streak: bool = False):
        """Run the call eagerly because of `error` (warning once per kind), or raise it where
        eager runs are not allowed (`_eager_allowed`). `key`: remembered in `_eager_keys`, so
        later calls with it run eagerly without tracing; `streak`: a miss that was traced,
        counted by `_eager_streak`."""
        if not self._eager_allowed:
            raise error
        kind, warning = type(error).__name__, f"fulmen: {error}; such calls run eagerly"
        if streak:
            self._eager_streak.ran_eagerly((kind, warning))
        if key is not None:
            if len(self._eager_keys) >= 4 * self._cache_size_limit:
                self._eager_keys.clear()
            self._eager_keys[key] = (kind, warning)
        return self._run_eagerly(args, kwargs, kind, warning)

    def _run_eagerly(self, args: tuple, kwargs: dict, kind: str, warning: str):
        """Run the original function or module on the call (no other thread traces
        meanwhile); the first time for each `kind` of reason, warn with `warning`."""
        self._stats.eager_calls += 1
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(warning, stacklevel=5)
        target = self._module if self._module is not None else self._fn
        with _TRACING:
            self._running_eagerly = True  # `JittedModule.generate` calls the module's own forward
            try:
                return target(*args, **kwargs)
            finally:
                self._running_eagerly = False


class FunctorchTransform(RunsEagerly):
    """The call is made inside a `torch.func` transform (`grad`, `vmap`, `jacrev`): its tensors
    are wrapped per transform level, which a compiled program does not see, so the call runs
    eagerly (the transform differentiates or batches the eager ops)."""


class StoresDifferPerPath(NotYetSupportedError):
    """A program with graph breaks stores on its modules: each path may store differently."""


@dataclass(frozen=True)
class _RanEagerly:
    """The output of a call that ran eagerly (already the user's structure, stores done)."""

    value: Any


def _all_leaves_are_inputs(program, args: tuple, kwargs: dict) -> bool:
    """Whether the call's arguments are exactly the trace's leading tensor inputs (the fast
    path of `_Jitted._call` passes them without picking)."""
    return (not kwargs and len(program.tensor_positions) == len(args)
            and all(isinstance(a, torch.Tensor) for a in args))


def _log_breaks(breaks) -> None:
    """Log each graph break once per process (`FULMEN_LOGS=breaks`)."""
    for info in breaks:
        key = (info.reason.split("(")[0], info.source)
        if key not in _LOGGED_BREAKS:
            _LOGGED_BREAKS.add(key)
            _BREAKS.info("graph break: %s", info)


_LOGGED_BREAKS: set = set()


def _with_examine_report(error: FulmenError, fn, args: tuple, kwargs: dict) -> FulmenError:
    """`error` with the `fulmen.examine` report of the call appended to its message."""
    try:
        report = examine_quietly(fn, *args, **kwargs)
    except Exception:  # never hide the original error behind a failing report
        return error
    error.args = (f"{error.args[0]}\n\n{report}",) + tuple(error.args[1:])
    return error


def _grad_inputs(program, args: tuple, kwargs: dict, argnums) -> tuple[list[str], list]:
    """Names of the trace inputs for `args[argnums]`, and each argument's treespec."""
    selected = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    proxy_at = dict(zip(program.tensor_positions, program.trace.args))
    flat = pytree.tree_flatten_with_path((args, kwargs))[0]
    names, specs = [], []
    for argnum in selected:
        if not -len(args) <= argnum < len(args):
            raise FulmenError(f"argnums {argnum} out of range for {len(args)} arguments",
                              op="fulmen.grad", argument="argnums")
        argnum %= len(args)
        _, spec = pytree.tree_flatten(args[argnum])
        for index, (path, leaf) in enumerate(flat):
            if path[0].idx == 0 and path[1].idx == argnum:
                if not (isinstance(leaf, torch.Tensor) and leaf.dtype.is_floating_point):
                    raise FulmenError(f"argument {argnum} must be floating-point tensors",
                                      op="fulmen.grad", argument=f"args[{argnum}]")
                names.append(proxy_at[index].name)
        specs.append(spec)
    return names, specs


def _restructure_grads(out, specs: list, argnums):
    value, flat = out
    grads, start = [], 0
    for spec in specs:
        count = spec.num_leaves
        grads.append(pytree.tree_unflatten(list(flat[start:start + count]), spec))
        start += count
    return value, (grads[0] if isinstance(argnums, int) else tuple(grads))
