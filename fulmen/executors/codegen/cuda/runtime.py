"""Running a fused region on CUDA tensors: plan the layout class, render, compile, launch.

`CudaFusedRegion` is the implementation of a fusion symbol whose tensors live on a CUDA device:
it resolves strides like the CPU runtime (`region.py`), picks the layout class (`plan` gives a
`render.Spec` for a pointwise kernel, `rows.plan_rows` a `RowSpec` for the normalisation
schedule: block size, rows split over several blocks, column-sum groups, a float64 workspace),
compiles once per class (`nvrtc.py`) and launches on torch's current stream with `data_ptr()`s
(a row kernel: one launch, or one per reduction stage plus one when rows are split, then
`<entry>_columns` when it has column sums). If `cuda-python` is missing, NVRTC fails, or the
driver refuses the image, the region warns once and runs its fallback from then on: never a
crash, never a wrong result. Every op of a fused region is spelled by the CUDA target
(fusibility asks it), so no region discovers at call time that it cannot be rendered.
"""

from __future__ import annotations

import functools
import math
import struct
import warnings

import torch

from fulmen.executors.codegen.cuda import nvrtc
from fulmen.executors.codegen.cuda import rows as cuda_rows
from fulmen.executors.codegen.cuda.nvrtc import ENTRY, MAX_PARAM_BYTES, NvrtcError
from fulmen.executors.codegen.cuda.render import BLOCK, Spec, render, vector_width
from fulmen.executors.codegen.ir import Kernel, RowKernel
from fulmen.executors.codegen.ops import Unsupported
from fulmen.executors.codegen.region import (
    Fallback,
    RegionCallable,
    coalesce,
    region_results,
    resolve,
)

__all__ = ["CudaFusedRegion", "pack", "plan", "render_any"]

_warned: set[str] = set()


def render_any(kernel, spec) -> str:
    """CUDA source of a pointwise kernel for a `Spec`, or of a row kernel for a `RowSpec`."""
    if isinstance(spec, cuda_rows.RowSpec):
        return cuda_rows.render_rows(kernel, spec, ENTRY)
    return render(kernel, spec, ENTRY)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _contiguous(sizes) -> list[int]:
    strides, acc = [], 1
    for size in reversed(sizes):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def plan(kernel, sizes: list[int], rows: list[list[int]], addresses: list[int]) -> Spec:
    """The layout class (`Spec`) of a call: coalesced `sizes`, each pointer's element
    `rows` of strides and byte `addresses` (vectorised only when every contiguous pointer is
    aligned to its vector)."""
    contiguous = _contiguous(sizes)
    classes = tuple(0 if not any(row) else 1 if row == contiguous else 2 for row in rows)
    vec = vector_width(kernel, classes)
    if vec > 1:
        dtypes = list(kernel.access_dtypes) + list(kernel.output_dtypes)
        if any(c == 1 and address % (vec * d.itemsize) for c, d, address
               in zip(classes, dtypes, addresses)):
            vec = 1
    numel = math.prod(sizes)
    reach = max(sum((s - 1) * abs(st) for s, st in zip(sizes, row)) for row in rows)
    small = numel + 2**26 < 2**31 and reach < 2**31
    return Spec(len(sizes), classes, vec, "int" if small else "long long")


def pack(sizes: list[int], rows: list[list[int]], addresses: list[int]) -> bytes:
    """The argument struct of a kernel (see `render.py`): numel, sizes, strides, pointers."""
    flat = [s for row in rows for s in row]
    return struct.pack(f"<{1 + len(sizes) + len(flat)}q{len(addresses)}Q", math.prod(sizes),
                       *sizes, *flat, *addresses)


