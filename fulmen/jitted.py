"""The runtime of a compiled function: the cache of compiled entries and the call path.

`_Jitted` is what `fulmen.jit` returns for a function (`JittedFunction`) and what a jitted
module holds (`JittedModule._jit`): each call computes the cache key (`fulmen.tracer.guards`),
runs the cached entry on a hit, and on a miss traces (`fulmen.tracer.trace_program`), compiles
(`fulmen.pipeline`) and caches a `CacheEntry`; calls fulmen does not compile run eagerly
(`RunsEagerly`), with one warning per reason. `CompileStats` is what `fulmen.compile_stats`
reports.
"""

from __future__ import annotations

import operator
import sys
import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen import config
from fulmen.cache_entry import CacheEntry, CompileStats
from fulmen.cache_policy import CacheLimits
from fulmen.compile_miss import (
    _RECOMPILES,
    _TRACING,
    CompileMiss,
    StoresDifferPerPath,
    _RanEagerly,
)
from fulmen.core import FulmenError, NotYetSupportedError, Proxy, RunsEagerly, get_tracectx
from fulmen.core.source import user_source_location
from fulmen.eager_streak import EagerStreak
from fulmen.executors import resolve_executors
from fulmen.pipeline import collector_paused
from fulmen.tracer import CacheKeyBuilder
from fulmen.tracer.autograd_function import BackwardInTrace
from fulmen.tracer.eager_reasons import LazyParameters
from fulmen.tracer.explain import describe_call, explain_change, tensor_names
from fulmen.tracer.host_floats import items_read_at_run_time, items_requested
from fulmen.tracer.input_aliasing import AliasedInputs
from fulmen.tracer.input_names import _path_name, _positional_names, state_slots
from fulmen.tracer.module_hooks import (
    HeldModulesWatch,
)
from fulmen.tracer.module_stores import (
    replay_module_stores,
)
from fulmen.tracer.objects import ARGUMENTS, MODULE, NotWalked, path_text
from fulmen.tracer.shape_policy import DynamicDims
from fulmen.tracer.subsumed import accepts, call_sizes, erased_key
from fulmen.tracer.sym_ops import memoized_symbolic_ops
from fulmen.tracer.symbolic import carrier, number_at
from fulmen.transforms.base import CHECK_SOURCE, transform

_getitem = operator.getitem
_is_lazy = torch.nn.parameter.is_lazy
_functorch_active = torch._C._are_functorch_transforms_active
_forward_ad = torch.autograd.forward_ad  # `_current_level`: -1 outside `dual_level()`



def _probe_pass(trace):
    return trace


_PASS_CODE = transform("(probe)")(_probe_pass).__code__  # the code every `@transform` runs


def _pass_bug(error: Exception) -> bool:
    """Whether a failed symbolic compilation failed by a bug of a compile pass, shown rather
    than hidden by the fallback to constants or static sizes: under the test suite's
    `FULMEN_CHECK=1` only (users keep the fallback), an error that is not a `FulmenError` (a
    pass's deliberate refusal) raised from inside a `@transform` pass. Session 53: such an
    error retraced the call with its floats as constants, a recompile instead of a crash."""
    if not CHECK_SOURCE or isinstance(error, FulmenError):
        return False
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code is _PASS_CODE:
            return True
        frame = frame.tb_next
    return False

