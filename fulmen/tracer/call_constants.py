"""Tensors the traced function makes from data that no torch function sees.

NOTE [tensors made during the call]: `torch.from_numpy(np.ones(3))`, `torch.frombuffer(...)`
and `torch.Tensor([1.0, 2.0])` reach no `TorchFunctionMode`, so the tracer meets their result
as a real tensor and captures it like a global (`TracerCtx.capture`). In eager each call makes a
new one; a trace that mutates or returns the captured tensor would update and hand out the same
tensor on every call (`make().add_(x)` drifting from call to call). Such a tensor is found when
tracing ends: nothing outside the tracer refers to it (a global is held by its namespace, a
closure variable by its cell, an attribute by its object's `__dict__`, an element by its
container), by `gc.get_referrers`, and its memory is the call's own: torch's (a resizable
storage), or, for a tensor `torch.from_numpy`/`torch.frombuffer` made while tracing (recorded
by `foreign_memory_recorded`, which wraps the two while a trace records), an array or buffer
that nothing outside the tracer refers to either, nor to the arrays it is a view of
(`torch.from_numpy(np.ones(3))`; not `torch.from_numpy(GLOBAL_ARRAY)` or an array argument,
whose memory eager updates). The runtime then passes a copy of its value at capture time on
each call (`CacheEntry.captured_now`), as eager makes it anew. A tensor the tracer cannot tell
apart stays a global (the behaviour before), so an update of a real global is never lost.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import types
from collections.abc import Iterable, Sequence

import torch

from fulmen.core import get_tracectx
from fulmen.tracer.patching import TracingPatch


def made_during_the_call(tensors: Sequence[torch.Tensor], candidates: Iterable[int],
                         internal: Sequence[object],
                         foreign: dict | None = None) -> tuple[int, ...]:
    """The indices among `candidates` (into `tensors`, the captured tensors) of those over the
    call's own memory that nothing but the tracer refers to: the containers in `internal` (the
    tracer's own tables) and frames (the tracer's and the finished call's locals) are not
    counted. `foreign` (id of a tensor -> `(tensor, source)`, from `foreign_memory_recorded`)
    names the array or buffer under each tensor `torch.from_numpy`/`frombuffer` made.

    Costs a scan of the collector's objects per candidate (tens of milliseconds in a large
    process), so `candidates` are only the captured tensors a trace mutates or returns."""
    foreign = foreign or {}
    internal_ids = {id(container) for container in (*internal, *foreign.values())}
    internal_ids.update((id(tensors), id(foreign)))
    found = []
    for index in sorted(set(candidates)):
        if not tensors[index].untyped_storage().resizable():  # NumPy's or a buffer's memory
            made = foreign.get(id(tensors[index]))
            if made is None or made[0] is not tensors[index] \
                    or not _memory_is_the_calls(made[1], internal_ids):
                continue
        if all(id(r) in internal_ids or isinstance(r, types.FrameType)
               for r in gc.get_referrers(tensors[index])):
            found.append(index)
    return tuple(found)


def _memory_is_the_calls(source, internal_ids: set[int]) -> bool:
    """Whether the array or buffer `source` (and every array it is a view of, down to the
    object that owns the memory) is referred to by nothing outside the tracer: a NumPy array or
    a `bytes`/`bytearray` the call made. Anything else (an array over a tensor's memory, a
    memory map, an object of an unknown kind) is not the call's."""
    numpy = sys.modules.get("numpy")
    obj = source
    while True:
        if not all(id(referrer) in internal_ids for referrer in gc.get_referrers(obj)):
            return False
        if numpy is not None and isinstance(obj, numpy.ndarray):
            if obj.base is None:
                return True
            obj = obj.base
        elif isinstance(obj, memoryview):
            obj = obj.obj
        else:
            return type(obj) in (bytes, bytearray)


_FOREIGN_FACTORIES = ("from_numpy", "frombuffer")


def _recording(original):
    @functools.wraps(original)
    def factory(*args, **kwargs):
        tensor = original(*args, **kwargs)
        sources = getattr(get_tracectx(), "foreign_sources", None)
        source = args[0] if args else kwargs.get("buffer")
        if sources is not None and source is not None:
            sources[id(tensor)] = (tensor, source)
        return tensor
    return factory


_FOREIGN_PATCH = TracingPatch(*[(torch, name, _recording(getattr(torch, name)))
                                for name in _FOREIGN_FACTORIES])


def foreign_memory_recorded() -> contextlib.AbstractContextManager:
    """While active, `torch.from_numpy` and `torch.frombuffer` called with a trace recording
    (one whose context has a `foreign_sources` dict) record each tensor they make and the array
    or buffer under it there (NOTE [tensors made during the call]); elsewhere, and in other
    threads, they behave as torch's own (`TracingPatch`: nested uses share the replacement)."""
    return _FOREIGN_PATCH.held()


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over a copy of `tensor`'s storage with its sizes, strides and offset (an
    expanded tensor stays self-overlapping, so an in-place op on it raises as eager's would;
    `clone()` would make it contiguous); an `nn.Parameter` (`nn.Parameter(torch.Tensor(3))`
    made by the call) stays one."""
    copy = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage().clone(), tensor.storage_offset(), tensor.size(), tensor.stride())
    if type(tensor) is torch.nn.Parameter:
        return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy.requires_grad_(tensor.requires_grad)
