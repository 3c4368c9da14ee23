"""C++ renderer of the normalisation schedule: a `RowKernel` -> C++17 source.

    void fulmen_kernel(int64_t ndim, const int64_t* sizes, const int64_t* strides,
                       char* const* ptrs, int64_t nouter, int64_t nthreads)

The first `nouter` axes of `sizes` are the kept axes (one row per point; OpenMP shares rows among
`nthreads` threads), the others the reduced axes (`subrows` times the last, `inner`). Per row:

    row-level values of stage 0 (loads of kept-shape inputs, constants, ops on them)
    for each stage s: one pass over the row accumulating the stage's reductions
                      (`#pragma omp simd reduction` over blocks of BLOCK elements), then the
                      row-level values computed from them
    one pass over the row computing and storing the element-level outputs (and adding the
                      column sums into this thread's float32 partials, which go into its
                      float64 partials every COLUMN_GROUP rows)
    the row-level outputs
    after all rows: the column sums, each the sum of the threads' partials

Element-level values are recomputed in every pass that needs them (a row is small enough to
stay in cache), except one costly value (a chain with a transcendental op, softmax's exp) that
the last reduction pass also computes: that pass stashes it in a float32/float64 element output
at the same index, and the final pass reads it back before overwriting the element with its
own result. That pass, compute-bound, also prefetches the next row's element inputs, so their
memory is read while this row computes (measured: softmax 5% faster; in memory-bound passes,
e.g. layer_norm's, prefetching was 2-7% slower and is not done). Floating sums and products
accumulate in double across blocks (float32 within a block), which keeps long rows as accurate
as eager's cascade summation; float16/bfloat16 are computed in float32 and rounded to their
dtype after each op, as eager does. amax/amin
propagate NaN through a separate flag (an OpenMP max reduction alone would drop it).
"""

from __future__ import annotations

import torch

from fulmen.executors.codegen import ir
from fulmen.executors.codegen.cpu.target import CPU, PRELUDE
from fulmen.executors.codegen.renderer import RowRenderer

__all__ = ["BLOCK", "render_rows"]

BLOCK = 1024  # elements per float32 partial sum
COLUMN_GROUP = 16  # rows per float32 partial column sum


COSTLY = frozenset({"exp", "exp2", "expm1", "log", "log1p", "log2", "erf", "erfc", "tanh",
                    "sigmoid", "sin", "cos", "tan", "atan", "pow", "div"})


def _stash(kernel: ir.RowKernel, previous: list[int], final: list[int], outputs) -> tuple | None:
    """(value, output pointer) to carry from the last reduction pass to the final pass, or None:
    the latest value both passes compute whose chain holds a costly op, and an element output
    whose storage type is that value's compute type."""
    shared = set(previous) & set(final)
    costly = [v for v in sorted(shared)
              if any(isinstance(kernel.values[u], ir.Op) and kernel.values[u].name in COSTLY
                     for u in ir.element_closure(kernel, [v]) if u in shared)]
    if not costly:
        return None
    v = costly[-1]
    dtype = kernel.values[v].dtype
    for p, out in outputs:
        if kernel.values[out].dtype == dtype and dtype in (torch.float32, torch.float64):
            return v, p
    return None


def _nonpositive_exp(kernel: ir.RowKernel, value) -> bool:
    """Whether `value` is a float32 exp of `x - amax(x)` over the row (never positive: NaN when
    x holds a NaN or the row is all inf/-inf), where `f_exp_nonpos` is exact as `f_exp`."""
    if not (isinstance(value, ir.Op) and value.name == "exp" and value.dtype == torch.float32):
        return False
    arg = kernel.values[value.args[0]]
    if not (isinstance(arg, ir.Op) and arg.name == "sub"):
        return False
    top = kernel.values[arg.args[1]]
    return isinstance(top, ir.Reduce) and top.name == "amax" and top.arg == arg.args[0]


_PIECES = ("acc", "part", "clauses", "update", "combine")


def _add(out: dict[str, list[str]], *lines: str) -> None:
    """Add one line to each piece of a reduction (in the order of `_PIECES`)."""
    for piece, line in zip(_PIECES, lines, strict=True):
        out[piece].append(line)


