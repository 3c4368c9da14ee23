"""The user API: `jit`, `last_traces`, cache statistics and `compile_stats`.

    jfn = fulmen.jit(fn)              # or fulmen.jit(model)
    out = jfn(x, w)                   # traces, transforms, claims, compiles; then cached
    fulmen.last_traces(jfn)           # every stage, in order, each printable and runnable

Each call computes a cache key (see `fulmen.tracer.guards`); a hit runs the cached compiled
callable, a miss traces and compiles anew.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from fulmen.cache_entry import CompileStats
from fulmen.core import NotYetSupportedError, Trace
from fulmen.executors import Executor
from fulmen.jitted import _Jitted
from fulmen.wrappers import JittedDDP, JittedFunction, JittedModule, _fsdp_sharded


def jit(
    fn: Callable | torch.nn.Module,
    *,
    executors: Sequence[Executor | str] | None = None,
    transforms: Sequence[Callable[[Trace], Trace]] | None = None,
    rematerialize: bool = True,
    fullgraph: bool = False,
    cache_size_limit: int | None = None,
    dynamic: bool | None = None,
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
        fullgraph: raise when the program needs a tensor's value in Python (`if t.any():`,
            `.item()`, `nonzero`) instead of splitting it there into segments joined by a
            guard (a graph break; see `fulmen.tree`).
        cache_size_limit: how many compiled specialisations (shapes, dtypes, guarded values)
            one function keeps per call structure (NOTE [cache limits per call structure] in
            `fulmen.cache_policy`; `FULMEN_ACCUMULATED_CACHE_SIZE_LIMIT`, 64, caps all
            structures together); a call matching none of them once the limit is reached runs
            eagerly, with one warning naming the guard that kept failing. Default
            `FULMEN_CACHE_SIZE_LIMIT` or 8 (torch.compile's default).
        dynamic: symbolic sizes (`fulmen.tracer.shape_policy`): None compiles the first call
            for its shapes and traces the dimensions that change in later calls symbolically
            once; True makes every dimension symbolic from the start; False never.
            `fulmen.mark_dynamic` / `mark_static` override it per argument dimension. The
            default can be set with `FULMEN_DYNAMIC=1` (True) or `0` (False);
            `FULMEN_DYNAMIC=strict` is True and raises where a symbolic trace fails instead of
            compiling for the call's shapes (for conformance runs).

    Returns:
        A callable with the same signature; for modules, an `nn.Module` sharing its parameters.

    Raises:
        FulmenError: at call time, when the function cannot be traced; the message names the op
            and the user's source line.

    Example:
        >>> jfn = fulmen.jit(lambda x: torch.nn.functional.gelu(x) * 2)
        >>> jfn(torch.randn(4))
    """
    if isinstance(fn, torch.nn.parallel.DistributedDataParallel):
        return JittedDDP(fn, executors, transforms, rematerialize, fullgraph, cache_size_limit,
                         dynamic)
    if isinstance(fn, torch.nn.Module) and _fsdp_sharded(fn):
        raise NotYetSupportedError(
            "fulmen.jit of a module sharded with FSDP2 (fully_shard): its hooks gather and free "
            "the parameters around every call, which a compiled call would not repeat",
            op="fulmen.jit", argument="fn", hint="shard compiled blocks instead: "
            "fully_shard(fulmen.jit(block)) for each block, then fully_shard(model)")
    if isinstance(fn, torch.nn.Module):
        return JittedModule(fn, executors, transforms, rematerialize, fullgraph,
                            cache_size_limit, dynamic)
    return JittedFunction(_apply_looked_up_per_call(fn), executors, transforms,
                          rematerialize=rematerialize, fullgraph=fullgraph,
                          cache_size_limit=cache_size_limit, dynamic=dynamic)


def _apply_looked_up_per_call(fn: Callable) -> Callable:
    """`fulmen.jit(Fn.apply)` of a custom `autograd.Function`: `Fn.apply` was bound before any
    trace replaced it (`tracer/patching.py`), so the trace ran the Function's forward under
    its no_grad and the compiled output carried no gradient (silently: other grads summed
    without it). A function looking `Fn.apply` up at each call gets the replacement."""
    cls = getattr(fn, "__self__", None)
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)
            and getattr(fn, "__name__", None) == "apply"):
        return fn

    @functools.wraps(fn)
    def apply(*args, **kwargs):
        return cls.apply(*args, **kwargs)

    return apply


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
