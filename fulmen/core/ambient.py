"""Ambient autocast state: its cache-key form, and running compiled traces without it.

Casts that `torch.autocast` applies while a function is traced are recorded in the trace as
explicit conversions (`fulmen.tracer.autocast`), so an execution trace is complete as it stands.
If it ran under the caller's autocast, torch would cast again: a matmul the trace computes in
float32 (inside the user's `autocast(enabled=False)` region) would come back as bfloat16, and
a fused kernel built for float32 would read the wrong bytes. So compiled forward and backward
traces run with autocast disabled on every device (`without_autocast`); the ambient state at
the call is part of the cache key instead (`autocast_key`), so a different state retraces.

Both cost one `torch._C._is_any_autocast_enabled()` check when autocast is off.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

# device types torch.autocast accepts
AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu",
                    "privateuseone")
_any_autocast = torch._C._is_any_autocast_enabled
_is_enabled = torch.is_autocast_enabled
_DisableAutocast = torch._C._DisableAutocast
_get_dtype = torch.get_autocast_dtype
_cache_enabled = torch.is_autocast_cache_enabled


def autocast_key() -> tuple:
    """`()` when autocast is off; else `((device, dtype), ...)` for each device with autocast
    enabled (the dtype matters: bfloat16 and float16 regions trace differently), then
    `"no cast cache"` for a region entered with `cache_enabled=False` (an op run inside
    autocast, `fulmen.ops.opaque_autocast`, caches casts as the region does)."""
    if not _any_autocast():
        return ()
    key = tuple([(device, _get_dtype(device)) for device in AUTOCAST_DEVICES
                 if _is_enabled(device)])
    return key if _cache_enabled() else (*key, "no cast cache")


@contextlib.contextmanager
def without_cast_cache() -> Iterator[None]:
    """Autocast's cast cache off, for a run on fake tensors while tracing: autocast caches the
    cast of a real leaf tensor requiring grad (a module's weight, read by a custom
    `autograd.Function` run on fake tensors) until the outermost region exits, and a fake cast
    cached there was what the compiled call's own casts of that weight returned (its outputs
    were fake tensors, without values)."""
    was = _cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


def run_without_autocast(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` with autocast disabled on every device, restored afterwards."""
    if not _any_autocast():
        return fn(*args)
    with _DisableAutocast():  # excludes every autocast dispatch key, as torch's own compilers do
        return fn(*args)


def without_autocast(fn: Callable) -> Callable:
    """`fn` made to run with autocast disabled (see the module docstring).

    Example:
        >>> compiled = without_autocast(trace.python_callable())
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     compiled(x)  # runs exactly the casts the trace records, no others
    """

    @functools.wraps(fn)
    def run(*args):
        if not _any_autocast():
            return fn(*args)
        with _DisableAutocast():
            return fn(*args)

    return run


__all__ = ["AUTOCAST_DEVICES", "autocast_key", "run_without_autocast", "without_autocast",
           "without_cast_cache"]