def _reduction(kernel: ir.RowKernel, v: int) -> dict[str, list[str]]:
    """The C++ pieces of reduction value v: declarations before the row pass (acc), before a
    block (part), the OpenMP clauses, the update in the loop, the combine after a block, and
    the final row-level value."""
    red = kernel.values[v]
    x = f"v{red.arg}"
    dtype = kernel.values[red.arg].dtype
    ctype = CPU.compute[dtype]
    is_float = dtype.is_floating_point
    out = {piece: [] for piece in _PIECES}
    if red.name in ("sum", "prod"):
        acc_t = "double" if is_float else "int64_t"
        part_t = ("double" if dtype == torch.float64 else "float") if is_float else "int64_t"
        init, op = ("0", "+") if red.name == "sum" else ("1", "*")
        _add(out, f"{acc_t} a{v} = {init};", f"{part_t} b{v} = {init};",
             f"reduction({op}:b{v})", f"b{v} {op}= {x};", f"a{v} {op}= b{v};")
        result = f"a{v}"
    else:
        is_max = red.name == "amax"
        cmp = ">" if is_max else "<"
        if is_float:
            init = f"{'-' if is_max else ''}std::numeric_limits<{ctype}>::infinity()"
        else:
            init = f"std::numeric_limits<{ctype}>::{'lowest' if is_max else 'max'}()"
        _add(out, f"{ctype} a{v} = {init};", f"{ctype} b{v} = {init};",
             f"reduction({'max' if is_max else 'min'}:b{v})",
             f"b{v} = {x} {cmp} b{v} ? {x} : b{v};", f"a{v} = b{v} {cmp} a{v} ? b{v} : a{v};")
        result = f"a{v}"
        if is_float:
            _add(out, f"int nf{v} = 0;", f"int n{v} = 0;", f"reduction(|:n{v})",
                 f"n{v} |= ({x} != {x});", f"nf{v} |= n{v};")
            result = f"(nf{v} ? std::numeric_limits<{ctype}>::quiet_NaN() : a{v})"
    rtype = CPU.compute[red.dtype]
    out["final"] = [f"const {rtype} v{v} = {CPU.round(CPU.cast(result, red.dtype), red.dtype)};"]
    return out


