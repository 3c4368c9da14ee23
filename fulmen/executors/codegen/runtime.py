"""Running a fused region: strides, layout, compiled kernel, call.

`FusedRegion(lowered, region, outputs)` is the implementation of one fusion symbol. A call:

1. resolves each access of the kernel: the input's sizes and strides pushed through the access's
   view chain (broadcast -> stride 0, permute, slice -> offset and scaled stride, flip ->
   negative stride, reshape -> view strides), giving strides over the iteration space;
2. allocates the outputs (contiguous), drops size-1 dims and merges dims every pointer walks
   contiguously (so a contiguous region runs as one flat loop);
3. picks the kernel compiled for the pointers' inner-stride classes (compiling it the first
   time, possibly in a background thread started when the region was fused), and calls it.

If the compiler is missing or fails, the region warns once and runs its prims with the torch
executor from then on: never a crash, never a wrong result.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fulmen.executors.codegen.compile import CompileError, load_kernel
from fulmen.executors.codegen.cpp import render
from fulmen.executors.codegen.cpp_rows import render_rows
from fulmen.executors.codegen.ir import Access, RowKernel
from fulmen.executors.codegen.lower import LoweredRegion

GRAIN = 32768  # elements below which a kernel runs on one thread (as torch's GRAIN_SIZE)
_pool = ThreadPoolExecutor(max_workers=max(1, min(8, torch.get_num_threads())))


class _Fallback(Exception):
    pass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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


def resolve(tensor: torch.Tensor, access: Access):
    """(base tensor, element offset from its data_ptr, sizes, strides) of `access`."""
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
                offset += start * strides[d]
                sizes[d] = (end - start + st - 1) // st
                strides[d] *= st
        elif step.name == "squeeze":
            keep = [d for d in range(len(sizes)) if d not in params[0]]
            sizes, strides = [sizes[d] for d in keep], [strides[d] for d in keep]
        elif step.name == "flip":
            for d in params[0]:
                if sizes[d] > 0:
                    offset += (sizes[d] - 1) * strides[d]
                strides[d] = -strides[d]
        elif step.name == "reshape":
            new = _view_strides(sizes, strides, list(params[0]))
            if new is None:
                if any(s < 0 for s in strides):
                    raise _Fallback
                tensor = torch.as_strided(tensor, sizes, strides,
                                          tensor.storage_offset() + offset).contiguous()
                offset, strides = 0, list(tensor.stride())
                new = _view_strides(sizes, strides, list(params[0]))
            sizes, strides = list(params[0]), new
        else:
            raise _Fallback
    return tensor, offset, sizes, strides


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
    """What the callables behind fusion symbols share: the region, and its own trace run by
    the torch executor as the fallback when a kernel cannot be built or used."""

    def __init__(self, name: str, lowered: LoweredRegion, fallback_trace) -> None:
        self.name = name
        self.lowered = lowered
        self.kernel = lowered.kernel
        self.fallback_trace = fallback_trace
        self._fallback = None
        self.failed = False

    def _run_fallback(self, inputs):
        if self._fallback is None:
            from fulmen.executors.claim import claim_executors
            from fulmen.executors.registry import get_executor

            trace = claim_executors(self.fallback_trace, [get_executor("torch")])
            self._fallback = trace.python_callable()
        return self._fallback(*inputs)


class FusedRegion(RegionCallable):
    """The callable behind one fusion symbol (see the module docstring)."""

    def __init__(self, name: str, lowered: LoweredRegion, fallback_trace) -> None:
        super().__init__(name, lowered, fallback_trace)
        self.sources: dict[tuple, str] = {}
        self._kernels: dict[tuple, Future] = {}
        contiguous = (1,) * (len(self.kernel.accesses) + len(self.kernel.outputs))
        if isinstance(self.kernel, RowKernel):  # kept-shape pointers do not move along a row
            rows = self.kernel.access_rows + self.kernel.output_rows
            contiguous = tuple(0 if row else 1 for row in rows)
        self._kernel_for(contiguous)  # start compiling the common layout in the background

    def _kernel_for(self, layout: tuple) -> Future:
        future = self._kernels.get(layout)
        if future is None:
            kernel = self.kernel
            source = (render_rows if isinstance(kernel, RowKernel) else render)(kernel, layout)
            self.sources[layout] = source
            future = self._kernels[layout] = _pool.submit(load_kernel, source)
        return future

    def __call__(self, *inputs):
        if self.failed:
            return self._run_fallback(inputs)
        try:
            return self._run(inputs)
        except _Fallback:
            return self._run_fallback(inputs)
        except CompileError as error:
            self.failed = True
            warnings.warn(f"fulmen codegen: {self.name} runs on the torch executor: {error}",
                          RuntimeWarning, stacklevel=2)
            return self._run_fallback(inputs)

    def _run(self, inputs):
        if isinstance(self.kernel, RowKernel):
            return self._run_rows(inputs)
        lowered, kernel = self.lowered, self.kernel
        shape = lowered.shape
        outs = [torch.empty(shape, dtype=dtype) for dtype in kernel.output_dtypes]
        numel = math.prod(shape)
        if numel:
            bases, offsets, rows = [], [], []
            for access in kernel.accesses:
                base, offset, sizes, strides = resolve(inputs[access.input], access)
                if tuple(sizes) != shape:
                    raise _Fallback
                bases.append(base)
                offsets.append(offset)
                rows.append(strides)
            for out in outs:
                bases.append(out)
                offsets.append(0)
                rows.append(list(out.stride()))
            sizes, rows = coalesce(shape, rows)
            layout = tuple(1 if row[-1] == 1 else 0 if row[-1] == 0 else 2 for row in rows)
            fn = self._kernel_for(layout).result()
            nthreads = torch.get_num_threads() if numel >= GRAIN else 1
            inner = sizes[-1]
            nrows = numel // inner
            block = inner
            if nthreads > 1 and nrows < 4 * nthreads:
                pieces = min(_ceil_div(4 * nthreads, nrows), max(1, inner // 2048))
                block = _ceil_div(_ceil_div(inner, pieces), 64) * 64
            ndim = len(sizes)
            c_sizes = (ctypes.c_int64 * ndim)(*sizes)
            c_strides = (ctypes.c_int64 * (ndim * len(rows)))(*[s for row in rows for s in row])
            c_ptrs = (ctypes.c_void_p * len(bases))(
                *[b.data_ptr() + o * b.element_size() for b, o in zip(bases, offsets)])
            fn(ndim, ctypes.addressof(c_sizes), ctypes.addressof(c_strides),
               ctypes.addressof(c_ptrs), block, nthreads)
        results = []
        for kind, what in lowered.outputs:
            if kind == "kernel":
                results.append(outs[what])
            else:
                results.append(view_output(inputs[what.input], what))
        return results[0] if len(results) == 1 else tuple(results)

    def _run_rows(self, inputs):
        """Call a `RowKernel`: strides over (kept axes, reduced axes), each part coalesced."""
        lowered, kernel = self.lowered, self.kernel
        shape, reduced = lowered.shape, lowered.reduced
        kept = [d for d in range(len(shape)) if d not in reduced]
        kept_shape = tuple(shape[d] for d in kept)
        column_shape = tuple(shape[d] for d in reduced)
        outs = [torch.empty(column_shape if column else kept_shape if row else shape, dtype=dtype)
                for dtype, row, column in zip(kernel.output_dtypes, kernel.output_rows,
                                              kernel.output_columns)]
        nrows = math.prod(kept_shape)
        numel = nrows * math.prod(shape[d] for d in reduced)
        nthreads = torch.get_num_threads() if numel >= GRAIN else 1
        if nthreads > 1 and nrows < nthreads and numel >= 16 * GRAIN:
            raise _Fallback  # too few rows to share: torch's reductions split rows
        if nrows:
            bases, offsets, rows = [], [], []

            def full(strides, row, column=False):
                if column:
                    it = iter(strides)
                    return [next(it) if d in reduced else 0 for d in range(len(shape))]
                if not row:
                    return strides
                it = iter(strides)
                return [0 if d in reduced else next(it) for d in range(len(shape))]

            for access, row in zip(kernel.accesses, kernel.access_rows):
                base, offset, sizes, strides = resolve(inputs[access.input], access)
                if tuple(sizes) != (kept_shape if row else shape):
                    raise _Fallback
                bases.append(base)
                offsets.append(offset)
                rows.append(full(strides, row))
            for out, row, column in zip(outs, kernel.output_rows, kernel.output_columns):
                bases.append(out)
                offsets.append(0)
                rows.append(full(list(out.stride()), row, column))
            outer, outer_rows = coalesce(kept_shape, [[r[d] for d in kept] for r in rows])
            inner, inner_rows = coalesce([shape[d] for d in reduced],
                                         [[r[d] for d in reduced] for r in rows])
            layout = tuple(1 if row[-1] == 1 else 0 if row[-1] == 0 else 2 for row in inner_rows)
            fn = self._kernel_for(layout).result()
            sizes = outer + inner
            ndim = len(sizes)
            flat = [s for o, i in zip(outer_rows, inner_rows) for s in o + i]
            c_sizes = (ctypes.c_int64 * ndim)(*sizes)
            c_strides = (ctypes.c_int64 * len(flat))(*flat)
            c_ptrs = (ctypes.c_void_p * len(bases))(
                *[b.data_ptr() + o * b.element_size() for b, o in zip(bases, offsets)])
            fn(ndim, ctypes.addressof(c_sizes), ctypes.addressof(c_strides),
               ctypes.addressof(c_ptrs), len(outer), nthreads)
        else:
            for out, column in zip(outs, kernel.output_columns):
                if column:
                    out.zero_()  # a sum over no rows
        results = []
        for plan in lowered.outputs:
            if plan[0] == "kernel":
                results.append(outs[plan[1]])
            elif plan[0] == "rowview":
                results.append(view_output(outs[plan[1]], plan[2]))
            else:
                results.append(view_output(inputs[plan[1].input], plan[1]))
        return results[0] if len(results) == 1 else tuple(results)
