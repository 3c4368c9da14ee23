"""The CPU pointwise renderer: a `Kernel` -> C++17 source with one `extern "C"` entry point.

    void fulmen_kernel(int64_t ndim, const int64_t* sizes, const int64_t* strides,
                       char* const* ptrs, int64_t block, int64_t nthreads)

`strides` holds one row of `ndim` element strides per pointer (accesses, then outputs); after
the pointers, `ptrs` holds the bits of one double per run-time float argument
(`Kernel.scalars`, NOTE [run-time floats as kernel arguments] in `lower.py`). The
iteration space is split into rows (all dims but the last) and blocks of `block` elements of
the last dim; OpenMP shares tasks among `nthreads` threads. The inner loop is a
`#pragma omp simd` loop; its addressing is specialised on each pointer's inner-stride class
(`layout`: 1 contiguous, 0 broadcast, 2 any stride), so the compiled kernel serves every shape
and stride of that layout.

NOTE [rows walked in spans]: a task is one block of a span of consecutive rows along the
next-to-last dim (`mid`); the task finds its first row's offsets with a division per outer dim,
then steps each pointer by its stride along `mid` from row to row. Finding every row's offsets
by divisions cost more than the elements of a short row: a rotary kernel over (2, 4, 64, 16)
with 12 pointers took 70 µs, 30 µs in spans (14 µs for the same elements in one flat loop).
One thread takes whole runs of `mid` rows; with more threads and fewer than 4 tasks per thread,
runs are cut into spans so that every thread has work.

Values are spelled by the CPU target (`target.py`: storage and compute types, rounding of
float16/bfloat16 after each op, the prelude's helpers). A Python number exponent of a float32
`pow` stays a double, as in eager's CPU kernel.
"""

from __future__ import annotations

from fulmen.executors.codegen.cpu.target import CPU, PRELUDE
from fulmen.executors.codegen.ir import Const, Kernel, Load, Scalar

__all__ = ["render"]


def render(kernel: Kernel, layout: tuple[int, ...]) -> str:
    """C++ source of `kernel` for inner-stride classes `layout` (one per access, then output)."""
    nptr = len(kernel.accesses) + len(kernel.outputs)
    assert len(layout) == nptr
    lines = [PRELUDE, 'extern "C" void fulmen_kernel(int64_t ndim, const int64_t* sizes, '
             "const int64_t* strides, char* const* ptrs, int64_t block, int64_t nthreads) {",
             "  const int64_t inner = sizes[ndim - 1];",
             "  const int64_t mid = ndim >= 2 ? sizes[ndim - 2] : 1;",
             "  int64_t runs = 1;",
             "  for (int64_t d = 0; d + 2 < ndim; ++d) runs *= sizes[d];",
             "  const int64_t nblocks = (inner + block - 1) / block;",
             "  int64_t nspans = 1;  // NOTE [rows walked in spans]",
             "  if (nthreads > 1 && runs * nblocks < 4 * nthreads) {",
             "    nspans = (4 * nthreads + runs * nblocks - 1) / (runs * nblocks);",
             "    nspans = nspans < mid ? nspans : mid;",
             "  }",
             "  const int64_t span = (mid + nspans - 1) / nspans;",
             "  nspans = (mid + span - 1) / span;",
             *[f"  double sc{k};\n  std::memcpy(&sc{k}, ptrs + {nptr + k}, sizeof(double));"
               for k in range(len(kernel.scalars))],
             "  #pragma omp parallel for num_threads(nthreads) schedule(static) if(nthreads > 1)",
             "  for (int64_t task = 0; task < runs * nspans * nblocks; ++task) {",
             "    const int64_t j0 = (task % nblocks) * block;",
             "    const int64_t j1 = inner < j0 + block ? inner : j0 + block;",
             "    const int64_t i0 = (task / nblocks % nspans) * span;",
             "    const int64_t i1 = mid < i0 + span ? mid : i0 + span;",
             f"    int64_t off[{nptr}] = {{0}};",
             "    int64_t r = task / nblocks / nspans;",
             "    for (int64_t d = ndim - 3; d >= 0; --d) {",
             "      const int64_t i = r % sizes[d];",
             "      r /= sizes[d];",
             f"      for (int p = 0; p < {nptr}; ++p) off[p] += i * strides[p * ndim + d];",
             "    }"]
    dtypes = list(kernel.access_dtypes) + list(kernel.output_dtypes)
    for p, dtype in enumerate(dtypes):
        const = "const " if p < len(kernel.accesses) else ""
        ctype = CPU.storage[dtype]
        lines.append(f"    const int64_t m{p} = ndim >= 2 ? strides[{p} * ndim + ndim - 2] : 0;")
        lines.append(f"    {const}{ctype}* __restrict__ p{p} = ({const}{ctype}*)ptrs[{p}] + off[{p}]"
                     f" + i0 * m{p};")
        if layout[p] == 2:
            lines.append(f"    const int64_t s{p} = strides[{p} * ndim + ndim - 1];")
    lines.append("    for (int64_t i = i0; i < i1; ++i) {")
    lines.append("      #pragma omp simd")
    lines.append("      for (int64_t j = j0; j < j1; ++j) {")
    names: list[str] = []
    for v, value in enumerate(kernel.values):
        name = f"v{v}"
        ctype = CPU.compute[value.dtype]
        if isinstance(value, Load):
            expr = f"p{value.access}[{CPU.index(layout[value.access], value.access)}]"
            expr = CPU.load(expr, value.dtype)
            if value.mask is not None:  # read only inside the operand (pad, cat)
                expr = f"({names[value.mask]} ? {expr} : {CPU.literal(0, value.dtype)})"
        elif isinstance(value, Const):
            expr = CPU.literal(value.value, value.dtype)
        elif isinstance(value, Scalar):  # rounded to the dtype, as eager casts a number
            expr = f"({ctype})sc{kernel.scalars.index(value.input)}"
        else:
            expr = CPU.value(kernel, value, names)
        lines.append(f"        const {ctype} {name} = {expr};")
        names.append(name)
    for k, v in enumerate(kernel.outputs):
        p = len(kernel.accesses) + k
        dtype = kernel.values[v].dtype
        value = CPU.store(names[v], dtype)
        lines.append(f"        p{p}[{CPU.index(layout[p], p)}] = {value};")
    lines.append("      }")
    lines += [f"      p{p} += m{p};" for p in range(nptr)]
    lines += ["    }", "  }", "}", ""]
    return "\n".join(lines)
