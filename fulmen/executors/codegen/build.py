"""Building kernels, for every target: when they compile, the threads that compile them, and
the keys of their builds.

`policy` says when a region's kernel is built (`set_compile_policy`, or the environment
variables `FULMEN_CODEGEN_COMPILE` and `FULMEN_CODEGEN_HOT_CALLS`; see `cpu/runtime.py`).
`submit` runs a build on the compile threads; builds are shared by key, so identical regions
(repeated layers) build their kernel once even while the first build is still running.
`digest(*parts)` names a disk-cache entry (`cache.py`) after everything its object depends on
(source, options, toolchain).

The CPU runtime, its output pool and the CUDA compiler build through here; this module imports
nothing else of codegen.

NOTE [fork]: a child made by `fork()` has only the thread that forked, so the parent's compile
threads do not exist in it, and a build running in the parent never finishes in the child. After
a fork the child gets a fresh thread pool and forgets the builds that were unfinished; whoever
asks for one again (`submit` with the same key) starts it anew in the child.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from fulmen import config


@dataclass
class CompilePolicy:
    """When kernels compile (see `cpu/runtime.py`): `mode` "lazy" or "eager"; in lazy mode a
    region's kernel starts compiling at its `hot_calls`-th call."""

    mode: str = "lazy"
    hot_calls: int = 3


policy = CompilePolicy(config.get("FULMEN_CODEGEN_COMPILE"),
                       config.get("FULMEN_CODEGEN_HOT_CALLS"))


def set_compile_policy(mode: str | None = None, hot_calls: int | None = None) -> CompilePolicy:
    """Set when the codegen executor compiles kernels; returns the previous policy.

    Args:
        mode: "lazy" (torch runs a region until it is hot and its kernel is compiled in the
            background) or "eager" (compile when fused, the first call waits).
        hot_calls: in lazy mode, the call of a region that starts its compile (>= 1).

    Raises:
        ValueError: an unknown mode or hot_calls < 1.

    Example:
        >>> previous = set_compile_policy("eager")
    """
    previous = CompilePolicy(policy.mode, policy.hot_calls)
    if mode is not None:
        if mode not in ("lazy", "eager"):
            raise ValueError(f"codegen compile mode must be 'lazy' or 'eager', got {mode!r}")
        policy.mode = mode
    if hot_calls is not None:
        if hot_calls < 1:
            raise ValueError(f"hot_calls must be at least 1, got {hot_calls}")
        policy.hot_calls = hot_calls
    return previous


def digest(*parts: str) -> str:
    """The disk-cache entry name of a build that depends on `parts` (32 hex digits).

    Example:
        >>> digest(source, " ".join(flags), toolchain)
        '5f0c...'
    """
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _new_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, min(8, torch.get_num_threads())),
                              thread_name_prefix="fulmen-compile")


_pool = _new_pool()
_jobs: dict[Hashable, Future] = {}
_lock = threading.Lock()


def submit(key: Hashable, fn: Callable, *args) -> Future:
    """The future of `fn(*args)` run on the compile threads, shared by every caller with the
    same `key` until it finishes (a failed one is started again by the next caller).

    Example:
        >>> submit(("kernel", source), build.load_kernel, source).result()
    """
    with _lock:
        future = _jobs.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = _jobs[key] = _pool.submit(fn, *args)
    return future


def _after_fork_in_child() -> None:
    """See NOTE [fork]: new threads, a new lock, and no unfinished builds of the parent."""
    global _pool, _lock
    _pool = _new_pool()
    _lock = threading.Lock()
    for key, future in list(_jobs.items()):
        if not future.done():
            del _jobs[key]


if hasattr(os, "register_at_fork"):  # POSIX only (no fork on Windows)
    os.register_at_fork(after_in_child=_after_fork_in_child)
