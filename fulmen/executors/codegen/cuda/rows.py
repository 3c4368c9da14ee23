"""CUDA renderer of the normalisation schedule: a `RowKernel` -> CUDA C++ for NVRTC, and the
host-side plan of its launch (block size, grid, row splitting, workspace, argument struct).

One entry point per kernel (plus `<name>_columns` when it has column sums), one struct argument:

    struct Args { long long rows, count, nsplit, chunk, phase, groups;
                  long long sizes[NOUT + NIN]; long long strides[NPTR][NOUT + NIN];
                  void* ptrs[NPTR]; void* work; };

`sizes` are the coalesced kept (outer) axes, then the coalesced reduced (inner) axes; a row is one
point of the outer axes and `count` elements of the inner ones, indexed by one flat j. A kernel is
rendered for a `RowSpec`: the ranks, each pointer's inner class (1 contiguous: element j at j,
0 constant along the row, 2 any strides: offsets from j by div/mod), the block size, the path
(one block per row or split rows), and for column sums the elements each thread keeps.

One block per row (the usual path; blocks stride over rows when there are more rows than blocks):
the block runs the stages of `cpu/rows.py` in order. Each reduction stage is one pass over the row
(thread t takes elements t, t + BLOCK, ...; consecutive threads read consecutive elements), then a
block-wide reduction: `__shfl_xor_sync` within each warp, the warps' results through shared
memory, a last shuffle in warp 0, and the result broadcast through shared memory so every thread
holds the same bits. Row-level values follow (every thread computes them), then one pass computes
and stores the element outputs, and thread 0 stores the row outputs.

Split rows (a row of at least LONG_ROW elements when there are fewer than TARGET_BLOCKS rows): a
row is cut into `nsplit` chunks of `chunk` elements, one block each, and the kernel is launched
once per reduction stage plus once for the outputs (`phase`). Launch i computes stage i's partial
of each chunk and writes it to the workspace (`work[task * NRED + slot]`, 8 bytes each); every
later launch combines a row's partials in chunk order before going on, and the last one stores the
outputs. No atomics: results do not depend on block scheduling.

Column sums (`ColumnReduce`, a LayerNorm weight gradient) need the element index of a thread to be
the same in every row: such kernels are never split, take at most KMAX elements per thread (rows
of up to COLUMN_BLOCK_MAX * KMAX elements; longer ones run on torch), and run in `groups` blocks
(a function of the shape only). Each thread adds its elements into float64 registers over its
block's rows, the block writes them to `work[group][column][j]`, and `<name>_columns` sums the
groups in order. Deterministic, as the CPU kernel.

Numerics follow `cpu/rows.py`: floating sums and products accumulate in float32 over at most FLUSH
elements per thread and in float64 beyond (across those runs, threads and chunks), float64 ones in
float64, integer ones in 64-bit two's complement; amax/amin propagate NaN; float16/bfloat16 are
loaded and stored as `__half`/`__nv_bfloat16`, computed in float32 and rounded after each op, as
in `render.py`. Element values are recomputed in each pass that needs them (no register cache yet).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from fulmen.executors.codegen import ir
from fulmen.executors.codegen.cuda.target import CUDA, needs_headers, prelude
from fulmen.executors.codegen.renderer import RowRenderer
from fulmen.executors.codegen.target import header, live_values, op_reads

__all__ = ["NoPlan", "RowLaunch", "RowSpec", "pack_rows", "plan_rows", "render_rows",
           "render_rows_body"]

BLOCK_MAX = 1024  # threads per block of a row kernel, at most
PER_THREAD = 4  # the block size aims at this many elements per thread
FLUSH = 32  # elements per thread summed in float32 before they are added in float64
LONG_ROW = 16384  # rows at least this long may be split over several blocks
MIN_CHUNK = 4096  # elements per block of a split row, at least
TARGET_BLOCKS = 256  # rows are split when there are fewer, into about this many blocks in all
COLUMN_GROUPS = 256  # blocks (float64 partials per column) of a kernel with column sums
COLUMN_BLOCK_MAX = 512  # threads per block of a kernel with column sums, at most
KMAX = 16  # elements per thread of a kernel with column sums, at most
FINISH_BLOCK = 256  # threads per block of `<name>_columns`
MAX_GRID = 1 << 20  # blocks of a launch, at most (blocks stride over the rows beyond)

ROW_PRELUDE = header("cuda_rows.h")

_FUNCTOR = {"sum": "FmSum", "prod": "FmProd", "amax": "FmMax", "amin": "FmMin"}
_IDENTITY = {
    ("sum", "double"): "0.0", ("sum", "unsigned long long"): "0ULL",
    ("prod", "double"): "1.0", ("prod", "unsigned long long"): "1ULL",
    ("amax", "float"): "(-FM_INF_F)", ("amax", "double"): "(-FM_INF_D)",
    ("amax", "int"): "(-2147483647 - 1)", ("amax", "long long"): "(-9223372036854775807LL - 1LL)",
    ("amin", "float"): "FM_INF_F", ("amin", "double"): "FM_INF_D",
    ("amin", "int"): "2147483647", ("amin", "long long"): "9223372036854775807LL",
}  # fmt: skip


class NoPlan(Exception):
    """This call's shape has no CUDA row launch (the region runs on torch for it)."""