class CudaFusedRegion(RegionCallable):
    """The callable behind one fusion symbol on CUDA tensors (see the module docstring)."""

    def __init__(self, name: str, lowered, fallback) -> None:
        super().__init__(name, lowered, fallback)
        self.sources: dict[Spec | cuda_rows.RowSpec, str] = {}
        if not isinstance(self.kernel, (Kernel, RowKernel)):  # a schedule the renderer lacks
            self.failed = True

    def source_for(self, spec: Spec | cuda_rows.RowSpec) -> str:
        """The CUDA source of this region's kernel for layout class `spec`."""
        source = self.sources.get(spec)
        if source is None:
            source = self.sources[spec] = render_any(self.kernel, spec)
        return source

    def __call__(self, *inputs):
        if self.failed or not self.accepts(inputs):
            return self._run_fallback(inputs)
        try:
            return self._run(inputs)
        except Fallback:
            return self._run_fallback(inputs)
        except (NvrtcError, Unsupported) as error:  # Unsupported: never, by fusibility
            self.failed = True
            message = f"fulmen codegen: CUDA fusions run on the torch executor: {error}"
            if message not in _warned:
                _warned.add(message)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            return self._run_fallback(inputs)

    def _run(self, inputs):
        if isinstance(self.kernel, RowKernel):
            return self._run_rows(inputs)
        lowered = self.bind(inputs)
        kernel = lowered.kernel
        shape = lowered.shape
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        outs = [torch.empty(shape, dtype=dtype, device=device) for dtype in kernel.output_dtypes]
        if math.prod(shape):
            bases, addresses, rows = [], [], []
            for access in kernel.accesses:
                base, offset, sizes, strides = resolve(inputs[access.input], access)
                if tuple(sizes) != shape:
                    raise Fallback
                bases.append(base)
                addresses.append(base.data_ptr() + offset * base.element_size())
                rows.append(strides)
            for out in outs:
                addresses.append(out.data_ptr())
                rows.append(list(out.stride()))
            sizes, rows = coalesce(shape, rows)
            params = pack(sizes, rows, addresses)
            if len(params) > MAX_PARAM_BYTES:
                raise Fallback
            spec = plan(kernel, sizes, rows, addresses)
            function = nvrtc.load_function(self.source_for(spec), device)
            work = math.prod(sizes) // spec.vec if spec.vec > 1 else math.prod(sizes)
            index = device.index if device.index is not None else torch.cuda.current_device()
            grid = max(1, min(-(-work // BLOCK), _sm_count(index) * 8))
            nvrtc.launch(function, device, grid, params, BLOCK)
        return region_results(lowered, inputs, outs)

    def _run_rows(self, inputs):
        """Call a `RowKernel`: strides over (kept axes, reduced axes), each part coalesced (as
        the CPU runtime), then the launches of `cuda_rows.plan_rows`."""
        lowered = self.bind(inputs)
        kernel = lowered.kernel
        shape, reduced = lowered.shape, lowered.reduced
        kept = [d for d in range(len(shape)) if d not in reduced]
        kept_shape = tuple(shape[d] for d in kept)
        column_shape = tuple(shape[d] for d in reduced)
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        outs = [torch.empty(column_shape if column else kept_shape if row else shape, dtype=dtype,
                            device=device)
                for dtype, row, column in zip(kernel.output_dtypes, kernel.output_rows,
                                              kernel.output_columns)]
        if math.prod(kept_shape):
            bases, addresses, rows = [], [], []

            def full(strides, row, column=False):
                it = iter(strides)
                if column:
                    return [next(it) if d in reduced else 0 for d in range(len(shape))]
                if not row:
                    return list(strides)
                return [0 if d in reduced else next(it) for d in range(len(shape))]

            for access, row in zip(kernel.accesses, kernel.access_rows):
                base, offset, sizes, strides = resolve(inputs[access.input], access)
                if tuple(sizes) != (kept_shape if row else shape):
                    raise Fallback
                bases.append(base)  # keeps a copied base alive until the launches are queued
                addresses.append(base.data_ptr() + offset * base.element_size())
                rows.append(full(strides, row))
            for out, row, column in zip(outs, kernel.output_rows, kernel.output_columns):
                addresses.append(out.data_ptr())
                rows.append(full(list(out.stride()), row, column))
            outer, outer_rows = coalesce(kept_shape, [[r[d] for d in kept] for r in rows])
            inner, inner_rows = coalesce(column_shape, [[r[d] for d in reduced] for r in rows])
            sizes = outer + inner
            rows = [o + i for o, i in zip(outer_rows, inner_rows)]
            try:
                how = cuda_rows.plan_rows(kernel, sizes, len(outer), rows)
            except cuda_rows.NoPlan:
                raise Fallback from None
            if len(cuda_rows.pack_rows(how, sizes, rows, addresses, 0, 0)) > MAX_PARAM_BYTES:
                raise Fallback
            source = self.source_for(how.spec)
            function = nvrtc.load_function(source, device)
            columns = nvrtc.load_function(source, device, ENTRY + "_columns") if how.groups else None
            work = torch.empty(how.work // 8, dtype=torch.float64, device=device) \
                if how.work else None
            work_address = work.data_ptr() if work is not None else 0
            for phase in range(how.phases):
                params = cuda_rows.pack_rows(how, sizes, rows, addresses, work_address, phase)
                nvrtc.launch(function, device, how.grid, params, how.spec.block)
            if columns is not None:
                nvrtc.launch(columns, device, how.column_grid, params, cuda_rows.FINISH_BLOCK)
        else:
            for out, column in zip(outs, kernel.output_columns):
                if column:
                    out.zero_()  # a sum over no rows
        return region_results(lowered, inputs, outs)
