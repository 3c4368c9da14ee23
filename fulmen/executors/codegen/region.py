"""What the callables behind codegen fusion symbols share, on every target.

A call of a fused region resolves each access of its kernel (`resolve`: the input's sizes and
strides pushed through the access's view chain: broadcast -> stride 0, permute, slice -> offset
and scaled stride, flip -> negative stride, reshape -> view strides), coalesces the iteration
space (`coalesce`), runs the kernel, and builds the region's outputs from the kernel's
(`region_results`: escaping views are applied with torch view ops).

`RegionCallable` holds the region and the fallback handed in by the executor: a function that
returns a callable running the region's own trace some other way (the torch executor). A kernel
reads raw memory, so inputs of other dtypes or devices than the kernel was built for
(`accepts`), a layout the runtime cannot pass (`Fallback`), or a kernel that cannot be built run
the fallback: never a crash, never a wrong result.

A region with symbolic sizes (`sizes.py`) is made concrete for each call (`bind`): the values of
its sizes are read from its inputs' shapes, and the region with those values (kept for the last
`bound_limit` distinct sizes, oldest dropped first) is what the call resolves and runs. Its
kernels do not depend on sizes, so one compiled kernel serves every size. A concrete region
holds its own accesses and view chains (tens of objects): a runtime that keeps what its calls
need in a plan of its own (the CPU runtime) keeps only a few, so that a sweep over many shapes
does not leave thousands of them for the garbage collector to walk.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fulmen.executors.codegen.ir import Access
from fulmen.executors.codegen.sizes import Binder, concrete, has_sym_sizes

__all__ = ["MAX_BOUND", "Fallback", "RegionCallable", "coalesce", "copy_base", "mask_tensor",
           "region_results", "resolve", "split_dims", "strided_views", "view_output"]

MAX_BOUND = 256  # concrete regions (or call plans) kept per region by default


class Fallback(Exception):
    """This call runs the region's fallback (its kernel cannot serve it, or is not ready)."""