@dataclass(frozen=True)
class RowSpec:
    """The class of calls a rendered row kernel serves (see the module docstring): ranks of the
    outer and inner axes, each pointer's inner class, threads per block, whether rows are split,
    elements per thread kept for column sums (0 without), and the type of inner indices."""

    nouter: int
    ninner: int
    classes: tuple[int, ...]
    block: int
    split: bool = False
    kmax: int = 0
    index: str = "int"


@dataclass(frozen=True)
class RowLaunch:
    """How to launch a row kernel for one call: its spec, blocks of the main entry, chunks per
    row and their length, launches of the main entry (`phase` 0..phases-1), column groups,
    workspace bytes and blocks of `<name>_columns`."""

    spec: RowSpec
    grid: int
    nsplit: int
    chunk: int
    phases: int
    groups: int
    work: int
    column_grid: int


def _reductions(kernel: ir.RowKernel) -> list[int]:
    """The live reductions, in SSA order (workspace slot i holds the i-th one's partial)."""
    live = live_values(kernel)
    return [v for v, value in enumerate(kernel.values) if isinstance(value, ir.Reduce) and v in live]


def _closure(kernel: ir.RowKernel, targets) -> list[int]:
    """Element-level values the targets need, in SSA order."""
    return ir.element_closure(kernel, targets, args_of=lambda op: op_reads(kernel, op))


def _accumulator(kernel: ir.RowKernel, v: int) -> tuple[str, str | None, str]:
    """(accumulator type, float32 partial type or None, workspace slot type) of reduction v."""
    red = kernel.values[v]
    dtype = kernel.values[red.arg].dtype
    if red.name in ("sum", "prod"):
        if not dtype.is_floating_point:
            return "unsigned long long", None, "unsigned long long"
        return "double", None if dtype == torch.float64 else "float", "double"
    if dtype.is_floating_point:
        return CUDA.compute[dtype], None, "double"
    return ("int" if dtype.itemsize <= 4 else "long long"), None, "long long"


