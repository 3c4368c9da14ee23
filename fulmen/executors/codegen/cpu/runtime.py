"""Running a fused region on CPU tensors: strides, layout, compiled kernel, call.

`FusedRegion(name, lowered, fallback)` is the implementation of one fusion symbol. A call:

1. resolves each access of the kernel (`region.resolve`), giving strides over the iteration
   space;
2. allocates the outputs (contiguous), drops size-1 dims and merges dims every pointer walks
   contiguously (so a contiguous region runs as one flat loop);
3. picks the kernel compiled for the pointers' inner-stride classes and calls it.

Steps 1-3 make a call plan (`plans.Plan`), kept per (threads, sizes, strides, dtypes, devices) of
the inputs, in a table shared by every live region of the same lowered description
(`plans.plan_table`: the layers of a model repeat their regions): a call then only allocates its
outputs, writes its pointers into a block of the kernel's arguments (sizes and strides written
once) and calls the kernel's one-argument entry (NOTE [one-argument entry] in `compiler.py`).
NOTE [the last plan]: a region remembers the plan it last ran with a C++ check of that plan's
inputs (`tensor_check`: sizes, strides, dtype, device, dispatch keys such as the negative bit,
requires_grad, exact type: all the key holds, and more); a call whose inputs pass it, on as many
threads, runs that plan without building the key in Python (about 2 µs of a region call on
small inputs). Anything else, a stricter check failing included, takes the table.
NOTE [a check for reuse]: the check is made at a plan's `CHECK_AFTER`-th table hit, not when
the plan is made: a sweep over shapes runs most plans once or twice (the layers of a model
share them), and a check (about 12 µs) is worth making only for a plan run again and again.
A plan is made only for inputs of the dtypes and devices the kernel was built for (`accepts`):
a kernel reads raw memory, so other inputs run the region's torch fallback, never a kernel that
would reinterpret their bytes.

When kernels are compiled is the `policy` (`build.py`: `set_compile_policy`, or the variable
`FULMEN_CODEGEN_COMPILE`):

- "lazy" (the default): a kernel already in the disk cache is loaded when the region is fused;
  any other kernel starts compiling in a background thread once its region has been called
  `hot_calls` times (`FULMEN_CODEGEN_HOT_CALLS`, default 3), and until it is ready the region
  runs its prims on the torch executor. One-off functions never wait for a C++ compiler.
- "eager": compiling starts when the region is fused and the first call waits for it (what
  benchmarks and the codegen tests use, to time and check the kernels themselves).

Outputs of 1 MiB and more come from fulmen's buffer pool (`pool.py`): their memory returns to
the pool when torch frees them and is reused without the page faults and zeroing of fresh
memory, which would otherwise be most of the time of a memory-bound kernel.

If the compiler is missing or fails, the region warns once and runs its prims with the torch
executor from then on: never a crash, never a wrong result.
"""

from __future__ import annotations

import math
import struct
import warnings
from concurrent.futures import Future

import torch

from fulmen.executors.codegen import cache
from fulmen.executors.codegen.build import policy, submit
from fulmen.executors.codegen.cpu import compiler
from fulmen.executors.codegen.cpu.plans import (
    Copy,
    Plan,
    contiguous,
    kept_key,
    long_inner,
    plan_table,
)
from fulmen.executors.codegen.cpu.pool import CPU
from fulmen.executors.codegen.cpu.render import render
from fulmen.executors.codegen.cpu.rows import render_rows
from fulmen.executors.codegen.ir import MASK_INPUT, RowKernel
from fulmen.executors.codegen.region import (
    MAX_BOUND,
    Fallback,
    RegionCallable,
    coalesce,
    mask_tensor,
    region_results,
    resolve,
    split_dims,
    strided_views,
)
from fulmen.tracer.key_memo import tensor_check

__all__ = ["FusedRegion", "render_any"]

CHECK_AFTER = 2  # table hits of a plan before its check is made (NOTE [a check for reuse])
GRAIN = 32768  # elements below which a kernel runs on one thread (as torch's GRAIN_SIZE)
_DOUBLE, _INT64 = struct.Struct("<d"), struct.Struct("<q")


def _bits(value: float) -> int:
    """The bits of a run-time float argument as the int64 its slot of the block holds (NOTE
    [run-time floats as kernel arguments] in `lower.py`)."""
    return _INT64.unpack(_DOUBLE.pack(value))[0]


