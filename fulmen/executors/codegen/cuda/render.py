"""The CUDA pointwise renderer: a `Kernel` -> CUDA C++ source for NVRTC (see `nvrtc.py`); the
row schedule (reductions, normalisations) is rendered by `rows.py`. Values are spelled by the
CUDA target (`target.py`).

One `extern "C" __global__` entry point per kernel, taking one struct argument by value:

    struct Args { long long numel; long long sizes[NDIM]; long long strides[NPTR][NDIM];
                  void* ptrs[NPTR]; };

`strides` holds one row of element strides per pointer (accesses, then outputs). A kernel is
rendered for a `Spec`, the layout class it serves (every shape and stride of that class):

- `ndim`: the rank of the iteration space after the runtime coalesced it (1 when contiguous);
- `classes`: per pointer, 1 contiguous (element i is at offset i), 0 one element broadcast
  everywhere, 2 any strides (offsets from the coordinates of i, a div/mod per dim);
- `vec`: elements per thread and step; above 1 (pointers contiguous or broadcast, and aligned
  to `vec` elements, which the runtime checks) contiguous pointers are read and written with
  one vector access of up to 16 bytes, and a scalar loop finishes the tail;
- `index`: "int" when every offset fits in 32 bits, else "long long".

Every kernel is a grid-stride loop, so any grid size covers any numel. float16/bfloat16 are
loaded and stored as `__half`/`__nv_bfloat16` (`cuda_fp16.h`/`cuda_bf16.h`) and computed in
float32; each float16/bfloat16 result is rounded to its dtype, as eager rounds after every op.
IEEE semantics are kept (no fast math; `nvrtc.py` compiles with `--fmad=false` so a * b + c is
two rounded operations, as eager computes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fulmen.executors.codegen.cuda.target import CUDA, needs_headers, prelude
from fulmen.executors.codegen.ir import Const, Kernel, Load
from fulmen.executors.codegen.target import live_values

__all__ = ["BLOCK", "Spec", "render", "render_body", "vector_width"]

BLOCK = 256  # threads per block of every pointwise kernel


@dataclass(frozen=True)
class Spec:
    """The layout class a rendered kernel serves (see the module docstring)."""

    ndim: int
    classes: tuple[int, ...]
    vec: int = 1
    index: str = "int"


def render(kernel: Kernel, spec: Spec, name: str = "fulmen_kernel") -> str:
    """Complete CUDA source of `kernel` for `spec`, entry point `name`.

    Raises:
        Unsupported: if an op of the kernel has no CUDA rendering (then nothing is fused).
    """
    return prelude(*needs_headers(kernel)) + render_body(kernel, spec, name)


def render_body(kernel: Kernel, spec: Spec, name: str = "fulmen_kernel") -> str:
    """The kernel's argument struct and entry point, without the prelude (several bodies may
    share one prelude in one program)."""
    nptr = len(kernel.accesses) + len(kernel.outputs)
    assert len(spec.classes) == nptr
    dtypes = list(kernel.access_dtypes) + list(kernel.output_dtypes)
    idx, nd, vec = spec.index, spec.ndim, spec.vec
    lines = [f"struct Args_{name} {{",
             f"  long long numel; long long sizes[{nd}]; long long strides[{nptr}][{nd}];",
             f"  void* ptrs[{nptr}];", "};"]
    if vec > 1:
        for p, dtype in enumerate(dtypes):
            if spec.classes[p] == 1:
                size = vec * dtype.itemsize
                lines.append(f"struct __align__({size}) Vec{p}_{name} {{ {CUDA.storage[dtype]} "
                             f"v[{vec}]; }};")
    lines += [f'extern "C" __global__ void __launch_bounds__({BLOCK}) {name}(const Args_{name} '
              "args) {",
              f"  const {idx} n = ({idx})args.numel;",
              f"  const {idx} step = ({idx})gridDim.x * blockDim.x;",
              f"  const {idx} first = ({idx})blockIdx.x * blockDim.x + threadIdx.x;"]
    for p, dtype in enumerate(dtypes):
        const = "const " if p < len(kernel.accesses) else ""
        lines.append(f"  {const}{CUDA.storage[dtype]}* __restrict__ p{p} = "
                     f"({const}{CUDA.storage[dtype]}*)args.ptrs[{p}];")
    body = _element_body(kernel, spec, dtypes)
    if vec > 1:
        lines += [f"  const {idx} nvec = n / {vec};",
                  f"  for ({idx} i = first; i < nvec; i += step) {{"]
        for p in range(len(kernel.accesses)):
            if spec.classes[p] == 1:
                lines.append(f"    const Vec{p}_{name} in{p} = "
                             f"reinterpret_cast<const Vec{p}_{name}*>(p{p})[i];")
        for p in range(len(kernel.accesses), nptr):
            lines.append(f"    Vec{p}_{name} out{p};")
        lines += ["    #pragma unroll", f"    for (int k = 0; k < {vec}; ++k) {{"]
        lines += ["      " + line for line in body(vector=True)]
        lines.append("    }")
        for p in range(len(kernel.accesses), nptr):
            lines.append(f"    reinterpret_cast<Vec{p}_{name}*>(p{p})[i] = out{p};")
        lines += ["  }", f"  for ({idx} i = nvec * {vec} + first; i < n; i += step) {{"]
    else:
        lines.append(f"  for ({idx} i = first; i < n; i += step) {{")
    if any(c == 2 for c in spec.classes):
        strided = [p for p, c in enumerate(spec.classes) if c == 2]
        lines.append("    " + " ".join(f"{idx} o{p} = 0;" for p in strided))
        lines += [f"    {idx} r = i;", "    #pragma unroll",
                  f"    for (int d = {nd - 1}; d >= 0; --d) {{",
                  f"      const {idx} size = ({idx})args.sizes[d];",
                  f"      const {idx} c = d == 0 ? r : r % size;",
                  "      r /= size;"]
        lines += [f"      o{p} += c * ({idx})args.strides[{p}][d];" for p in strided]
        lines.append("    }")
    lines += ["    " + line for line in body(vector=False)]
    lines += ["  }", "}", ""]
    return "\n".join(lines)


def _element_body(kernel: Kernel, spec: Spec, dtypes: list[torch.dtype]):
    """A function rendering the statements computing one element (vector lane k, or index i)."""
    naccess = len(kernel.accesses)

    def where(p: int, vector: bool) -> str:
        kind = spec.classes[p]
        if kind == 0:
            return f"p{p}[0]"
        if kind == 2:
            return f"p{p}[o{p}]"
        if vector:
            return f"in{p}.v[k]" if p < naccess else f"out{p}.v[k]"
        return f"p{p}[i]"

    live = live_values(kernel)

    def body(vector: bool) -> list[str]:
        lines, names = [], []
        for v, value in enumerate(kernel.values):
            names.append(f"v{v}")
            if v not in live:
                continue
            ctype = CUDA.compute[value.dtype]
            if isinstance(value, Load):
                expr = CUDA.load(where(value.access, vector), value.dtype)
            elif isinstance(value, Const):
                expr = CUDA.literal(value.value, value.dtype)
            else:
                expr = CUDA.value(kernel, value, names)
            lines.append(f"const {ctype} v{v} = {expr};")
        for k, v in enumerate(kernel.outputs):
            p = naccess + k
            lines.append(f"{where(p, vector)} = {CUDA.store(names[v], dtypes[p])};")
        return lines

    return body


def vector_width(kernel: Kernel, classes: tuple[int, ...]) -> int:
    """Elements per vector access for a kernel whose pointers have `classes` (1 when some
    pointer is strided): 16 bytes for the widest contiguous pointer, at most 8 elements."""
    if any(c == 2 for c in classes) or 1 not in classes:
        return 1
    dtypes = list(kernel.access_dtypes) + list(kernel.output_dtypes)
    widest = max(d.itemsize for d, c in zip(dtypes, classes) if c == 1)
    return max(1, min(8, 16 // widest))