class _Renderer(RowRenderer):
    """Builds the source of one row kernel for one spec (see `render_rows`)."""

    target = CUDA

    def __init__(self, kernel: ir.RowKernel, spec: RowSpec, name: str) -> None:
        super().__init__(kernel, spec.classes)
        self.spec, self.name = spec, name
        self.live = live_values(kernel)
        self.reductions = _reductions(kernel)
        self.slots = {v: i for i, v in enumerate(self.reductions)}
        assert not (self.columns and spec.split), "column sums are never split"
        assert bool(self.columns) == (spec.kmax > 0)
        self.nw = spec.block // 32
        self.idx = spec.index

    def where(self, p: int, element: bool) -> str:
        """The element of pointer p read or written at inner index j (row level: the row's)."""
        if not element or self.ptr_rows[p] or self.spec.classes[p] == 0:
            return f"p{p}[0]"
        return f"p{p}[j]" if self.spec.classes[p] == 1 else f"p{p}[o{p}]"

    element = where

    def count(self, ctype: str) -> str:
        return f"(({ctype})count)"

    def rendered(self, v: int) -> bool:
        return v in self.live  # no rendered variable goes unused: NVRTC would warn

    def pointers_of(self, values: list[int]) -> list[int]:
        """Pointers the loads among `values` read."""
        kernel = self.kernel
        return sorted({kernel.values[v].access for v in values
                       if isinstance(kernel.values[v], ir.Load)})

    def inner_offsets(self, depth: int, pointers: list[int]) -> None:
        """Offsets o<p> of element j for the strided pointers among `pointers`."""
        strided = [p for p in pointers if self.spec.classes[p] == 2 and not self.ptr_rows[p]]
        if not strided:
            return
        idx, nout, nin = self.idx, self.spec.nouter, self.spec.ninner
        self.emit(depth, " ".join(f"{idx} o{p} = 0;" for p in strided), "{",
                  f"  {idx} r = j;", "  #pragma unroll",
                  f"  for (int d = {nin - 1}; d >= 0; --d) {{",
                  f"    const {idx} size = ({idx})args.sizes[{nout} + d];",
                  f"    const {idx} c = d == 0 ? r : r % size;", "    r /= size;")
        self.emit(depth + 2, *[f"o{p} += c * ({idx})args.strides[{p}][{nout} + d];"
                               for p in strided])
        self.emit(depth, "  }", "}")

    def reduction_stage(self, reds: list[int], phase: int) -> None:
        """Accumulate the stage's reductions over [start, end), reduce across the block, and
        (split rows) hand the block's partials to the workspace or combine the chunks'."""
        kernel, block, idx = self.kernel, self.spec.block, self.idx
        accs = {v: _accumulator(kernel, v) for v in reds}
        for v in reds:
            acc_t = accs[v][0]
            self.emit(2, f"{acc_t} a{v} = {_IDENTITY[(kernel.values[v].name, acc_t)]};")
        depth = 2
        if self.spec.split:
            self.emit(2, f"if (args.phase == {phase}) {{")
            depth = 3
        blocked = [v for v in reds if accs[v][1]]
        body = [self.value_line(u, element=True)
                for u in _closure(kernel, [kernel.values[v].arg for v in reds])]
        updates = []
        for v in reds:
            red = kernel.values[v]
            acc_t, part_t, _ = accs[v]
            target = f"b{v}" if part_t else f"a{v}"
            cast = f"({part_t or acc_t})v{red.arg}"
            if red.name == "sum":
                updates.append(f"{target} += {cast};")
            elif red.name == "prod":
                updates.append(f"{target} *= {cast};")
            else:
                updates.append(f"{target} = {_FUNCTOR[red.name]}()({target}, {cast});")
        pointers = self.pointers_of(_closure(kernel, [kernel.values[v].arg for v in reds]))
        if blocked:
            span = block * FLUSH
            self.emit(depth, f"for ({idx} jb = start; jb < end; jb += {span}) {{",
                      f"  const {idx} je = end < jb + {span} ? end : jb + {span};")
            for v in blocked:
                init = "0.0f" if kernel.values[v].name == "sum" else "1.0f"
                self.emit(depth + 1, f"float b{v} = {init};")
            self.emit(depth + 1, f"for ({idx} j = jb + tid; j < je; j += {block}) {{")
            self.inner_offsets(depth + 2, pointers)
            self.emit(depth + 2, *body, *updates)
            self.emit(depth + 1, "}")
            for v in blocked:
                op = "+" if kernel.values[v].name == "sum" else "*"
                self.emit(depth + 1, f"a{v} {op}= (double)b{v};")
            self.emit(depth, "}")
        else:
            self.emit(depth, f"for ({idx} j = start + tid; j < end; j += {block}) {{")
            self.inner_offsets(depth + 1, pointers)
            self.emit(depth + 1, *body, *updates)
            self.emit(depth, "}")
        self.block_reduce(depth, reds, accs)
        if self.spec.split:
            self.emit(depth, "if (tid == 0) {")
            for v in reds:
                slot_t = accs[v][2]
                self.emit(depth + 1, f"(({slot_t}*)args.work)[task * {len(self.reductions)} + "
                                     f"{self.slots[v]}] = ({slot_t})a{v};")
            self.emit(depth, "}", "continue;")
            self.emit(2, "}", "for (long long q = 0; q < args.nsplit; ++q) {")
            for v in reds:
                acc_t, _, slot_t = accs[v]
                functor = _FUNCTOR[kernel.values[v].name]
                self.emit(3, f"a{v} = {functor}()(a{v}, ({acc_t})((const {slot_t}*)args.work)"
                             f"[(row * args.nsplit + q) * {len(self.reductions)} + "
                             f"{self.slots[v]}]);")
            self.emit(2, "}")
        for v in reds:
            red = kernel.values[v]
            rtype = CUDA.compute[red.dtype]
            acc = f"(long long)a{v}" if accs[v][0] == "unsigned long long" else f"a{v}"
            self.emit(2, f"const {rtype} v{v} = {CUDA.round(CUDA.cast(acc, red.dtype), red.dtype)};")

    def block_reduce(self, depth: int, reds: list[int], accs: dict) -> None:
        """Combine the threads' accumulators: within warps, across warps through shared memory;
        every thread ends with the value of thread 0."""
        functor = {v: _FUNCTOR[self.kernel.values[v].name] for v in reds}
        for v in reds:
            self.emit(depth, f"a{v} = fm_warp_reduce<32>(a{v}, {functor[v]}());")
        if self.nw == 1:
            self.emit(depth, *[f"a{v} = __shfl_sync(0xffffffffu, a{v}, 0);" for v in reds])
            return
        nw = self.nw
        self.emit(depth, "if (lane == 0) {", *[f"  s{v}[warp] = a{v};" for v in reds], "}",
                  "__syncthreads();", "if (warp == 0) {")
        for v in reds:
            self.emit(depth + 1, f"a{v} = fm_warp_reduce<{nw}>(s{v}[lane & {nw - 1}], "
                                 f"{functor[v]}());")
        self.emit(depth + 1, "if (lane == 0) {", *[f"  s{v}[{nw}] = a{v};" for v in reds], "}")
        self.emit(depth, "}", "__syncthreads();", *[f"a{v} = s{v}[{nw}];" for v in reds])

    def output_pass(self) -> None:
        """The element outputs and column sums over [start, end), then the row outputs."""
        kernel, spec, idx = self.kernel, self.spec, self.idx
        element_outputs = [(self.nacc + k, v) for k, v in enumerate(kernel.outputs)
                           if not kernel.rows[v] and not isinstance(kernel.values[v], ir.ColumnReduce)]
        args = [kernel.values[v].arg for _, v in self.columns]
        if element_outputs or self.columns:
            values = _closure(kernel, [v for _, v in element_outputs] + args)
            body = [self.value_line(u, element=True) for u in values]
            body += [f"{self.where(p, True)} = {CUDA.store(f'v{v}', self.dtypes[p])};"
                     for p, v in element_outputs]
            body += [f"c{c}[k] += (double)v{arg};" for c, arg in enumerate(args)]
            pointers = self.pointers_of(values) + [p for p, _ in element_outputs]
            if spec.kmax:
                self.emit(2, "#pragma unroll", f"for (int k = 0; k < {spec.kmax}; ++k) {{",
                          f"  const {idx} j = start + tid + k * {spec.block};",
                          "  if (j < end) {")
                self.inner_offsets(4, pointers)
                self.emit(4, *body)
                self.emit(2, "  }", "}")
            else:
                self.emit(2, f"for ({idx} j = start + tid; j < end; j += {spec.block}) {{")
                self.inner_offsets(3, pointers)
                self.emit(3, *body)
                self.emit(2, "}")
        row_outputs = [(self.nacc + k, v) for k, v in enumerate(kernel.outputs) if kernel.rows[v]]
        if row_outputs:
            self.emit(2, "if (tid == 0 && part == 0) {" if spec.split else "if (tid == 0) {")
            self.emit(3, *[f"p{p}[0] = {CUDA.store(f'v{v}', self.dtypes[p])};"
                           for p, v in row_outputs])
            self.emit(2, "}")

    def used_pointers(self) -> list[int]:
        kernel = self.kernel
        loads = {kernel.values[v].access for v in self.live if isinstance(kernel.values[v], ir.Load)}
        outputs = {self.nacc + k for k, v in enumerate(kernel.outputs)
                   if not isinstance(kernel.values[v], ir.ColumnReduce)}
        return sorted(loads | outputs)

    def main(self) -> None:
        kernel, spec, name, idx = self.kernel, self.spec, self.name, self.idx
        nd = spec.nouter + spec.ninner
        self.emit(0, f"struct Args_{name} {{",
                  "  long long rows; long long count; long long nsplit; long long chunk;",
                  "  long long phase; long long groups;",
                  f"  long long sizes[{nd}]; long long strides[{self.nptr}][{nd}];",
                  f"  void* ptrs[{self.nptr}]; void* work;", "};",
                  f'extern "C" __global__ void __launch_bounds__({spec.block}) {name}('
                  f"const Args_{name} args) {{",
                  f"  const {idx} count = ({idx})args.count;",
                  "  const int tid = threadIdx.x;")
        if self.reductions and self.nw > 1:
            self.emit(1, "const int lane = tid & 31, warp = tid >> 5;")
            for v in self.reductions:
                self.emit(1, f"__shared__ {_accumulator(kernel, v)[0]} s{v}[{self.nw + 1}];")
        for c in range(len(self.columns)):
            self.emit(1, f"double c{c}[{spec.kmax}];", "#pragma unroll",
                      f"for (int k = 0; k < {spec.kmax}; ++k) c{c}[k] = 0.0;")
        if spec.split:
            self.emit(1, "for (long long task = blockIdx.x; task < args.rows * args.nsplit; "
                         "task += gridDim.x) {",
                      "  const long long row = task / args.nsplit;",
                      f"  const {idx} part = ({idx})(task - row * args.nsplit);",
                      f"  const {idx} start = part * ({idx})args.chunk;",
                      f"  const {idx} end = count - start < ({idx})args.chunk ? count : "
                      f"start + ({idx})args.chunk;")
        else:
            self.emit(1, "for (long long row = blockIdx.x; row < args.rows; row += gridDim.x) {",
                      f"  const {idx} start = 0;", f"  const {idx} end = count;")
        used = self.used_pointers()
        self.emit(2, " ".join(f"long long off{p} = 0;" for p in used), "{",
                  "  long long r = row;", "  #pragma unroll",
                  f"  for (int d = {spec.nouter - 1}; d >= 0; --d) {{",
                  "    const long long c = d == 0 ? r : r % args.sizes[d];",
                  "    r /= args.sizes[d];")
        self.emit(4, *[f"off{p} += c * args.strides[{p}][d];" for p in used])
        self.emit(2, "  }", "}")
        for p in used:
            const = "const " if p < self.nacc else ""
            ctype = CUDA.storage[self.dtypes[p]]
            self.emit(2, f"{const}{ctype}* __restrict__ p{p} = ({const}{ctype}*)args.ptrs[{p}] "
                         f"+ off{p};")
        self.row_values(0)
        phase = 0
        for stage in range(1, max(self.stages, default=0) + 1):
            reds = [v for v in self.reductions if self.stages[v] == stage]
            if reds:
                self.reduction_stage(reds, phase)
                phase += 1
            self.row_values(stage)
        self.output_pass()
        self.emit(1, "}")
        for c in range(len(self.columns)):
            self.emit(1, "#pragma unroll", f"for (int k = 0; k < {spec.kmax}; ++k) {{",
                      f"  const long long j = tid + k * {spec.block};",
                      f"  if (j < count) ((double*)args.work)[((long long)blockIdx.x * "
                      f"{len(self.columns)} + {c}) * count + j] = c{c}[k];", "}")
        self.emit(0, "}")
        if self.columns:
            self.finish()

    def finish(self) -> None:
        """`<name>_columns`: each column's sum over the groups' partials, stored rounded."""
        name, ncol = self.name, len(self.columns)
        self.emit(0, f'extern "C" __global__ void __launch_bounds__({FINISH_BLOCK}) '
                     f"{name}_columns(const Args_{name} args) {{",
                  "  const long long count = args.count;",
                  "  const double* __restrict__ w = (const double*)args.work;",
                  f"  for (long long j = (long long)blockIdx.x * {FINISH_BLOCK} + threadIdx.x; "
                  f"j < count; j += (long long)gridDim.x * {FINISH_BLOCK}) {{")
        for c, (p, v) in enumerate(self.columns):
            dtype = self.kernel.values[v].dtype
            value = f"t{c}" if dtype == torch.float64 else f"(float)t{c}"
            self.emit(2, f"double t{c} = 0.0;",
                      f"for (long long g = 0; g < args.groups; ++g) "
                      f"t{c} += w[(g * {ncol} + {c}) * count + j];",
                      f"(({CUDA.storage[dtype]}*)args.ptrs[{p}])[j] = {CUDA.store(value, dtype)};")
        self.emit(0, "  }", "}")