def _overflows(value: float) -> bool:
    """Whether eager's checked conversion of `value` to float32 raises (finite, past its
    range; infinities and NaN convert)."""
    return math.isfinite(value) and abs(value) > FLOAT32_MAX


FLOAT32_MAX = torch.finfo(torch.float32).max


def _submit(source: str) -> Future:
    """The (shared) future loading the kernel of `source` (see `policy.submit`)."""
    key = ("kernel", source, str(cache.requested_root()), compiler.compiler())
    return submit(key, compiler.load_entry, source)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def render_any(kernel, layout: tuple[int, ...]) -> str:
    """C++ source of a pointwise or row kernel for inner-stride classes `layout`."""
    return (render_rows if isinstance(kernel, RowKernel) else render)(kernel, layout)


class FusedRegion(RegionCallable):
    """The callable behind one fusion symbol (see the module docstring)."""

    # A call plan holds all a call needs, not the concrete region it was made from: only the
    # last few concrete regions are kept, for plans of the same sizes with other strides.
    bound_limit = 4

    def __init__(self, name: str, lowered, fallback) -> None:
        super().__init__(name, lowered, fallback)
        self.sources: dict[tuple, str] = {}
        self.calls = 0
        self._kernels: dict[tuple, Future] = {}
        self._ready: dict[tuple, object] = {}  # the loaded kernel of each layout, once done
        contiguous = (1,) * (len(self.kernel.accesses) + len(self.kernel.outputs))
        if isinstance(self.kernel, RowKernel):  # kept-shape pointers do not move along a row
            rows = self.kernel.access_rows + self.kernel.output_rows
            contiguous = tuple(0 if row else 1 for row in rows)
        source = self._source(contiguous)
        self._plans = plan_table(self, source)
        self._last = None  # (threads, input count, tensor check, plan) of the last plan run
        # run-time float inputs (`Kernel.scalars`): in no key or check, written by each call
        self._scalars = getattr(self.kernel, "scalars", ())
        self._checked = getattr(self.kernel, "checked", ())
        self._tensors = tuple(i for i in range(len(lowered.inputs)) if i not in self._scalars)
        if policy.mode == "eager" or compiler.is_kernel_cached(source):
            self._start(contiguous)  # the common layout, in the background

    def _source(self, layout: tuple) -> str:
        source = self.sources.get(layout)
        if source is None:
            source = self.sources[layout] = render_any(self.kernel, layout)
        return source

    def _start(self, layout: tuple) -> Future:
        """The build of the kernel for `layout`, started if it is not (or if it was unfinished
        in the parent of a forked process: NOTE [fork] in `build.py`)."""
        future = self._kernels.get(layout)
        if future is None or not future.done():
            future = self._kernels[layout] = _submit(self._source(layout))
        return future

    def _kernel_for(self, layout: tuple):
        """The compiled kernel for `layout`; raises Fallback while it is not ready (lazy).

        NOTE [a cached kernel is loaded at once]: a kernel for `layout` already loaded by this
        process or in the disk cache is loaded here, in the calling thread (lazy too): no
        compiler runs, and the region runs its kernel from its first call. A new size of a
        symbolic region can need a layout the region has not used (a size that makes a
        strided dim contiguous), and tiny HF Llama's first training sweep ran 31 region calls
        on torch, each building its fallback, while such kernels waited for `hot_calls` or
        for the background thread that loads them."""
        fn = self._ready.get(layout)
        if fn is not None:
            return fn
        if policy.mode == "lazy":
            fn = compiler.load_cached_entry(self._source(layout))
            if fn is not None:
                self._ready[layout] = fn
                return fn
            if layout not in self._kernels and self.calls < policy.hot_calls:
                raise Fallback
        future = self._start(layout)
        if policy.mode == "lazy" and not future.done():
            raise Fallback
        fn = self._ready[layout] = future.result()
        return fn

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
        except Fallback:
            return self._run_fallback(inputs)
        except compiler.CompileError as error:
            self.failed = True
            warnings.warn(f"fulmen codegen: {self.name} runs on the torch executor: {error}",
                          RuntimeWarning, stacklevel=2)
            return self._run_fallback(inputs)

    def _run(self, inputs):
        threads = torch.get_num_threads()
        tensors = [inputs[i] for i in self._tensors] if self._scalars else inputs
        last = self._last  # NOTE [the last plan]
        if last is not None and last[0] == threads and len(inputs) == last[1] \
                and last[2].check(*tensors):
            plan = last[3]
        else:
            key = (threads,
                   *[(t.shape, t.stride(), t.dtype, t.is_cpu, t.is_neg()) for t in tensors])
            plan = self._plans.get(key)
            if plan is not None and plan.check is None and plan.uses < CHECK_AFTER:
                plan.uses += 1  # NOTE [a check for reuse]
                if plan.uses == CHECK_AFTER:
                    plan.check = tensor_check(tensors)
            elif plan is None:
                lowered = self.bind(inputs)
                if not self.accepts(inputs):
                    raise Fallback
                if self._empty(lowered):  # nothing to compute (no rows, or no points)
                    return self._run_empty(lowered, inputs)
                rows = isinstance(lowered.kernel, RowKernel)
                plan = self._plan_rows(inputs, lowered) if rows else self._plan(inputs, lowered)
                if len(self._plans) >= MAX_BOUND:
                    self._plans.clear()
                self._plans[kept_key(key)] = plan
            if plan.check is not None:
                self._last = (threads, len(inputs), plan.check, plan)
        if self._ready.get(plan.layout) is not plan.fn:
            # a plan another region of this signature made (`plan_table`): this region runs
            # it with its own kernel, once its compile policy has it (it raises Fallback before)
            plan.fn = self._kernel_for(plan.layout)
        if self._checked and any(_overflows(inputs[i]) for i in self._checked):
            raise Fallback  # eager raises its error (`Kernel.checked`)
        outs = [new() for new in plan.news]
        if plan.extra:  # masks (the plan's) and copies (this call's) stay alive past the kernel
            inputs = (*inputs, *plan.masks, *[copy.base(inputs) for copy in plan.copies])
        free = plan.free
        try:
            block = free.pop()  # a block no other thread is using (deque.pop is atomic)
        except IndexError:
            block = plan.block()
        words = [inputs[i].data_ptr() + o for i, o in plan.reads] + \
            [out.data_ptr() for out in outs]
        if self._scalars:
            words += [_bits(inputs[i]) for i in self._scalars]
        block[plan.start:] = words
        plan.fn(block)
        free.append(block)
        if plan.direct:  # the kernel's outputs are the region's, in order
            return outs[0] if len(outs) == 1 else tuple(outs)
        return region_results(None, inputs, outs, plan.views)

    @staticmethod
    def _empty(lowered) -> bool:
        """Whether the region has nothing to compute (an empty iteration space, or no rows)."""
        shape = lowered.shape
        if isinstance(lowered.kernel, RowKernel):
            return not math.prod(shape[d] for d in range(len(shape)) if d not in lowered.reduced)
        return not math.prod(shape)

    def _run_empty(self, lowered, inputs):
        kernel = lowered.kernel
        outs = [torch.empty(s, dtype=dtype, device=CPU)
                for s, dtype in zip(self._out_shapes(lowered), kernel.output_dtypes)]
        if isinstance(kernel, RowKernel):
            for out, column in zip(outs, kernel.output_columns):
                if column:
                    out.zero_()  # a sum over no rows
        return region_results(lowered, inputs, outs)

    def _out_shapes(self, lowered) -> list[tuple]:
        """The shape of each kernel output of the region `lowered` (`bind`): the iteration
        space (pointwise); for a row kernel the full, kept (row outputs) or reduced (column
        sums) shape."""
        kernel = lowered.kernel
        if not isinstance(kernel, RowKernel):
            return [lowered.shape] * len(kernel.outputs)
        shape, reduced = lowered.shape, lowered.reduced
        kept_shape = tuple(shape[d] for d in range(len(shape)) if d not in reduced)
        column_shape = tuple(shape[d] for d in reduced)
        return [column_shape if column else kept_shape if row else shape
                for row, column in zip(kernel.output_rows, kernel.output_columns)]

    def _pointers(self, inputs, expected, accesses, split=False) -> tuple[list, list]:
        """Per access: (input index, mask tensor or `Copy`, byte offset), and its strides
        (with `split`, a merged dim's may be a tuple: `resolve`); they serve every call with
        these input shapes and strides (a copy is made again by each call: `Copy`)."""
        pointers, rows = [], []
        for access, shape in zip(accesses, expected):
            if access.input == MASK_INPUT:  # made from the sizes, the same for every call
                mask, strides = mask_tensor(access)
                pointers.append((mask, 0))
                rows.append(strides)
                continue
            copies = []
            base, offset, sizes, strides = resolve(inputs[access.input], access, copies, split)
            if tuple(sizes) != shape:
                raise Fallback
            where = Copy(access.input, tuple(copies)) if copies else access.input
            pointers.append((where, offset * base.element_size()))
            rows.append(strides)
        return pointers, rows

    def _plan(self, inputs, lowered) -> Plan:
        """How to call a pointwise kernel for inputs of these shapes and strides (`Plan`)."""
        kernel, shape = lowered.kernel, lowered.shape
        expected = [shape] * len(kernel.accesses)
        pointers, rows = self._pointers(inputs, expected, kernel.accesses, split=True)
        rows += [contiguous(shape) for _ in kernel.outputs]
        # NOTE [a merged broadcast is a split iteration dim]: an access whose reshape merges a
        # broadcast dim with another (grouped-query attention's repeated keys) has no one
        # stride over the merged dim; the kernel iterates that dim as the dims it merges, so
        # the access is read in place instead of copied by every call
        # (nothing to split, the common case, skips the walk over every stride)
        merged = any(type(stride) is tuple for row in rows for stride in row)
        refined = split_dims(shape, rows) if merged else (shape, rows)
        if refined is None:
            pointers, rows = self._pointers(inputs, expected, kernel.accesses)
            rows += [contiguous(shape) for _ in kernel.outputs]
            refined = shape, rows
        sizes, rows = long_inner(*coalesce(*refined))
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
        return self._call_plan(fn, layout, sizes, rows, pointers, block, nthreads, lowered,
                               inputs)

    def _plan_rows(self, inputs, lowered) -> Plan:
        """How to call a `RowKernel` (as `_plan`, with the number of kept axes in place of the
        block): strides over (kept axes, reduced axes), each part coalesced."""
        kernel = lowered.kernel
        shape, reduced = lowered.shape, lowered.reduced
        kept = [d for d in range(len(shape)) if d not in reduced]
        kept_shape = tuple(shape[d] for d in kept)
        out_shapes = self._out_shapes(lowered)
        nrows = math.prod(kept_shape)
        numel = nrows * math.prod(shape[d] for d in reduced)
        nthreads = torch.get_num_threads() if numel >= GRAIN else 1
        if nthreads > 1 and nrows < nthreads and numel >= 16 * GRAIN:
            raise Fallback  # too few rows to share: torch's reductions split rows

        def full(strides, row, column=False):
            if column:
                it = iter(strides)
                return [next(it) if d in reduced else 0 for d in range(len(shape))]
            if not row:
                return strides
            it = iter(strides)
            return [0 if d in reduced else next(it) for d in range(len(shape))]

        expected = [kept_shape if row else shape for row in kernel.access_rows]
        pointers, strides = self._pointers(inputs, expected, kernel.accesses)
        rows = [full(s, row) for s, row in zip(strides, kernel.access_rows)]
        rows += [full(contiguous(out_shape), row, column) for out_shape, row, column
                 in zip(out_shapes, kernel.output_rows, kernel.output_columns)]
        outer, outer_rows = coalesce(kept_shape, [[r[d] for d in kept] for r in rows])
        inner, inner_rows = coalesce([shape[d] for d in reduced],
                                     [[r[d] for d in reduced] for r in rows])
        layout = tuple(1 if row[-1] == 1 else 0 if row[-1] == 0 else 2 for row in inner_rows)
        fn = self._kernel_for(layout)
        rows = [o + i for o, i in zip(outer_rows, inner_rows)]
        return self._call_plan(fn, layout, outer + inner, rows, pointers, len(outer), nthreads,
                               lowered, inputs, out_shapes)

    def _call_plan(self, fn, layout, sizes, rows, pointers, arg, nthreads, lowered,
                   inputs, out_shapes=None) -> Plan:
        """A plan (see `_plan`) from the coalesced sizes and stride rows, the kernel's
        pointers, its block (or number of kept axes) and threads. Plans are kept per shape (up
        to `MAX_BOUND`), so one does not hold the concrete region `lowered`."""
        if out_shapes is None:
            out_shapes = self._out_shapes(lowered)
        out_specs = tuple(zip(out_shapes, lowered.kernel.output_dtypes))
        direct = [plan[0] for plan in lowered.outputs] == ["kernel"] * len(out_specs) and \
            [plan[1] for plan in lowered.outputs] == list(range(len(out_specs)))
        views = None if direct else strided_views(lowered, inputs)
        return Plan(fn, layout, sizes, rows, pointers, arg, nthreads, out_specs, direct, views,
                     len(inputs), len(self._scalars))
