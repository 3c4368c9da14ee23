"""Tensors the traced function makes from data that no torch function sees.

NOTE [tensors made during the call]: `torch.from_numpy(np.ones(3))`, `torch.frombuffer(...)`
and `torch.Tensor([1.0, 2.0])` reach no `TorchFunctionMode`, so the tracer meets their result
as a real tensor and captures it like a global (`TracerCtx.capture`). In eager each call makes a
new one; a trace that mutates or returns the captured tensor would update and hand out the same
tensor on every call (`make().add_(x)` drifting from call to call). Such a tensor is found when
tracing ends: nothing outside the tracer refers to it (a global is held by its namespace, a
closure variable by its cell, an attribute by its object's `__dict__`, an element by its
container), by `gc.get_referrers`, and its memory is torch's own (a resizable storage: not
NumPy's or a buffer's memory, which `torch.from_numpy(GLOBAL_ARRAY)` shares with a global).
The runtime then passes a copy of its value at capture time on each call
(`CacheEntry.captured_now`), as eager makes it anew. A tensor the tracer cannot tell apart stays
a global (the behaviour before), so an update of a real global is never lost; so does one over
memory torch does not own (a fresh NumPy array's still drifts).
"""

from __future__ import annotations

import gc
import types
from collections.abc import Iterable, Sequence

import torch


def made_during_the_call(tensors: Sequence[torch.Tensor], candidates: Iterable[int],
                         internal: Sequence[object]) -> tuple[int, ...]:
    """The indices among `candidates` (into `tensors`, the captured tensors) of those over
    torch's own memory that nothing but the tracer refers to: the containers in `internal` (the tracer's own tables) and
    frames (the tracer's and the finished call's locals) are not counted.

    Costs a scan of the collector's objects per candidate (tens of milliseconds in a large
    process), so `candidates` are only the captured tensors a trace mutates or returns."""
    internal_ids = {id(container) for container in internal}
    internal_ids.add(id(tensors))
    found = []
    for index in sorted(set(candidates)):
        if not tensors[index].untyped_storage().resizable():  # NumPy's or a buffer's memory
            continue
        if all(id(r) in internal_ids or isinstance(r, types.FrameType)
               for r in gc.get_referrers(tensors[index])):
            found.append(index)
    return tuple(found)


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over a copy of `tensor`'s storage with its sizes, strides and offset (an
    expanded tensor stays self-overlapping, so an in-place op on it raises as eager's would;
    `clone()` would make it contiguous)."""
    copy = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage().clone(), tensor.storage_offset(), tensor.size(), tensor.stride())
    return copy.requires_grad_(tensor.requires_grad)