def render_rows_body(kernel: ir.RowKernel, spec: RowSpec, name: str = "fulmen_kernel") -> str:
    """The argument struct and entry points of `kernel` for `spec`, without the prelude.

    Raises:
        Unsupported: if an op of the kernel has no CUDA rendering.
    """
    return _Renderer(kernel, spec, name).render() + "\n"


def render_rows(kernel: ir.RowKernel, spec: RowSpec, name: str = "fulmen_kernel") -> str:
    """Complete CUDA source of row kernel `kernel` for `spec`, entry point `name` (and
    `<name>_columns` when the kernel has column sums).

    Raises:
        Unsupported: if an op of the kernel has no CUDA rendering (then the region runs on torch).
    """
    return prelude(*needs_headers(kernel)) + ROW_PRELUDE + render_rows_body(kernel, spec, name)


def _block_for(count: int, most: int) -> int:
    """Threads per block: the power of two nearest above count / PER_THREAD, in [32, most]."""
    block = 32
    while block < most and block * PER_THREAD < count:
        block *= 2
    return block


def plan_rows(kernel: ir.RowKernel, sizes: list[int], nouter: int,
              rows: list[list[int]]) -> RowLaunch:
    """The launch of `kernel` for coalesced `sizes` (`nouter` outer axes, then the inner ones)
    and each pointer's element strides `rows` over them. Depends on the shape and strides only
    (never on the device), so a call's results do not depend on the GPU it runs on.

    Raises:
        NoPlan: column sums over rows longer than COLUMN_BLOCK_MAX * KMAX elements.
    """
    outer, inner = sizes[:nouter], sizes[nouter:]
    nrows, count = math.prod(outer), math.prod(inner)
    contiguous, acc = [], 1
    for size in reversed(inner):
        contiguous.insert(0, acc)
        acc *= size
    classes = tuple(0 if not any(row[nouter:]) else 1 if row[nouter:] == contiguous else 2
                    for row in rows)
    ncol = sum(kernel.output_columns)
    nacc = len(kernel.accesses)
    assert all(classes[nacc + k] == 1 for k, column in enumerate(kernel.output_columns)
               if column), "column outputs are contiguous"
    reach = max(sum((s - 1) * abs(st) for s, st in zip(inner, row[nouter:])) for row in rows)
    index = "int" if count + 2**16 < 2**31 and reach < 2**31 else "long long"
    stages, reductions = ir.row_stages(kernel), _reductions(kernel)
    nphases = len({stages[v] for v in reductions}) + 1
    nred = len(reductions)
    if ncol:
        block = _block_for(count, COLUMN_BLOCK_MAX)
        kmax = max(1, -(-count // block))
        if kmax > KMAX:
            raise NoPlan(f"column sums over rows of {count} elements")
        groups = min(nrows, COLUMN_GROUPS)
        spec = RowSpec(nouter, len(inner), classes, block, False, kmax, index)
        column_grid = max(1, min(-(-count // FINISH_BLOCK), MAX_GRID))
        return RowLaunch(spec, groups, 1, count, 1, groups, 8 * groups * ncol * count,
                         column_grid)
    block = _block_for(count, BLOCK_MAX)
    nsplit = 1
    if count >= LONG_ROW and nrows < TARGET_BLOCKS and nred:
        nsplit = min(-(-count // MIN_CHUNK), -(-TARGET_BLOCKS // nrows))
    chunk = max(1, -(-count // nsplit))
    nsplit = max(1, -(-count // chunk))
    split = nsplit > 1
    spec = RowSpec(nouter, len(inner), classes, block, split, 0, index)
    grid = max(1, min(nrows * nsplit, MAX_GRID))
    return RowLaunch(spec, grid, nsplit, chunk, nphases if split else 1, 0,
                     8 * nrows * nsplit * nred if split else 0, 0)


def pack_rows(launch: RowLaunch, sizes: list[int], rows: list[list[int]],
              addresses: list[int], work: int, phase: int) -> bytes:
    """The argument struct (see the module docstring) of launch `phase` of a row kernel."""
    nouter = launch.spec.nouter
    nrows, count = math.prod(sizes[:nouter]), math.prod(sizes[nouter:])
    flat = [s for row in rows for s in row]
    head = (nrows, count, launch.nsplit, launch.chunk, phase, launch.groups)
    return struct.pack(f"<{len(head) + len(sizes) + len(flat)}q{len(addresses) + 1}Q", *head,
                       *sizes, *flat, *addresses, work)