class _Jitted(CompileMiss, NotWalked):
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
        # NOTE [a deferred first call]: not where an eager run has no answer
        self._shapes = DynamicDims(dynamic, defer_first=setting == "defer" and not fullgraph
                                   and grad_argnums is None)
        self._strict_dynamic = setting == "strict"  # conformance runs: symbolic, no fallback
        if cache_size_limit is None:
            cache_size_limit = config.get("FULMEN_CACHE_SIZE_LIMIT")
        # functional autodiff returns (value, grads): no eager fallback has that structure
        self._cache_size_limit = cache_size_limit if grad_argnums is None else sys.maxsize
        self._limits = CacheLimits(self._cache_size_limit)  # per call structure, and overall
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
        self._guard.float_positions = self._shapes.float_positions  # (one set, shared)
        self._state_slots = state_slots(module) if module is not None else []
        # where each slot's tensor is read on every call (`_call`), in one C-level `map`
        self._state_owners = tuple(slot.owner for slot in self._state_slots)
        self._state_keys = tuple(slot.key for slot in self._state_slots)
        self._last_described: dict | None = None
        # a lazy module (`nn.LazyLinear`) has parameters without sizes until its first call
        # materialises them: until then its calls run eagerly (`_call`)
        self._lazy_state = any(map(_is_lazy, map(_getitem, self._state_owners, self._state_keys)))

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if get_tracectx() is not None and any(
                isinstance(leaf, Proxy) for leaf in pytree.tree_leaves((args, kwargs))):
            # called while an outer jitted function is being traced (recursion, nesting): trace
            # through the Python source, so the outer trace records the ops themselves
            if self._grad_argnums is not None:  # `fulmen.grad(f)`: its source gives no gradients
                raise BackwardInTrace(
                    "fulmen.grad / fulmen.value_and_grad called inside a compiled function: the "
                    "gradients are not traced into the caller's trace",
                    op="fulmen.grad", where=user_source_location(),
                    hint="call it outside the compiled function, or compile it alone")
            return (self._module if self._module is not None else self._fn)(*args, **kwargs)
        if _functorch_active():  # torch.func.grad / vmap / jacrev around the call
            return self._eagerly_or_raise(args, kwargs, FunctorchTransform(
                "called inside a torch.func transform (grad, vjp, jacrev, vmap, ...): a compiled "
                "program runs outside the transform's levels", op="torch.func",
                hint="for compiled gradients use fulmen.grad, fulmen.vjp or "
                "fulmen.value_and_grad"))
        if _forward_ad._current_level >= 0:  # dual tensors would lose their tangents
            return self._eagerly_or_raise(args, kwargs, ForwardAD(
                "called inside torch.autograd.forward_ad.dual_level(): a compiled program has "
                "no forward-mode derivative (its autograd.Function no jvp)",
                op="forward_ad", hint="call it outside dual_level()"))
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
            if self._lazy_state:
                if any(map(_is_lazy, state)):
                    return self._eagerly_or_raise(args, kwargs, LazyParameters(
                        "the module has parameters or buffers a lazy module has not "
                        "materialised yet (nn.LazyLinear, ...)", op="materialize",
                        hint="call the module once before compiling it"))
                self._lazy_state = False
            key, leaves = self._guard.key(args, kwargs, state)
            stats = self._stats
            stats.calls += 1
            entry = self._cache.get(key)
            if entry is None and self._shapes.entries:
                entry = self._shapes.lookup(self._guard, args, kwargs, state, leaves)
            self._guard.forget_walks()
            if entry is None and self._shapes.record_first_call(
                    leaves, lambda i: self._leaf_name(args, kwargs, i), self._guard.fn_roots):
                self._explain_miss(args, kwargs)  # (the next miss says what changed)
                return self._run_eagerly(args, kwargs, "first call", None)
            if entry is None:
                stats.cache_misses += 1
                self._explain_miss(args, kwargs)
                over = self._limits.over_limit([*self._cache.values(), *self._shapes.entries])
                if over is not None:
                    return self._over_limit(args, kwargs, over)
                if key in self._eager_keys:
                    kind, warning = self._eager_keys[key]
                    return self._run_eagerly(args, kwargs, kind, warning)
                if self._eager_streak.skip_trace():
                    return self._run_eagerly(args, kwargs, *self._eager_streak.reason)
                self._guard.functions_swapped()
                floats = frozenset(self._shapes.float_positions)
                try:
                    with collector_paused(), memoized_symbolic_ops():
                        entry = self._compile_call(args, kwargs, leaves)
                except (StoresDifferPerPath, RunsEagerly) as error:  # such calls never compile
                    return self._eagerly_or_raise(
                        args, kwargs, error,
                        key if isinstance(error, RunsEagerly) and error.remembered else None,
                        streak=True)
                self._eager_streak.end()
                self._limits.compiled(entry)
                # described again as now keyed (the trace may have added held modules, read
                # flags): the next miss names what changed, not what the key grew by
                self._last_described = self._describe(args, kwargs)
                # offsets the program read, attributes it wrote: keyed from now on
                if self._guard.guard_offsets(entry.offset_reads) | self._guard.take_stale() \
                        or floats != self._shapes.float_positions:  # keyed by type from now
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
                object_tensors = entry.read_object_tensors(roots)
            if entry.int_positions:  # (read before the epilogue stores new values)
                carriers = [carrier(number_at(leaves, self._guard.fn_roots, p))
                            for p in entry.int_positions]
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
        fresh: list[int] = []  # inputs this call allocated itself (`AliasingMemo.check`)
        if entry.int_positions:
            fresh += range(len(inputs), len(inputs) + len(carriers))
            inputs += carriers
        inputs += state
        if entry.captured_fresh:
            fresh += [len(inputs) + index for index in entry.captured_fresh]
        inputs += entry.captured_now()
        if entry.mutated_inputs:  # in-place updates of inputs: they must not alias each other
            try:
                entry.aliasing.check(inputs, entry.mutated_inputs, fresh)
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

    def _describe(self, args: tuple, kwargs: dict) -> dict[str, object]:
        """What this call is keyed on, by name (`describe_call`, and the autograd flags of
        closed-over tensors the programs read: `FlagReads.describe`)."""
        target = self._module.forward if self._module is not None else self._fn
        names = [name for name, _ in self._module.named_modules()] if self._module is not None else []
        described = describe_call(_positional_names(target), args, kwargs,
                                  self._guard.modules, names, self._guard.scalar_sources)
        if self._guard.flag_reads:
            described.update(self._guard.flag_reads.describe(
                tensor_names(self._fn if self._module is None else target, self._module)))
        return described

    def _explain_miss(self, args: tuple, kwargs: dict) -> list[str]:
        """Record (and log to `fulmen.recompiles`) why this call missed the cache."""
        target = self._module.forward if self._module is not None else self._fn
        described = self._describe(args, kwargs)
        self._limits.missed(args, kwargs, described)
        reasons = ["first call"]
        if self._last_described is not None:
            reasons = explain_change(self._last_described, described)
            self._stats.recompile_reasons.append(reasons)
            _RECOMPILES.info("retracing %s: %s", getattr(target, "__qualname__", target),
                             "; ".join(reasons))
        self._last_described = described
        return reasons

    def _over_limit(self, args: tuple, kwargs: dict, over: tuple[str, str]):
        """A call past the cache limits (`CacheLimits`): run it eagerly, warning once per
        call structure."""
        target = self._module if self._module is not None else self._fn
        name = getattr(getattr(target, "forward", target), "__qualname__", repr(target))
        kind, warning = over
        return self._run_eagerly(args, kwargs, kind, f"fulmen: {name} {warning}")

    def _compile_call(self, args: tuple, kwargs: dict, leaves: list) -> CacheEntry:
        """Compile a call that missed the cache: with symbolic sizes in the dimensions the
        policy makes dynamic (`DynamicDims`), else for its exact shapes. A symbolic trace that
        fails anywhere is logged and replaced by a static one (never an error of its own)."""
        if self._shapes.items_at_run_time and not items_requested():
            rng_state = torch.random.get_rng_state()
            try:
                with items_read_at_run_time():
                    return self._compile_call(args, kwargs, leaves)
            except (StoresDifferPerPath, RunsEagerly):
                raise
            except Exception as error:  # noqa: BLE001 - traced again with items as breaks
                if _pass_bug(error):
                    raise
                torch.random.set_rng_state(rng_state)
                self._shapes.drop_items()
                _RECOMPILES.info("items read at run time failed (%s: %s); tracing again "
                                 "with graph breaks", type(error).__name__, error)
        dims = self._shapes.dims_for(leaves, lambda i: self._leaf_name(args, kwargs, i),
                                     self._guard.fn_roots)
        if dims:
            rng_state = torch.random.get_rng_state()
            try:
                return self._compile(args, kwargs, dims)
            except (StoresDifferPerPath, RunsEagerly):  # the call runs eagerly (`_call`)
                raise
            except Exception as error:  # noqa: BLE001 - the static trace decides what is raised
                if self._strict_dynamic or _pass_bug(error):
                    raise
                torch.random.set_rng_state(rng_state)
                if self._shapes.drop_floats(dims):  # floats read at run time: constants again
                    _RECOMPILES.info("floats read at run time failed (%s: %s); tracing again "
                                     "with them constant", type(error).__name__, error)
                    return self._compile_call(args, kwargs, leaves)
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

    def _run_eagerly(self, args: tuple, kwargs: dict, kind: str, warning: str | None):
        """Run the original function or module on the call (no other thread traces
        meanwhile); the first time for each `kind` of reason, warn with `warning` (None: no
        warning, a deferred first call)."""
        self._stats.eager_calls += 1
        if kind not in self._warned and warning is not None:
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


class ForwardAD(RunsEagerly):
    """The call is made inside `torch.autograd.forward_ad.dual_level()`: tensors may carry
    tangents, which a compiled program neither reads nor gives (the `autograd.Function` that
    runs it has no `jvp`: eager runs raised `NotImplementedError`), so the call runs
    eagerly."""


def _restructure_grads(out, specs: list, argnums):
    value, flat = out
    grads, start = [], 0
    for spec in specs:
        count = spec.num_leaves
        grads.append(pytree.tree_unflatten(list(flat[start:start + count]), spec))
        start += count
    return value, (grads[0] if isinstance(argnums, int) else tuple(grads))
