"""The user API: `jit`, `last_traces`, cache statistics and `compile_stats`.

    jfn = fulmen.jit(fn)              # or fulmen.jit(model)
    out = jfn(x, w)                   # traces, transforms, claims, compiles; then cached
    fulmen.last_traces(jfn)           # every stage, in order, each printable and runnable

Each call computes a cache key (see `fulmen.tracer.guards`); a hit runs the cached compiled
callable, a miss traces and compiles anew.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from fulmen.core import FulmenError, NotYetSupportedError, Proxy, Trace, get_tracectx
from fulmen.examine import examine_quietly
from fulmen.executors import Executor, resolve_executors
from fulmen.executors.claim import claim_executors
from fulmen.logs import get_logger
from fulmen.runtime import CompiledPair, run_with_autograd
from fulmen.tracer import CacheKeyBuilder, trace_program
from fulmen.tracer.guards import describe_call, explain_change
from fulmen.tracer.tracer import _positional_names, check_no_input_aliasing, state_slots
from fulmen.transforms import dce, delete_last_used
from fulmen.transforms.autodiff import split_forward_backward
from fulmen.transforms.autodiff.joint import value_and_grad_trace
from fulmen.transforms.remat import rematerialize

_RECOMPILES = get_logger("recompiles")
_PASSES = get_logger("passes")


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


@dataclass
class CompileStats:
    """Counters and timings of one jitted callable.

    `stage_seconds` maps each stage of the last compilation (tracing, each pass, Python
    compilation) to seconds; `calls`, `cache_hits` and `cache_misses` count calls.
    """

    calls: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    last_traces: list[Trace] = field(default_factory=list)
    last_backward_traces: list[Trace] = field(default_factory=list)
    recompile_reasons: list[list[str]] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)


class _Jitted:
    """Shared machinery of `JittedFunction` and `JittedModule`."""

    def _setup(self, fn, module, executors, transforms, grad_argnums=None,
               rematerialize=True) -> None:
        self._fn = fn
        self._rematerialize = rematerialize
        self._grad_argnums = grad_argnums
        self._module = module
        self._executors = resolve_executors(executors)
        self._transforms = list(transforms or ())
        self._cache: dict[tuple, CacheEntry] = {}
        self._stats = CompileStats()
        modules = tuple(module.modules()) if module is not None else ()
        self._guard = CacheKeyBuilder(modules, fn if module is None else module.forward)
        self._state_slots = state_slots(module) if module is not None else []
        self._last_described: dict | None = None

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if get_tracectx() is not None and any(
                isinstance(leaf, Proxy) for leaf in pytree.tree_leaves((args, kwargs))):
            # called while an outer jitted function is being traced (recursion, nesting): trace
            # through the Python source, so the outer trace records the ops themselves
            return (self._module if self._module is not None else self._fn)(*args, **kwargs)
        state = [slot.get() for slot in self._state_slots] if self._state_slots else ()
        key, leaves = self._guard.key(args, kwargs, state)
        stats = self._stats
        stats.calls += 1
        entry = self._cache.get(key)
        if entry is None:
            stats.cache_misses += 1
            self._explain_miss(args, kwargs)
            entry = self._compile(args, kwargs)
            self._cache[key] = entry
        else:
            stats.cache_hits += 1
        if entry.mutated_inputs:  # in-place updates of inputs: they must not alias each other
            check_no_input_aliasing([*[leaves[i] for i in entry.tensor_positions], *state,
                                     *entry.captured], entry.mutated_inputs)
        if entry.all_leaves_are_inputs:
            out = entry.fn(*leaves, *state, *entry.captured)
        else:
            out = entry.fn(*[leaves[i] for i in entry.tensor_positions], *state, *entry.captured)
        if entry.output_spec is not None:
            out = pytree.tree_unflatten(list(out), entry.output_spec)
        if entry.grad_specs is not None:
            out = _restructure_grads(out, entry.grad_specs, self._grad_argnums)
        return out

    def _explain_miss(self, args: tuple, kwargs: dict) -> None:
        """Record (and log to `fulmen.recompiles`) why this call missed the cache."""
        target = self._module.forward if self._module is not None else self._fn
        names = [name for name, _ in self._module.named_modules()] if self._module else []
        described = describe_call(_positional_names(target), args, kwargs,
                                  self._guard.modules, names, self._guard.scalar_sources)
        if self._last_described is not None:
            reasons = explain_change(self._last_described, described)
            self._stats.recompile_reasons.append(reasons)
            _RECOMPILES.info("retracing %s: %s", getattr(target, "__qualname__", target),
                             "; ".join(reasons))
        self._last_described = described

    def _compile(self, args: tuple, kwargs: dict) -> CacheEntry:
        seconds: dict[str, float] = {}
        rng_state = torch.random.get_rng_state()
        try:
            program = trace_program(self._fn, args, kwargs, module=self._module)
        except FulmenError as error:
            raise _with_examine_report(error, self._module or self._fn, args, kwargs) from None
        with torch._C.DisableTorchFunction():  # also when compiling inside another trace
            reseeded = not torch.equal(rng_state, torch.random.get_rng_state())
        if reseeded:
            # tracing draws no random numbers, so the code reseeded or set the generator
            torch.random.set_rng_state(rng_state)
            raise NotYetSupportedError(
                "the function sets torch's random state (torch.manual_seed, set_rng_state, ...) "
                "while it runs; a compiled function would not repeat that on later calls",
                op="torch.manual_seed", hint="seed outside the compiled function")
        seconds["tracing"] = program.seconds
        traces = [program.trace]
        backward_traces: list[Trace] = []

        def run(stages: list[Trace], stage, *extra) -> None:
            result = stage(stages[-1], *extra)
            if result is not stages[-1]:
                label = f"{result.provenance.removeprefix('after ')}"
                _PASSES.info("%s: %.2f ms", label, result.seconds * 1e3)
                seconds[label if stages is traces else f"{label} (backward)"] = result.seconds
                stages.append(result)

        run(traces, dce)
        for user_transform in self._transforms:
            run(traces, user_transform)
        grad_specs = None
        if self._grad_argnums is not None:
            wrt, grad_specs = _grad_inputs(program, args, kwargs, self._grad_argnums)
            run(traces, value_and_grad_trace, wrt)
        needs_grad = (self._grad_argnums is None and torch.is_grad_enabled()
                      and any(p.requires_grad for p in traces[-1].args))
        if needs_grad:
            start = time.perf_counter()
            split = split_forward_backward(traces[-1])
            seconds["autodiff"] = time.perf_counter() - start
            traces.append(split.forward.replace(provenance="after autodiff (forward)",
                                                seconds=seconds["autodiff"]))
            backward_traces.append(split.backward)
            if self._rematerialize:
                start = time.perf_counter()
                split = rematerialize(split)
                if split.forward is not traces[-1]:
                    traces.append(split.forward)
                    backward_traces.append(split.backward)
                seconds["rematerialization"] = time.perf_counter() - start
            run(backward_traces, dce)
            run(backward_traces, claim_executors, self._executors)
            run(backward_traces, delete_last_used)
        run(traces, claim_executors, self._executors)
        run(traces, delete_last_used)

        start = time.perf_counter()
        fn = traces[-1].python_callable()
        if needs_grad:
            residuals = traces[-1].output[1]
            pair = CompiledPair(fn, backward_traces[-1].python_callable(),
                                split.differentiable_outputs,
                                any(not isinstance(r, torch.Tensor) for r in residuals))
            fn = functools.partial(_call_with_autograd, pair, split.output_spec)
        seconds["python compilation"] = time.perf_counter() - start
        self._stats.last_traces = traces
        self._stats.last_backward_traces = backward_traces
        self._stats.stage_seconds = seconds
        return CacheEntry(fn, traces, program.tensor_positions, program.captured,
                          program.output_spec, seconds, grad_specs=grad_specs,
                          mutated_inputs=program.mutated_inputs,
                          all_leaves_are_inputs=not kwargs and len(program.tensor_positions) == len(args)
                          and all(isinstance(a, torch.Tensor) for a in args))


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


def _call_with_autograd(pair: CompiledPair, output_spec, *inputs):
    outputs = run_with_autograd(pair, inputs)
    if output_spec.is_leaf():
        return outputs[0]
    return pytree.tree_unflatten(list(outputs), output_spec)


class JittedFunction(_Jitted):
    """A function compiled by `fulmen.jit`; call it like the original."""

    def __init__(self, fn: Callable, executors=None, transforms=None, grad_argnums=None,
                 rematerialize: bool = True) -> None:
        self._setup(fn, None, executors, transforms, grad_argnums, rematerialize)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self._call(args, kwargs)

    def __get__(self, instance, owner=None):
        """Jitted functions defined in a class body become bound methods."""
        return self if instance is None else functools.partial(self.__call__, instance)


class JittedModule(torch.nn.Module):
    """An `nn.Module` compiled by `fulmen.jit`.

    It holds the original module as `_orig_mod` and shares its parameters and buffers, so
    `jmodel.parameters()`, optimizers and `state_dict()` see the very same tensors.
    """

    def __init__(self, module: torch.nn.Module, executors=None, transforms=None,
                 rematerialize: bool = True) -> None:
        super().__init__()
        self._orig_mod = module
        self._jit = _Jitted()
        self._jit._setup(module, module, executors, transforms, rematerialize=rematerialize)

    def forward(self, *args, **kwargs):
        return self._jit._call(args, kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_orig_mod"], name)


def jit(
    fn: Callable | torch.nn.Module,
    *,
    executors: Sequence[Executor | str] | None = None,
    transforms: Sequence[Callable[[Trace], Trace]] | None = None,
    rematerialize: bool = True,
) -> JittedFunction | JittedModule:
    """Compile a function or `nn.Module` with fulmen.

    Args:
        fn: a function of tensors, Python numbers and nested tuples/lists/dicts of them, or an
            `nn.Module` (its parameters and buffers become trace inputs).
        executors: priority list of executors (objects or names); `"torch"` is appended if
            missing. Defaults to `fulmen.get_default_executors()`.
        transforms: extra passes `Trace -> Trace`, applied after dce and before executors claim.
        rematerialize: when training, choose the values saved for backward by a minimum cut and
            recompute the rest in the backward (`fulmen.transforms.remat`).

    Returns:
        A callable with the same signature; for modules, an `nn.Module` sharing its parameters.

    Raises:
        FulmenError: at call time, when the function cannot be traced; the message names the op
            and the user's source line.

    Example:
        >>> jfn = fulmen.jit(lambda x: torch.nn.functional.gelu(x) * 2)
        >>> jfn(torch.randn(4))
    """
    if isinstance(fn, torch.nn.Module):
        return JittedModule(fn, executors, transforms, rematerialize)
    return JittedFunction(fn, executors, transforms, rematerialize=rematerialize)


def _jitted(jfn) -> _Jitted:
    if isinstance(jfn, JittedModule):
        return jfn._jit
    if isinstance(jfn, _Jitted):
        return jfn
    raise TypeError(f"{jfn!r} is not a function or module returned by fulmen.jit")


def last_traces(jfn) -> list[Trace]:
    """Every trace of the last compilation, in order: traced, then after each pass."""
    return list(_jitted(jfn)._stats.last_traces)


def last_backward_traces(jfn) -> list[Trace]:
    """The backward traces of the last compilation (empty when no input required grad)."""
    return list(_jitted(jfn)._stats.last_backward_traces)


def cache_hits(jfn) -> int:
    """How many calls of `jfn` ran a cached compilation."""
    return _jitted(jfn)._stats.cache_hits


def cache_misses(jfn) -> int:
    """How many calls of `jfn` had to trace and compile."""
    return _jitted(jfn)._stats.cache_misses


def compile_stats(jfn) -> CompileStats:
    """Call counters and seconds per stage of the last compilation."""
    return _jitted(jfn)._stats
