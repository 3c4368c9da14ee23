"""A cache miss of a jitted callable (`fulmen.jitted._Jitted`, whose `CompileMiss` mixin this
is): trace the call (`_trace`, with the checks of what tracing changed: classes, globals, the
random generators, module stores), compile the program (`_compile`: one trace, or a trace tree
where it has graph breaks, `_compile_tree`) and run a trace tree, grafting new paths
(`_run_tree`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.cache_entry import CacheEntry
from fulmen.core import FulmenError, NotYetSupportedError, RunsEagerly, Trace
from fulmen.logs import get_logger
from fulmen.pipeline import collector_paused, compile_trace
from fulmen.tools.examine import examine_quietly
from fulmen.tracer import trace_program
from fulmen.tracer.backward_in_trace import run_without_grad, use_autodiff
from fulmen.tracer.break_sizes import trace_with_counts
from fulmen.tracer.global_modes import check_modes_kept, modes_snapshot, restore_modes
from fulmen.tracer.host_floats import items_read_at_run_time
from fulmen.tracer.host_output import catch_prints
from fulmen.tracer.host_random import HostRandomState, refuse_private_generators
from fulmen.tracer.library_flags import answers_given, library_answers_off
from fulmen.tracer.module_stores import make_module_stores
from fulmen.tracer.seeding import seeds_inside
from fulmen.tracer.source_keys import GlobalStore, changed_classes, restore_classes, stored_proxies
from fulmen.tracer.sym_ops import memoized_symbolic_ops
from fulmen.tracer.symbolic import FLOAT
from fulmen.transforms.autodiff import split_forward_backward
from fulmen.transforms.segments import split_at_breaks
from fulmen.tree import MAX_BRANCHES, CompiledSegment, OutputsDiffer, PathMiss, TraceTree

use_autodiff(split_forward_backward)  # `loss.backward()` inside traced code

_RECOMPILES = get_logger("recompiles")
# Held while a call reads module state or object tensors, and while a program is traced.
_TRACING = threading.RLock()
_BREAKS = get_logger("breaks")


class CompileMiss:
    """The miss path of `_Jitted` (which provides `_fn`, `_module`, `_guard`, `_stats`,
    `_shapes`, `_executors`, `_run_eagerly`, ...)."""

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
        modes = modes_snapshot()
        try:
            with contextlib.nullcontext() if self._library_answers else library_answers_off(), \
                    catch_prints() as prints:
                program = trace_program(self._fn, args, kwargs, module=self._module,
                                        allow_breaks=self._eager_allowed,
                                        dynamic=dynamic, replay_stores=True,
                                        share_repeated=self._grad_argnums is None)
        except (FulmenError, RuntimeError, ValueError, TypeError, IndexError) as error:
            # (PyTorch's own errors too: an op run on real values that eager rejects raises
            # eager's error, which an answer given to a library may have led to)
            restore_classes(classes)
            stored_proxies(global_holders)
            restore_modes(modes)
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
            if not isinstance(error, FulmenError):
                raise
            raise _with_examine_report(error, self._module or self._fn, args, kwargs) from None
        except BaseException:
            restore_modes(modes)
            host_random.restore()  # the generators left at their sentinel states otherwise
            raise
        leaked, stored = stored_proxies(global_holders)
        if leaked:
            restore_classes(classes)
            host_random.restore()
            raise GlobalStore(
                f"the function stores a traced tensor into {leaked[0]}; a compiled call would "
                "leave a placeholder there", op="store",
                hint="return the tensor instead, or keep it in a module attribute or an "
                "argument object, whose stores fulmen replays")
        if stored:  # `global step; step += 1`: a compiled call would not repeat the store
            restore_classes(classes)
            host_random.restore()
            raise GlobalStore(
                f"the function stores into {stored[0]}; a compiled call would not repeat the "
                "store", op="store",
                hint="keep changing state in a module attribute or an argument object, whose "
                "stores fulmen replays")
        if prints.wrote:  # a compiled call would not print (fulmen.tracer.host_output)
            restore_classes(classes)
            host_random.restore()
            prints.refuse_writes()
        if modes_snapshot() != modes:  # `torch.set_grad_enabled(False)` not undone: eager
            restore_classes(classes)
            host_random.restore()
            check_modes_kept(modes)
        self._guard.add_modules(program.held_modules)
        self._guard.add_functions(pytree.tree_leaves((args, kwargs)))
        self._guard.watch_environment(program.environment_reads)
        self._guard.watch_flags(program.flag_reads)
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
            entry.float_positions = tuple(position for position, kind in (dynamic or {}).items()
                                          if kind == FLOAT)
            return entry
        grad_specs = wrt = None
        if self._grad_argnums is not None:
            wrt, grad_specs = _grad_inputs(program, args, kwargs, self._grad_argnums)
        if "spent" in program.extra:  # `loss.backward()` inside: gradients are trace values
            with torch.no_grad():
                compiled, seconds = self._compile_trace(program.trace, wrt)
            compiled = dataclasses.replace(compiled, fn=run_without_grad(
                compiled.fn, program.trace.output, program.extra["spent"]))
        else:
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
                          captured_grads=program.captured_grads,
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
        fresh = frozenset(program.trace.args[len(arg_proxies) + index].name
                          for index in program.captured_fresh)
        path = tree.graft(segments, program.trace.output,
                          None if epilogue else program.output_spec, constants, compile_segment,
                          arg_proxies, fresh)
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
            except OutputsDiffer as error:  # no path fits: this call runs eagerly
                torch.random.set_rng_state(rng_state)
                return _RanEagerly(self._run_eagerly(args, kwargs, "outputs", (
                    f"fulmen: {error}; such calls run eagerly")))
            except PathMiss as error:
                miss = error
                torch.random.set_rng_state(rng_state)  # the next run draws the same numbers
                if self._shapes.items_instead(miss.node.reason, miss.answer) \
                        and self._items_traceable(args, kwargs, entry):
                    for key in [k for k, e in self._cache.items() if e is entry]:
                        del self._cache[key]
                    self._shapes.remove(entry)
                    self._stats.calls -= 1  # (counted again)
                    return _RanEagerly(self._call(args, kwargs))  # (compiled, not eagerly)
                if miss.node.closed or attempt == 1:
                    break
                _RECOMPILES.info("new branch of %s: %r", miss.node.reason, miss.answer)
                self._stats.recompile_reasons.append(
                    [f"graph break {miss.node.reason} answered {miss.answer!r}"])
                dims = _path_dims(entry)
                with _TRACING, collector_paused(), memoized_symbolic_ops():
                    try:  # (sizes after breaks symbolic where they vary: `break_sizes`)
                        program = trace_with_counts(
                            functools.partial(self._trace, args, kwargs, dims),
                            entry.fn.sites,
                            lambda: torch.random.set_rng_state(rng_state))
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

    def _items_traceable(self, args: tuple, kwargs: dict, entry: CacheEntry) -> bool:
        """Whether the call traces with `t.item()` read at run time (no item deciding a
        branch); if not, items stay graph breaks for good and `entry` keeps its paths."""
        rng_state = torch.random.get_rng_state()
        try:
            with _TRACING, collector_paused(), memoized_symbolic_ops(), \
                    items_read_at_run_time():
                self._trace(args, kwargs, _path_dims(entry))
        except Exception as error:  # noqa: BLE001 - the graph breaks stay
            self._shapes.drop_items()
            _RECOMPILES.info("items read at run time failed (%s: %s); keeping graph breaks",
                             type(error).__name__, error)
            return False
        finally:
            torch.random.set_rng_state(rng_state)
        return True



def _path_dims(entry: CacheEntry) -> dict | None:
    """The `dynamic` argument of `trace_program` for a new path of `entry`'s trace tree: its
    symbolic sizes and its floats read at run time (a float traced as a constant there would be
    this call's value, served to calls the entry's key does not tell apart)."""
    dims = {**dict(entry.symbolic_dims), **{position: FLOAT for position in entry.float_positions}}
    return dims or None


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


__all__ = ["CompileMiss", "StoresDifferPerPath"]