def _view_strides(sizes, strides, new_sizes):
    """Strides that view (sizes, strides) as `new_sizes` without a copy, or None."""
    if math.prod(sizes) <= 1 or math.prod(new_sizes) == 0:
        return [0] * len(new_sizes)
    new_strides = [0] * len(new_sizes)
    view_d = len(new_sizes) - 1
    chunk_stride = strides[-1]
    tensor_numel = view_numel = 1
    for d in range(len(sizes) - 1, -1, -1):
        tensor_numel *= sizes[d]
        if d == 0 or (sizes[d - 1] != 1 and strides[d - 1] != tensor_numel * chunk_stride):
            while view_d >= 0 and (view_numel < tensor_numel or new_sizes[view_d] == 1):
                new_strides[view_d] = view_numel * chunk_stride
                view_numel *= new_sizes[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk_stride = strides[d - 1]
                tensor_numel = view_numel = 1
    return new_strides if view_d == -1 else None


def _merged_strides(sizes, strides, new_sizes):
    """Per dim of `new_sizes`, when the reshape of (sizes, strides) to it only merges dims:
    its stride, or for a merge no one stride expresses (a broadcast dim merged with another,
    as in a grouped-query attention `repeat_kv`) the merged dims' ((size, stride), ...) from
    outer to inner; None when the reshape also splits a dim."""
    old = [(size, stride) for size, stride in zip(sizes, strides) if size != 1]
    merged, i = [], 0
    for size in new_sizes:
        if size == 1:
            merged.append(0)
            continue
        group, numel = [], 1
        while numel < size and i < len(old):
            group.append(old[i])
            numel *= old[i][0]
            i += 1
        if numel != size:
            return None
        viewable = all(outer[1] == inner[0] * inner[1] for outer, inner in zip(group, group[1:]))
        merged.append(group[-1][1] if viewable else tuple(group))
    return merged if i == len(old) else None


class _NoSplit(Exception):
    """A view step after a merge `_merged_strides` split that the split cannot take."""


def resolve(tensor: torch.Tensor, access: Access, copies: list | None = None,
            split: bool = False):
    """(base tensor, element offset from its data_ptr, sizes, strides) of `access`.

    A reshape that no strides express copies its operand (`as_strided` of the chain so far,
    then `contiguous`); with `copies` given, each such copy's (sizes, strides, element offset
    from its source's storage offset) is appended to it, so that a later call with an input
    of the same sizes and strides can make the base by `copy_base` without the walk.

    With `split`, a reshape that only merges dims copies nothing: a merged dim's stride is
    then ((size, stride), ...) of the dims it merges (`_merged_strides`), which a caller
    that iterates that dim as those dims (`split_dims`) reads without a copy. When a later
    step of the chain cannot take such a dim, the access is resolved as without `split`."""
    if split:
        made = len(copies) if copies is not None else 0
        try:
            return _resolve(tensor, access, copies, True)
        except _NoSplit:
            if copies is not None:
                del copies[made:]  # the copies of the walk given up are made again below
    return _resolve(tensor, access, copies, False)


def split_dims(shape, rows):
    """The iteration space `shape` and stride `rows` (`resolve(..., split=True)`) with each
    dim that some row reads as merged dims iterated as those dims: other rows' strides over
    it split to match (stride s over sizes (a, b) -> (b * s, s)). Returns (sizes, rows) of
    ints, or None when two rows merge one dim from different sizes."""
    factors = [None] * len(shape)
    for row in rows:
        for d, stride in enumerate(row):
            if isinstance(stride, tuple):
                sizes = tuple(size for size, _ in stride)
                if factors[d] not in (None, sizes):
                    return None
                factors[d] = sizes
    new_shape = []
    for d, size in enumerate(shape):
        new_shape.extend(factors[d] or (size,))
    new_rows = []
    for row in rows:
        new_row = []
        for d, stride in enumerate(row):
            if isinstance(stride, tuple):
                new_row.extend(inner for _, inner in stride)
            elif factors[d] is None:
                new_row.append(stride)
            else:
                new_row.extend(stride * math.prod(factors[d][k + 1:])
                               for k in range(len(factors[d])))
        new_rows.append(new_row)
    return new_shape, new_rows


def _resolve(tensor: torch.Tensor, access: Access, copies: list | None, split: bool):
    offset = 0
    sizes, strides = list(tensor.shape), list(tensor.stride())
    for step in access.steps:
        params = step.params
        if step.name == "broadcast_in_dim":
            shape, dims = params
            new = [0] * len(shape)
            for i, d in enumerate(dims):
                new[d] = strides[i] if sizes[i] != 1 else 0
            sizes, strides = list(shape), new
        elif step.name == "permute":
            sizes = [sizes[d] for d in params[0]]
            strides = [strides[d] for d in params[0]]
        elif step.name == "slice":
            starts, ends, steps = params
            for d, (start, end, st) in enumerate(zip(starts, ends, steps)):
                if isinstance(strides[d], tuple):
                    if (start, end, st) != (0, sizes[d], 1):
                        raise _NoSplit
                    continue
                offset += start * strides[d]
                sizes[d] = (end - start + st - 1) // st
                strides[d] *= st
        elif step.name == "squeeze":
            keep = [d for d in range(len(sizes)) if d not in params[0]]
            sizes, strides = [sizes[d] for d in keep], [strides[d] for d in keep]
        elif step.name == "flip":
            if any(isinstance(strides[d], tuple) for d in params[0]):
                raise _NoSplit
            for d in params[0]:
                if sizes[d] > 0:
                    offset += (sizes[d] - 1) * strides[d]
                strides[d] = -strides[d]
        elif step.name == "shift":  # read at (point - offsets): only where a mask holds
            offsets, shape = params
            if any(isinstance(strides[d], tuple) for d in range(len(strides))):
                raise _NoSplit
            for d, lo in enumerate(offsets):
                offset -= lo * strides[d]
            sizes = list(shape)
        elif step.name == "reshape":
            if any(isinstance(stride, tuple) for stride in strides):
                raise _NoSplit
            new = _view_strides(sizes, strides, list(params[0]))
            if new is None and split:
                new = _merged_strides(sizes, strides, list(params[0]))
            if new is None:
                if any(s < 0 for s in strides):
                    raise Fallback
                if copies is not None:
                    copies.append((tuple(sizes), tuple(strides), offset))
                tensor = torch.as_strided(tensor, sizes, strides,
                                          tensor.storage_offset() + offset).contiguous()
                offset, strides = 0, list(tensor.stride())
                new = _view_strides(sizes, strides, list(params[0]))
            sizes, strides = list(params[0]), new
        else:
            raise Fallback
    return tensor, offset, sizes, strides


def copy_base(tensor: torch.Tensor, copies) -> torch.Tensor:
    """The base `resolve` gives for an input of the sizes and strides `copies` was recorded
    for (`resolve(..., copies)`): the same copies, made from `tensor` with no walk."""
    for sizes, strides, offset in copies:
        tensor = tensor.as_strided(sizes, strides, tensor.storage_offset() + offset).contiguous()
    return tensor


_MASKS: dict[tuple, torch.Tensor] = {}


def mask_tensor(access: Access, device=None) -> tuple[torch.Tensor, list[int]]:
    """The bool vector of a mask access (`ir.MASK_INPUT`; concrete sizes) and its strides
    over the iteration space: along `dim`, True at `start <= i < start + length`."""
    dim, start, length, shape = access.steps[0].params
    key = (shape[dim], start, length, device)
    mask = _MASKS.get(key)
    if mask is None:
        if len(_MASKS) >= MAX_BOUND:
            _MASKS.clear()
        index = torch.arange(shape[dim], device=device)
        mask = _MASKS[key] = (index >= start) & (index < start + length)
    strides = [0] * len(shape)
    strides[dim] = 1
    return mask, strides


def view_output(tensor: torch.Tensor, access: Access) -> torch.Tensor:
    """Apply the access's view chain to `tensor` with torch view ops (an escaping view)."""
    for step in access.steps:
        params = step.params
        if step.name == "broadcast_in_dim":
            shape, dims = params
            view = [1] * len(shape)
            for i, d in enumerate(dims):
                view[d] = tensor.shape[i]
            tensor = tensor.reshape(view).expand(shape)
        elif step.name == "permute":
            tensor = tensor.permute(params[0])
        elif step.name == "slice":
            tensor = tensor[tuple(slice(*bounds) for bounds in zip(*params))]
        elif step.name == "squeeze":
            tensor = tensor.squeeze(tuple(params[0])) if params[0] else tensor
        elif step.name == "flip":
            tensor = tensor.flip(params[0])
        else:
            tensor = tensor.reshape(params[0])
    return tensor


def region_results(lowered, inputs, outs, plans=None):
    """A region's outputs from its kernel's outputs `outs`, by the lowering's plan (or `plans`,
    from `strided_views`, used when not None): per output ("kernel", k), ("view", access) of an input,
    ("rowview", k, access) of kernel output k, or ("strided", i, sizes, strides, offset)."""
    results = []
    for plan in lowered.outputs if plans is None else plans:
        if plan[0] == "kernel":
            results.append(outs[plan[1]])
        elif plan[0] == "strided":
            _, i, sizes, strides, offset = plan
            tensor = inputs[i]
            results.append(tensor.as_strided(sizes, strides, tensor.storage_offset() + offset))
        elif plan[0] == "rowview":
            results.append(view_output(outs[plan[1]], plan[2]))
        else:
            results.append(view_output(inputs[plan[1].input], plan[1]))
    return results[0] if len(results) == 1 else tuple(results)


def strided_views(lowered, inputs) -> tuple:
    """The output plans of `lowered` for inputs of these shapes and strides: each escaping
    view of an input that its chain of view ops takes without a copy becomes ("strided", input,
    sizes, strides, offset from the input's), the very view the chain gives (taken once, here),
    then made by one `as_strided` call per region call instead of the chain's ops."""
    plans = []
    for plan in lowered.outputs:
        if plan[0] == "view":
            tensor = inputs[plan[1].input]
            view = view_output(tensor, plan[1])
            if view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() \
                    and view.dtype == tensor.dtype:
                plan = ("strided", plan[1].input, tuple(view.shape), tuple(view.stride()),
                        view.storage_offset() - tensor.storage_offset())
        plans.append(plan)
    return tuple(plans)


def coalesce(shape, rows):
    """Drop size-1 dims and merge dims contiguous for every stride row; returns new (sizes, rows)."""
    dims = [d for d, size in enumerate(shape) if size != 1]
    sizes = [shape[d] for d in dims]
    rows = [[row[d] for d in dims] for row in rows]
    if not sizes:
        return [1], [[0] for _ in rows]
    d = len(sizes) - 2
    while d >= 0:
        if all(row[d] == row[d + 1] * sizes[d + 1] for row in rows):
            sizes[d + 1] *= sizes[d]
            del sizes[d]
            for row in rows:
                del row[d]
        d -= 1
    return sizes, rows


class RegionCallable:
    """What the callables behind fusion symbols share: the region (a `LoweredRegion` or
    `LoweredRows`), and `fallback()`, which makes the callable that runs the region when its
    kernel cannot (see the module docstring).

    Raises:
        Unsupported: the region has symbolic sizes that its inputs' shapes do not determine.
    """

    bound_limit = MAX_BOUND  # concrete regions kept (`bind`)

    def __init__(self, name: str, lowered, fallback: Callable[[], Callable]) -> None:
        self.name = name
        self.lowered = lowered
        self.kernel = lowered.kernel
        parts = (lowered.shape, lowered.kernel.accesses, lowered.outputs)
        self.binder = Binder(lowered) if has_sym_sizes(parts) else None
        self._bound: dict[tuple, object] = {}
        self.fallback = fallback
        self.input_types = tuple(_input_type(proxy) for proxy in lowered.inputs)
        self._fallback = None
        self.failed = False

    def accepts(self, inputs) -> bool:
        """Whether every input has the dtype and device the kernel was built for. A kernel
        reads raw memory: a bfloat16 buffer handed to a float32 kernel would be read as float32
        (garbage), so a region called with other types runs its torch fallback instead; so
        does one called with a tensor whose negative bit is set (`z.conj().imag`: torch negates
        its values when it reads them, the raw memory holds them unnegated)."""
        if len(inputs) != len(self.input_types):
            return False
        for tensor, expected in zip(inputs, self.input_types):
            if expected is not None and (not isinstance(tensor, torch.Tensor)
                                         or (tensor.dtype, tensor.device) != expected
                                         or tensor.is_neg()):
                return False
        return True

    def bind(self, inputs):
        """The region with the sizes of this call (`self.lowered` when it has no symbolic
        sizes)."""
        if self.binder is None:
            return self.lowered
        values = self.binder(inputs)
        found = self._bound.get(values)
        if found is None:
            if len(self._bound) >= self.bound_limit:
                del self._bound[next(iter(self._bound))]  # the oldest
            found = self._bound[values] = concrete(self.lowered, self.binder, values)
        return found

    def _run_fallback(self, inputs):
        if self._fallback is None:
            self._fallback = self.fallback()
        return self._fallback(*inputs)


def _input_type(proxy) -> tuple | None:
    """(dtype, device) a kernel expects of a region input; None for a non-tensor input."""
    if not isinstance(proxy, torch.Tensor):
        return None
    return proxy.dtype, proxy.device
