"""Opaque ops run inside `torch.autocast`: for ops autocast reaches inside.

NOTE [autocast inside an op]: autocast casts the arguments of the ops on its lists (`linear`,
`matmul`, ...) as they are dispatched, also when a composite op calls them: `torch.gru`'s CPU
kernel calls `linear` at each step, `F.multi_head_attention_forward` slices its packed weight and
projects each slice, `torch.einsum` reshapes its operands and calls `bmm`. Casting the composite
op's arguments cannot reproduce that (the tensors cast are made inside it), so such a call is
recorded with the symbol made here: it runs the op whole inside `torch.autocast(device_type,
dtype=dtype)`, as eager does, and its meta runs the op on fake tensors of the argument's device
(meta tensors carry no autocast dispatch key); where that fails (a packed-sequence RNN reads
`batch_sizes`' values), the call takes a graph break and runs on the real values, inside
autocast too. Its gradient is torch.autograd's of that call,
recorded under the same autocast state, so values, dtypes and gradients are eager's. Compiled
traces run with autocast disabled (`fulmen.core.ambient`); entering `torch.autocast` inside
re-enables it for this call only. `fulmen.tracer.autocast` decides which calls need it.

The cast cache is the region's too: with it, eager casts a weight that is a leaf once for all
the steps of an RNN, and its bfloat16 gradients add up before the cast back to float32
(without it, each step's gradient is cast back, then added: other roundings). A cached cast
outlives its region until the outermost one exits, so the call clears the cache after it: the
casts cached were of the call's own (detached) arguments, and an eager op of the caller's
region that needs a cast again casts again, to the same value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from fulmen.core import FulmenError, Symbol
from fulmen.core.source import user_source_location
from fulmen.ops.meta import fake_run, first_device, from_meta
from fulmen.ops.opaque import (
    _BY_NAME,
    _OPAQUE,
    _VALUE_READERS,
    OPAQUE_NAMESPACE,
    _is_random,
    opaque_name,
)

_RUNS: dict[tuple, Callable] = {}


def under_autocast(fn: Callable, device_type: str, dtype: torch.dtype,
                   cache_enabled: bool = True) -> Callable:
    """`fn` made to run inside `torch.autocast(device_type, dtype=dtype, cache_enabled=...)`;
    the callable is registered with its opaque symbol (`opaque_symbol(under_autocast(...))`).

    Example:
        >>> run = under_autocast(torch.gru, "cpu", torch.bfloat16)
        >>> opaque_symbol(run).name
        'gru_autocast_cpu_bfloat16'
    """
    key = (fn, device_type, dtype, cache_enabled)
    run = _RUNS.get(key)
    if run is not None:
        return run

    def run(*args, **kwargs):
        try:
            with torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled):
                return fn(*args, **kwargs)
        finally:
            if cache_enabled:
                torch.clear_autocast_cache()  # see the module docstring

    run.__name__ = getattr(fn, "__name__", "op")  # `_is_random` reads it: a dropout stays random
    run.__qualname__ = f"under_autocast({getattr(fn, '__qualname__', run.__name__)})"
    name = f"{opaque_name(fn)}_autocast_{device_type}_{str(dtype).removeprefix('torch.')}"
    if not cache_enabled:
        name += "_uncached"
    while name in _BY_NAME:
        name += "_"

    def meta(*args, **kwargs):
        try:
            if fn in _VALUE_READERS:  # a packed-sequence RNN: refused before any fake run
                _VALUE_READERS[fn](_no_outputs, *args, **kwargs)
            return _fake_call(run, args, kwargs)
        except FulmenError:
            raise
        except Exception as error:
            raise FulmenError(
                f"PyTorch cannot describe this op's output under torch.autocast: {error}",
                op=name, where=user_source_location(),
                hint="move the op out of the autocast region, or cast its inputs explicitly",
            ) from error

    tags = {"opaque", "random"} if _is_random(fn) else {"opaque"}
    _OPAQUE[run] = _BY_NAME[name] = Symbol(name, meta, namespace=OPAQUE_NAMESPACE, impl=run,
                                           torch_fn=run, tags=tags)
    _RUNS[key] = run
    return run


def _no_outputs(*args, **kwargs) -> None:
    """Stands for the op where a value reader's check is wanted, not its meta kernel."""


def _fake_call(fn: Callable, args: tuple, kwargs: dict):
    """`fn` run on fake tensors of the arguments' devices (so autocast applies); proxies for
    its tensor outputs, with the strides the kernel chose (outside inference mode, as
    `fulmen.tracer.autocast`'s runs)."""
    device = first_device(args, kwargs)
    with fake_run():

        def fake(leaf):
            if not isinstance(leaf, torch.Tensor):
                return leaf
            return torch.empty_strided(tuple(leaf.shape), tuple(leaf.stride()),
                                       dtype=leaf.dtype, device=leaf.device)

        fake_args, fake_kwargs = pytree.tree_map(fake, (args, kwargs))
        out = fn(*fake_args, **fake_kwargs)
    return from_meta(out, device)


__all__ = ["under_autocast"]