class _Renderer(RowRenderer):
    """Builds the C++ source of one row kernel for one layout (see `render_rows`)."""

    target = CPU

    def element(self, p: int, element: bool) -> str:
        if self.kernel.access_rows[p]:
            return f"p{p}[0]"
        return f"q{p}[{CPU.index(self.classes[p], p)}]"

    def count(self, ctype: str) -> str:
        return f"({ctype})count"

    def op_value(self, v: int) -> str:
        value = self.kernel.values[v]
        if _nonpositive_exp(self.kernel, value):
            return f"f_exp_nonpos(v{value.args[0]})"
        return super().op_value(v)

    def store(self, v: int) -> str:
        return CPU.store(f"v{v}", self.kernel.values[v].dtype)

    def main(self) -> None:
        kernel, layout, nacc, nptr = self.kernel, self.classes, self.nacc, self.nptr
        columns, lines = self.columns, self.lines
        ncol = len(columns)
        self.skip = {p for p, _ in columns}  # column outputs are written after the rows
        lines += [PRELUDE, "#include <cstdlib>", "#include <omp.h>",
                  'extern "C" void fulmen_kernel(int64_t ndim, const int64_t* sizes, '
                  "const int64_t* strides, char* const* ptrs, int64_t nouter, int64_t nthreads) {",
                  "  int64_t rows = 1;",
                  "  for (int64_t d = 0; d < nouter; ++d) rows *= sizes[d];",
                  "  int64_t subrows = 1;",
                  "  for (int64_t d = nouter; d + 1 < ndim; ++d) subrows *= sizes[d];",
                  "  const int64_t inner = sizes[ndim - 1];",
                  "  const int64_t count = subrows * inner;"]
        args = [kernel.values[v].arg for _, v in columns]
        # float column values add into float partials, flushed into the float64 sums every
        # COLUMN_GROUP rows (a float add per element instead of a conversion and a double add)
        grouped = COLUMN_GROUP > 1 and bool(args) and all(
            CPU.compute[kernel.values[a].dtype] == "float" for a in args)
        if ncol:
            self.emit(1, f"double* colacc = (double*)std::calloc(nthreads * count * {ncol} + 1, 8);")
            if grouped:
                self.emit(1, f"float* colpart = (float*)std::calloc(nthreads * count * {ncol} + 1, 4);")
            self.emit(1, "#pragma omp parallel num_threads(nthreads) if(nthreads > 1)", "{",
                      f"double* cacc = colacc + omp_get_thread_num() * count * {ncol};")
            if grouped:
                self.emit(1, f"float* facc = colpart + omp_get_thread_num() * count * {ncol};",
                          "int64_t pending = 0;")
            self.emit(1, "#pragma omp for schedule(static)")
        else:
            self.emit(1, "#pragma omp parallel for num_threads(nthreads) schedule(static) "
                         "if(nthreads > 1)")
        self.emit(1, "for (int64_t row = 0; row < rows; ++row) {")
        self.emit(2, f"int64_t off[{nptr}] = {{0}};", "int64_t r = row;",
                  "for (int64_t d = nouter - 1; d >= 0; --d) {",
                  "  const int64_t i = r % sizes[d];", "  r /= sizes[d];",
                  f"  for (int p = 0; p < {nptr}; ++p) off[p] += i * strides[p * ndim + d];", "}")
        # the next row's element inputs are prefetched during a costly last reduction pass (see
        # the module docstring)
        self.fetch = [p for p in range(nacc) if layout[p] == 1 and not self.ptr_rows[p]]
        if self.fetch:
            self.emit(2, f"int64_t ahead[{nptr}] = {{0}};", "if (row + 1 < rows) {",
                      "  int64_t r1 = row + 1;", "  for (int64_t d = nouter - 1; d >= 0; --d) {",
                      "    const int64_t i = r1 % sizes[d];", "    r1 /= sizes[d];",
                      f"    for (int p = 0; p < {nptr}; ++p) ahead[p] += i * strides[p * ndim + d];",
                      "  }", f"  for (int p = 0; p < {nptr}; ++p) ahead[p] -= off[p];", "}")
        for p, dtype in enumerate(self.dtypes):
            if p in self.skip:
                continue
            const = "const " if p < nacc else ""
            ctype = CPU.storage[dtype]
            self.emit(2, f"{const}{ctype}* __restrict__ p{p} = ({const}{ctype}*)ptrs[{p}] + off[{p}];")
            if layout[p] == 2 and not self.ptr_rows[p]:
                self.emit(2, f"const int64_t s{p} = strides[{p} * ndim + ndim - 1];")
        element_outputs = self.stages_and_outputs(args)
        self.output_pass(element_outputs, args, grouped)
        for k, v in enumerate(kernel.outputs):
            if kernel.rows[v]:
                self.emit(2, f"p{nacc + k}[0] = {self.store(v)};")
        flush = (f"for (int64_t i = 0; i < count * {ncol}; ++i) {{ cacc[i] += facc[i]; facc[i] = 0; }}"
                 " pending = 0;")
        if grouped:
            self.emit(2, f"if (++pending == {COLUMN_GROUP}) {{ {flush} }}")
        self.emit(1, "}")
        if grouped:
            self.emit(1, f"if (pending) {{ {flush} }}")
        if ncol:
            self.column_sums(grouped)
        lines += ["}", ""]

    def stages_and_outputs(self, args: list[int]) -> list[tuple[int, int]]:
        """The row values and reduction passes of every stage; the element outputs."""
        kernel, stages = self.kernel, self.stages
        self.row_values(0)
        element_outputs = [(self.nacc + k, v) for k, v in enumerate(kernel.outputs)
                           if not kernel.rows[v] and self.nacc + k not in self.skip]
        final = ir.element_closure(kernel, [v for _, v in element_outputs] + args)
        last_stage = max((stages[v] for v, value in enumerate(kernel.values)
                          if isinstance(value, ir.Reduce)), default=0)
        self.stash = None
        for stage in range(1, max(stages, default=0) + 1):
            reds = [v for v, value in enumerate(kernel.values)
                    if isinstance(value, ir.Reduce) and stages[v] == stage]
            if not reds:
                self.row_values(stage)
                continue
            pieces = [_reduction(kernel, v) for v in reds]
            for piece in pieces:
                self.emit(2, *piece["acc"])
            previous = ir.element_closure(kernel, [kernel.values[v].arg for v in reds])
            body = [self.value_line(v) for v in previous]
            if stage == last_stage and all(self.classes[p] == 1 for p, _ in element_outputs):
                self.stash = _stash(kernel, previous, final, element_outputs)
                if self.stash is not None:
                    body.append(f"q{self.stash[1]}[j] = v{self.stash[0]};")
            body += [line for piece in pieces for line in piece["update"]]
            self.row_pass(body, ([line for piece in pieces for line in piece["part"]],
                                 [c for piece in pieces for c in piece["clauses"]],
                                 [line for piece in pieces for line in piece["combine"]]),
                          prefetch=stage == last_stage and self.stash is not None)
            for piece in pieces:
                self.emit(2, *piece["final"])
            self.row_values(stage)
        return element_outputs

    def output_pass(self, element_outputs, args: list[int], grouped: bool) -> None:
        """The pass computing and storing the element outputs and adding the column sums."""
        kernel, stash = self.kernel, self.stash
        if not (element_outputs or self.columns):
            return
        leaves = {stash[0]} if stash else set()
        body = []
        for v in ir.element_closure(kernel, [v for _, v in element_outputs] + args, leaves):
            if v in leaves:
                body.append(f"const {CPU.compute[kernel.values[v].dtype]} v{v} = q{stash[1]}[j];")
            else:
                body.append(self.value_line(v))
        body += [f"q{p}[{CPU.index(self.classes[p], p)}] = {self.store(v)};"
                 for p, v in element_outputs]
        acc = "facc" if grouped else "cacc"
        body += [f"{acc}[{c} * count + sub * inner + j] += {'' if grouped else '(double)'}v{arg};"
                 for c, arg in enumerate(args)]
        self.row_pass(body, None)

    def row_pass(self, body: list[str], blocked: tuple | None, prefetch: bool = False) -> None:
        """A loop over the row's elements: `body` inside the simd loop; with `blocked` (the
        reduction pieces) the loop runs in blocks with partial accumulators."""
        nptr, nacc = self.nptr, self.nacc
        self.emit(2, "for (int64_t sub = 0; sub < subrows; ++sub) {",
                  f"  int64_t so[{nptr}] = {{0}};", "  int64_t rs = sub;",
                  "  for (int64_t d = ndim - 2; d >= nouter; --d) {",
                  "    const int64_t i = rs % sizes[d];", "    rs /= sizes[d];",
                  f"    for (int p = 0; p < {nptr}; ++p) so[p] += i * strides[p * ndim + d];",
                  "  }")
        for p, dtype in enumerate(self.dtypes):
            if not self.ptr_rows[p] and p not in self.skip:
                const = "const " if p < nacc else ""
                self.emit(3, f"{const}{CPU.storage[dtype]}* __restrict__ q{p} = p{p} + so[{p}];")
        if blocked is None:
            self.emit(3, "#pragma omp simd", "for (int64_t j = 0; j < inner; ++j) {")
            self.emit(4, *body)
            self.emit(3, "}")
        else:
            parts, clauses, combine = blocked
            self.emit(3, f"for (int64_t jb = 0; jb < inner; jb += {BLOCK}) {{")
            self.emit(4, f"const int64_t je = inner < jb + {BLOCK} ? inner : jb + {BLOCK};", *parts)
            for p in self.fetch if prefetch else ():
                step = 64 // torch.empty((), dtype=self.dtypes[p]).element_size()
                self.emit(4, f"if (ahead[{p}] != 0) for (int64_t o = jb; o < je; o += {step}) "
                             f"__builtin_prefetch(q{p} + ahead[{p}] + o, {int(p >= nacc)}, 3);")
            self.emit(4, f"#pragma omp simd {' '.join(clauses)}",
                      "for (int64_t j = jb; j < je; ++j) {")
            self.emit(5, *body)
            self.emit(4, "}", *combine)
            self.emit(3, "}")
        self.emit(2, "}")

    def column_sums(self, grouped: bool) -> None:
        """After all rows: each column sum, the sum of the threads' float64 partials."""
        ncol = len(self.columns)
        self.emit(1, "}", "for (int64_t col = 0; col < count; ++col) {")
        self.emit(2, "int64_t rs = col / inner;", "const int64_t j = col % inner;")
        for c, (p, v) in enumerate(self.columns):
            dtype = self.kernel.values[v].dtype
            value = CPU.store(f"(float)t{c}" if dtype != torch.float64 else f"t{c}", dtype)
            self.emit(2, f"int64_t o{p} = j * strides[{p} * ndim + ndim - 1];",
                      f"double t{c} = 0;",
                      f"for (int64_t th = 0; th < nthreads; ++th) "
                      f"t{c} += colacc[(th * {ncol} + {c}) * count + col];",
                      f"{{ int64_t r2 = rs; for (int64_t d = ndim - 2; d >= nouter; --d) "
                      f"{{ o{p} += (r2 % sizes[d]) * strides[{p} * ndim + d]; r2 /= sizes[d]; }} }}",
                      f"(({CPU.storage[dtype]}*)ptrs[{p}])[o{p}] = {value};")
        self.emit(1, "}", "std::free(colacc);")
        if grouped:
            self.emit(1, "std::free(colpart);")


def render_rows(kernel: ir.RowKernel, layout: tuple[int, ...]) -> str:
    """C++ source of `kernel` for inner-stride classes `layout` (one per access, then output:
    1 contiguous, 0 broadcast, 2 any stride)."""
    return _Renderer(kernel, layout).render()
