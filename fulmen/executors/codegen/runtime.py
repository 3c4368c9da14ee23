"""Running a fused region: strides, layout, compiled kernel, call.

`FusedRegion(lowered, region, outputs)` is the implementation of one fusion symbol. A call:

1. resolves each access of the kernel: the input's sizes and strides pushed through the access's
   view chain (broadcast -> stride 0, permute, slice -> offset and scaled stride, flip ->
   negative stride, reshape -> view strides), giving strides over the iteration space;
2. allocates the outputs (contiguous), drops size-1 dims and merges dims every pointer walks
   contiguously (so a contiguous region runs as one flat loop);
3. picks the kernel compiled for the pointers' inner-stride classes and calls it.

Steps 1-3 make a call plan, kept per (threads, sizes, strides, dtypes, devices) of the inputs. A
plan is made only for inputs of the dtypes and devices the kernel was built for (`accepts`): a
kernel reads raw memory, so other inputs run the region's torch fallback, never a kernel that
would reinterpret their bytes.

When kernels are compiled is the `policy` (`policy.py`: `set_compile_policy`, or the variable
`FULMEN_CODEGEN_COMPILE`):

- "lazy" (the default): a kernel already in the disk cache is loaded when the region is fused;
  any other kernel starts compiling in a background thread once its region has been called
  `hot_calls` times (`FULMEN_CODEGEN_HOT_CALLS`, default 3), and until it is ready the region
  runs its prims on the torch executor. One-off functions never wait for a C++ compiler.
- "eager": compiling starts when the region is fused and the first call waits for it (what
  benchmarks and the codegen tests use, to time and check the kernels themselves).

Outputs of 4 MiB and more come from fulmen's buffer pool (`pool.py`): their memory returns to
the pool when torch frees them and is reused without the page faults and zeroing of fresh
memory, which would otherwise be most of the time of a memory-bound kernel.

If the compiler is missing or fails, the region warns once and runs its prims with the torch
executor from then on: never a crash, never a wrong result.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from concurrent.futures import Future

import torch

from fulmen.executors.claim import claim_executors
from fulmen.executors.codegen import build, cache
from fulmen.executors.codegen.build import CompileError, is_cached, load_kernel
from fulmen.executors.codegen.cpp import render
from fulmen.executors.codegen.cpp_rows import render_rows
from fulmen.executors.codegen.ir import Access, RowKernel
from fulmen.executors.codegen.lower import LoweredRegion
from fulmen.executors.codegen.policy import policy, submit
from fulmen.executors.codegen.pool import empty
from fulmen.executors.registry import get_executor

GRAIN = 32768  # elements below which a kernel runs on one thread (as torch's GRAIN_SIZE)


class _Fallback(Exception):
    pass


def _submit(source: str) -> Future:
    """The (shared) future loading the kernel of `source` (see `policy.submit`)."""
    key = ("kernel", source, str(cache.requested_root()), build.compiler())
    return submit(key, load_kernel, source)


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


def region_results(lowered, inputs, outs):
    """A region's outputs from its kernel's outputs `outs`, by the lowering's plan: per output
    ("kernel", k), ("view", access) of an input, or ("rowview", k, access) of kernel output k."""
    results = []
    for plan in lowered.outputs:
        if plan[0] == "kernel":
            results.append(outs[plan[1]])
        elif plan[0] == "rowview":
            results.append(view_output(outs[plan[1]], plan[2]))
        else:
            results.append(view_output(inputs[plan[1].input], plan[1]))
    return results[0] if len(results) == 1 else tuple(results)


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
        self.input_types = tuple(_input_type(proxy) for proxy in lowered.inputs)
        self._fallback = None
        self.failed = False

    def accepts(self, inputs) -> bool:
        """Whether every input has the dtype and device the kernel was built for. A kernel
        reads raw memory: a bfloat16 buffer handed to a float32 kernel would be read as float32
        (garbage), so a region called with other types runs its torch fallback instead."""
        if len(inputs) != len(self.input_types):
            return False
        for tensor, expected in zip(inputs, self.input_types):
            if expected is not None and (not isinstance(tensor, torch.Tensor)
                                         or (tensor.dtype, tensor.device) != expected):
                return False
        return True

    def _run_fallback(self, inputs):
        if self._fallback is None:
            trace = claim_executors(self.fallback_trace, [get_executor("torch")])
            self._fallback = trace.python_callable()
        return self._fallback(*inputs)


class FusedRegion(RegionCallable):
    """The callable behind one fusion symbol (see the module docstring)."""

    def __init__(self, name: str, lowered: LoweredRegion, fallback_trace) -> None:
        super().__init__(name, lowered, fallback_trace)
        self.sources: dict[tuple, str] = {}
        self.calls = 0
        self._kernels: dict[tuple, Future] = {}
        self._plans: dict[tuple, tuple] = {}
        contiguous = (1,) * (len(self.kernel.accesses) + len(self.kernel.outputs))
        if isinstance(self.kernel, RowKernel):  # kept-shape pointers do not move along a row
            rows = self.kernel.access_rows + self.kernel.output_rows
            contiguous = tuple(0 if row else 1 for row in rows)
        source = self._source(contiguous)
        if policy.mode == "eager" or is_cached(source):
            self._start(contiguous)  # the common layout, in the background

    def _source(self, layout: tuple) -> str:
        source = self.sources.get(layout)
        if source is None:
            kernel = self.kernel
            source = (render_rows if isinstance(kernel, RowKernel) else render)(kernel, layout)
            self.sources[layout] = source
        return source

    def _start(self, layout: tuple) -> Future:
        """The build of the kernel for `layout`, started if it is not (or if it was unfinished
        in the parent of a forked process: NOTE [fork] in `policy.py`)."""
        future = self._kernels.get(layout)
        if future is None or not future.done():
            future = self._kernels[layout] = _submit(self._source(layout))
        return future

    def _kernel_for(self, layout: tuple):
        """The compiled kernel for `layout`; raises _Fallback while it is not ready (lazy)."""
        if layout not in self._kernels and policy.mode == "lazy" \
                and self.calls < policy.hot_calls:
            raise _Fallback
        future = self._start(layout)
        if policy.mode == "lazy" and not future.done():
            raise _Fallback
        return future.result()

    def ready(self) -> bool:
        """Whether every kernel started so far is compiled (waits for none)."""
        return all(f.done() for f in self._kernels.values())

    def wait(self) -> None:
        """Block until every kernel started so far is compiled (errors surface at the call)."""
        for layout in list(self._kernels):
            self._start(layout).exception()

    def __call__(self, *inputs):
        self.calls += 1
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
        lowered, kernel = self.lowered, self.kernel
        rows = isinstance(kernel, RowKernel)
        shape = lowered.shape
        points = [shape[d] for d in range(len(shape)) if d not in lowered.reduced] if rows else shape
        if not math.prod(points):  # nothing to compute (no rows, or an empty iteration space)
            if not self.accepts(inputs):
                raise _Fallback
            outs = [torch.empty(s, dtype=dtype)
                    for s, dtype in zip(self._out_shapes(), kernel.output_dtypes)]
            for out, column in zip(outs, kernel.output_columns if rows else ()):
                if column:
                    out.zero_()  # a sum over no rows
            return region_results(lowered, inputs, outs)
        key = (torch.get_num_threads(),
               *[(t.shape, t.stride(), t.dtype, t.is_cpu) for t in inputs])
        plan = self._plans.get(key)
        if plan is None:
            if not self.accepts(inputs):
                raise _Fallback
            plan = self._plan_rows(inputs) if rows else self._plan(inputs)
            if plan[-1]:  # no access copied its input: valid for every call with this key
                self._plans[key] = plan
        fn, ndim, c_sizes, c_strides, pointers, arg, nthreads, out_specs, _ = plan
        outs = [empty(shape, dtype) for shape, dtype in out_specs]
        c_ptrs = (ctypes.c_void_p * (len(pointers) + len(outs)))(
            *[(inputs[i] if isinstance(i, int) else i).data_ptr() + o for i, o in pointers],
            *[out.data_ptr() for out in outs])
        fn(ndim, ctypes.addressof(c_sizes), ctypes.addressof(c_strides),
           ctypes.addressof(c_ptrs), arg, nthreads)
        return region_results(lowered, inputs, outs)

    def _out_shapes(self) -> list[tuple]:
        """The shape of each kernel output: the iteration space (pointwise); for a row kernel
        the full, kept (row outputs) or reduced (column sums) shape."""
        lowered, kernel = self.lowered, self.kernel
        if not isinstance(kernel, RowKernel):
            return [lowered.shape] * len(kernel.outputs)
        shape, reduced = lowered.shape, lowered.reduced
        kept_shape = tuple(shape[d] for d in range(len(shape)) if d not in reduced)
        column_shape = tuple(shape[d] for d in reduced)
        return [column_shape if column else kept_shape if row else shape
                for row, column in zip(kernel.output_rows, kernel.output_columns)]

    def _pointers(self, inputs, expected) -> tuple[list, list, bool]:
        """Per access: (input index or base tensor, byte offset), its strides, and whether
        every access reads its input in place (no copy)."""
        pointers, rows, in_place = [], [], True
        for access, shape in zip(self.kernel.accesses, expected):
            base, offset, sizes, strides = resolve(inputs[access.input], access)
            if tuple(sizes) != shape:
                raise _Fallback
            own = base is inputs[access.input]
            in_place &= own
            pointers.append((access.input if own else base, offset * base.element_size()))
            rows.append(strides)
        return pointers, rows, in_place

    def _plan(self, inputs) -> tuple:
        """How to call a pointwise kernel for inputs of these shapes and strides: (kernel,
        ndim, sizes, strides, pointers, block, threads, output (shape, dtype)s, reusable)."""
        kernel, shape = self.kernel, self.lowered.shape
        pointers, rows, in_place = self._pointers(inputs, [shape] * len(kernel.accesses))
        rows += [_contiguous(shape) for _ in kernel.outputs]
        sizes, rows = coalesce(shape, rows)
        layout = tuple(1 if row[-1] == 1 else 0 if row[-1] == 0 else 2 for row in rows)
        fn = self._kernel_for(layout)
        numel = math.prod(shape)
        nthreads = torch.get_num_threads() if numel >= GRAIN else 1
        inner = sizes[-1]
        nrows = numel // inner
        block = inner
        if nthreads > 1 and nrows < 4 * nthreads:
            pieces = min(_ceil_div(4 * nthreads, nrows), max(1, inner // 2048))
            block = _ceil_div(_ceil_div(inner, pieces), 64) * 64
        flat = [s for row in rows for s in row]
        return (fn, len(sizes), (ctypes.c_int64 * len(sizes))(*sizes),
                (ctypes.c_int64 * len(flat))(*flat), pointers, block, nthreads,
                list(zip(self._out_shapes(), kernel.output_dtypes)), in_place)

    def _plan_rows(self, inputs) -> tuple:
        """How to call a `RowKernel` (as `_plan`, with the number of kept axes in place of the
        block): strides over (kept axes, reduced axes), each part coalesced."""
        lowered, kernel = self.lowered, self.kernel
        shape, reduced = lowered.shape, lowered.reduced
        kept = [d for d in range(len(shape)) if d not in reduced]
        kept_shape = tuple(shape[d] for d in kept)
        out_shapes = self._out_shapes()
        nrows = math.prod(kept_shape)
        numel = nrows * math.prod(shape[d] for d in reduced)
        nthreads = torch.get_num_threads() if numel >= GRAIN else 1
        if nthreads > 1 and nrows < nthreads and numel >= 16 * GRAIN:
            raise _Fallback  # too few rows to share: torch's reductions split rows

        def full(strides, row, column=False):
            if column:
                it = iter(strides)
                return [next(it) if d in reduced else 0 for d in range(len(shape))]
            if not row:
                return strides
            it = iter(strides)
            return [0 if d in reduced else next(it) for d in range(len(shape))]

        expected = [kept_shape if row else shape for row in kernel.access_rows]
        pointers, strides, in_place = self._pointers(inputs, expected)
        rows = [full(s, row) for s, row in zip(strides, kernel.access_rows)]
        rows += [full(_contiguous(out_shape), row, column) for out_shape, row, column
                 in zip(out_shapes, kernel.output_rows, kernel.output_columns)]
        outer, outer_rows = coalesce(kept_shape, [[r[d] for d in kept] for r in rows])
        inner, inner_rows = coalesce([shape[d] for d in reduced],
                                     [[r[d] for d in reduced] for r in rows])
        layout = tuple(1 if row[-1] == 1 else 0 if row[-1] == 0 else 2 for row in inner_rows)
        fn = self._kernel_for(layout)
        sizes = outer + inner
        flat = [s for o, i in zip(outer_rows, inner_rows) for s in o + i]
        return (fn, len(sizes), (ctypes.c_int64 * len(sizes))(*sizes),
                (ctypes.c_int64 * len(flat))(*flat), pointers, len(outer), nthreads,
                list(zip(out_shapes, kernel.output_dtypes)), in_place)


def _input_type(proxy) -> tuple | None:
    """(dtype, device) a kernel expects of a region input; None for a non-tensor input."""
    if not isinstance(proxy, torch.Tensor):
        return None
    return proxy.dtype, proxy.device


def _contiguous(shape) -> list[int]:
    """Row-major element strides of `shape` (those of `torch.empty(shape)`)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]
