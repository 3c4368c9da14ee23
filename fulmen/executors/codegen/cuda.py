"""CUDA renderer: a pointwise `Kernel` -> CUDA C++ source for NVRTC (see `nvrtc.py`); the
row schedule (reductions, normalisations) is rendered by `cuda_rows.py` with these helpers.

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

import math
from dataclasses import dataclass

import torch

from fulmen.core import BoundSymbol
from fulmen.executors.codegen.ir import Const, Kernel, Load, Op
from fulmen.executors.codegen.lower import (
    REDUCTIONS,
    Unsupported,
    _fusible_reduction,
    pointwise_fusible,
)  # fmt: skip

BLOCK = 256  # threads per block of every pointwise kernel

STORAGE = {
    torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float",
    torch.float64: "double", torch.int8: "signed char", torch.int16: "short",
    torch.int32: "int", torch.int64: "long long", torch.uint8: "unsigned char",
    torch.bool: "bool",
}  # fmt: skip
COMPUTE = {**STORAGE, torch.float16: "float", torch.bfloat16: "float"}

PRELUDE = r"""
#define FM_INF_F __int_as_float(0x7f800000)
#define FM_INF_D __longlong_as_double(0x7ff0000000000000LL)
__device__ __forceinline__ float fm_fmod(float a, float b) { return fmodf(a, b); }
__device__ __forceinline__ double fm_fmod(double a, double b) { return fmod(a, b); }
__device__ __forceinline__ float fm_floor(float a) { return floorf(a); }
__device__ __forceinline__ double fm_floor(double a) { return floor(a); }
__device__ __forceinline__ float fm_copysign(float a, float b) { return copysignf(a, b); }
__device__ __forceinline__ double fm_copysign(double a, double b) { return copysign(a, b); }
__device__ __forceinline__ bool fm_isinf(float a) { return fabsf(a) == FM_INF_F; }
__device__ __forceinline__ bool fm_isinf(double a) { return fabs(a) == FM_INF_D; }
__device__ __forceinline__ bool fm_isfinite(float a) { return fabsf(a) < FM_INF_F; }
__device__ __forceinline__ bool fm_isfinite(double a) { return fabs(a) < FM_INF_D; }
__device__ __forceinline__ bool fm_signbit(float a) { return __float_as_int(a) < 0; }
__device__ __forceinline__ bool fm_signbit(double a) { return __double_as_longlong(a) < 0; }
// NaN from either side; on a tie the first operand (clamp/relu keep the input's -0.0)
template <typename T> __device__ __forceinline__ T fm_max(T a, T b) {
  return (a >= b || a != a) ? a : b;
}
template <typename T> __device__ __forceinline__ T fm_min(T a, T b) {
  return (a <= b || a != a) ? a : b;
}
template <typename T> __device__ __forceinline__ T fm_sign(T a) {
  return (T)((T(0) < a) - (a < T(0)));
}
template <typename T> __device__ __forceinline__ T fm_remainder(T a, T b) {
  T m = fm_fmod(a, b);
  if (m != 0 && ((b < 0) != (m < 0))) m += b;
  return m;
}
template <typename T> __device__ __forceinline__ T fm_floor_div(T a, T b) {
  if (b == 0) return a / b;
  T m = fm_fmod(a, b);
  T d = (a - m) / b;
  if (m != 0 && ((b < 0) != (m < 0))) d -= 1;
  if (d != 0) {
    T f = fm_floor(d);
    if (d - f > T(0.5)) f += 1;
    return f;
  }
  return fm_copysign(T(0), a / b);
}
"""
_HALF = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ float fm_f16_round(float a) { return __half2float(__float2half_rn(a)); }
"""
_BFLOAT = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ float fm_bf16_round(float a) {
  return __bfloat162float(__float2bfloat16_rn(a));
}
"""

# name -> (float function, double function) of the CUDA math library.
_MATH = {name: (f"{name}f", name) for name in (
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "sin", "cos", "tan", "asin",
    "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "floor",
    "ceil", "trunc", "fmod", "pow", "atan2", "copysign")}  # fmt: skip
_MATH.update({"abs": ("fabsf", "fabs"), "round": ("rintf", "rint")})
_FLOAT_UNARY = {
    "rsqrt": "({one} / {sqrt}({a}))", "reciprocal": "({one} / {a})", "neg": "(-{a})",
    "isnan": "({a} != {a})", "isinf": "fm_isinf({a})", "isfinite": "fm_isfinite({a})",
    "signbit": "fm_signbit({a})", "sign": "fm_sign({a})", "logical_not": "({a} == 0)",
}  # fmt: skip
_INT_UNARY = {
    "neg": "(-{a})", "abs": "({a} < 0 ? -{a} : {a})", "floor": "{a}", "ceil": "{a}",
    "round": "{a}", "trunc": "{a}", "isnan": "false", "isinf": "false", "isfinite": "true",
    "signbit": "({a} < 0)", "bitwise_not": "(~{a})", "sign": "fm_sign({a})",
    "logical_not": "({a} == 0)",
}  # fmt: skip
_BOOL_UNARY = {"isnan": "false", "isinf": "false", "isfinite": "true", "signbit": "false",
               "bitwise_not": "(!{a})", "logical_not": "(!{a})", "abs": "{a}", "neg": "{a}"}
_BINARY = {
    "add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})", "div": "({a} / {b})",
    "remainder": "fm_remainder({a}, {b})", "floor_div": "fm_floor_div({a}, {b})",
    "trunc_div": "{trunc}({a} / {b})", "maximum": "fm_max({a}, {b})",
    "minimum": "fm_min({a}, {b})", "bitwise_and": "({a} & {b})", "bitwise_or": "({a} | {b})",
    "bitwise_xor": "({a} ^ {b})", "eq": "({a} == {b})", "ne": "({a} != {b})",
    "lt": "({a} < {b})", "le": "({a} <= {b})", "gt": "({a} > {b})", "ge": "({a} >= {b})",
}  # fmt: skip
_BOOL_BINARY = {"add": "({a} || {b})", "mul": "({a} && {b})", "maximum": "({a} || {b})",
                "minimum": "({a} && {b})"}  # fmt: skip
# torch computes x ** c for these constant exponents without pow.
_POW_CONST = {2.0: "({a} * {a})", 3.0: "({a} * {a} * {a})", 0.5: "{sqrt}({a})",
              -0.5: "({one} / {sqrt}({a}))", -1.0: "({one} / {a})",
              -2.0: "({one} / ({a} * {a}))", 1.0: "{a}"}  # fmt: skip


def fusible(bsym: BoundSymbol) -> bool:
    """Whether the codegen executor can put `bsym` into a CUDA fusion region: the prims and
    dtype rules of `lower.fusible` (elementwise prims, views, and the reductions of the row
    schedule, rendered by `cuda_rows.py`), with every tensor on one CUDA device."""
    sym = bsym.sym
    if not sym.is_prim or bsym.kwargs:
        return False
    tensors = [a for a in bsym.args if isinstance(a, torch.Tensor)]
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return False
    if len({t.device for t in tensors}) != 1:
        return False
    if sym.name in REDUCTIONS:
        return _fusible_reduction(bsym)
    return pointwise_fusible(bsym)


@dataclass(frozen=True)
class Spec:
    """The layout class a rendered kernel serves (see the module docstring)."""

    ndim: int
    classes: tuple[int, ...]
    vec: int = 1
    index: str = "int"


def literal(value, dtype: torch.dtype) -> str:
    """A CUDA C++ literal of `value` in the compute type of `dtype`."""
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        value = float(value)
        double = dtype == torch.float64
        if math.isnan(value):
            return "__longlong_as_double(0x7ff8000000000000LL)" if double else \
                "__int_as_float(0x7fc00000)"
        if math.isinf(value):
            sign = "" if value > 0 else "-"
            return f"({sign}FM_INF_D)" if double else f"({sign}FM_INF_F)"
        return f"({value.hex()})" if double else f"({value.hex()}f)"
    value = int(value)
    if value == -(2**63):
        return "(-9223372036854775807LL - 1LL)"
    return f"(({COMPUTE[dtype]}){value}LL)"


def _expr(kernel: Kernel, op: Op, names: list[str]) -> str:
    arg_dtype = kernel.values[op.args[0]].dtype if op.args else op.dtype
    a = names[op.args[0]] if op.args else ""
    b = names[op.args[1]] if len(op.args) > 1 else ""
    name = op.name
    if name == "convert_element_type":
        if op.dtype == torch.bool:
            return f"({a} != 0)"
        if op.dtype == torch.uint8 and arg_dtype.is_floating_point:
            return f"((unsigned char)(long long){a})"  # through int64, as c10's cast to uint8
        return f"(({COMPUTE[op.dtype]}){a})"
    if name == "where":
        return f"({a} ? {b} : {names[op.args[2]]})"
    if arg_dtype == torch.bool:
        template = _BOOL_UNARY.get(name) if len(op.args) == 1 else _BOOL_BINARY.get(name)
        if template is None and name in _BINARY and name not in _FLOAT_BINARY_ONLY:
            template = _BINARY[name]
        if template is None:
            raise Unsupported(f"{name} on bool")
        return template.format(a=a, b=b)
    if not arg_dtype.is_floating_point:
        if len(op.args) == 1 and name in _INT_UNARY:
            return _INT_UNARY[name].format(a=a)
        if len(op.args) == 2 and name in _BINARY and name not in _FLOAT_BINARY_ONLY:
            return _BINARY[name].format(a=a, b=b)
        raise Unsupported(f"{name} on {arg_dtype}")
    fns = {key: pair[arg_dtype == torch.float64] for key, pair in _MATH.items()}
    one = literal(1, arg_dtype)
    if name == "pow" and _const_exponent(kernel, op):
        exponent = float(kernel.values[op.args[1]].value)
        return _POW_CONST[exponent].format(a=a, one=one, sqrt=fns["sqrt"])
    if name == "pow" and kernel.values[op.args[1]].dtype != arg_dtype:
        # a float64 number exponent of a float32 base (`lower.number_dtype`): eager's CUDA kernel
        # reads the exponent as the base's type, unlike its CPU kernel
        return f"{fns['pow']}({a}, ({COMPUTE[arg_dtype]}){b})"
    if len(op.args) == 1:
        if name in _FLOAT_UNARY:
            return _FLOAT_UNARY[name].format(a=a, one=one, sqrt=fns["sqrt"])
        if name in fns:
            return f"{fns[name]}({a})"
    elif name in _BINARY:
        return _BINARY[name].format(a=a, b=b, trunc=fns["trunc"])
    elif name in fns:
        return f"{fns[name]}({a}, {b})"
    raise Unsupported(f"{name} on {arg_dtype}")


_FLOAT_BINARY_ONLY = frozenset({"div", "remainder", "floor_div", "trunc_div"})


def loaded(expr: str, dtype: torch.dtype) -> str:
    """A stored element `expr` of `dtype` as its compute type (half types widen to float)."""
    if dtype == torch.float16:
        return f"__half2float({expr})"
    if dtype == torch.bfloat16:
        return f"__bfloat162float({expr})"
    return expr


def needs_headers(kernel: Kernel) -> tuple[bool, bool]:
    """Whether `kernel` touches float16, bfloat16 (and so includes their headers)."""
    dtypes = {v.dtype for v in kernel.values} | set(kernel.access_dtypes)
    dtypes |= {op.params[0] for op in kernel.values if isinstance(op, Op) and op.params
               and isinstance(op.params[0], torch.dtype)}
    return torch.float16 in dtypes, torch.bfloat16 in dtypes


def prelude(half: bool, bfloat: bool) -> str:
    """The helpers every kernel uses, plus the float16/bfloat16 headers when asked for."""
    return (_HALF if half else "") + (_BFLOAT if bfloat else "") + PRELUDE


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
                lines.append(f"struct __align__({size}) Vec{p}_{name} {{ {STORAGE[dtype]} "
                             f"v[{vec}]; }};")
    lines += [f'extern "C" __global__ void __launch_bounds__({BLOCK}) {name}(const Args_{name} '
              "args) {",
              f"  const {idx} n = ({idx})args.numel;",
              f"  const {idx} step = ({idx})gridDim.x * blockDim.x;",
              f"  const {idx} first = ({idx})blockIdx.x * blockDim.x + threadIdx.x;"]
    for p, dtype in enumerate(dtypes):
        const = "const " if p < len(kernel.accesses) else ""
        lines.append(f"  {const}{STORAGE[dtype]}* __restrict__ p{p} = "
                     f"({const}{STORAGE[dtype]}*)args.ptrs[{p}];")
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

    live = _live_values(kernel)

    def body(vector: bool) -> list[str]:
        lines, names = [], []
        for v, value in enumerate(kernel.values):
            names.append(f"v{v}")
            if v not in live:
                continue
            ctype = COMPUTE[value.dtype]
            if isinstance(value, Load):
                expr = loaded(where(value.access, vector), value.dtype)
            elif isinstance(value, Const):
                expr = literal(value.value, value.dtype)
            else:
                expr = f"(({ctype}){_expr(kernel, value, names)})"
                if value.dtype == torch.float16:
                    expr = f"fm_f16_round({expr})"
                elif value.dtype == torch.bfloat16:
                    expr = f"fm_bf16_round({expr})"
            lines.append(f"const {ctype} v{v} = {expr};")
        for k, v in enumerate(kernel.outputs):
            p = naccess + k
            value = names[v]
            if dtypes[p] == torch.float16:
                value = f"__float2half_rn({value})"
            elif dtypes[p] == torch.bfloat16:
                value = f"__float2bfloat16_rn({value})"
            lines.append(f"{where(p, vector)} = {value};")
        return lines

    return body


def _live_values(kernel: Kernel) -> set[int]:
    """Values an output depends on (a constant exponent rendered as `x * x` is not one)."""
    live = set(kernel.outputs)
    for v in range(len(kernel.values) - 1, -1, -1):
        value = kernel.values[v]
        if v in live and isinstance(value, Op):
            args = value.args
            if value.name == "pow" and len(args) == 2 and _const_exponent(kernel, value):
                args = args[:1]
            live.update(args)
    return live


def _const_exponent(kernel: Kernel, op: Op) -> bool:
    const = kernel.values[op.args[1]]
    return (isinstance(const, Const) and kernel.values[op.args[0]].dtype.is_floating_point
            and float(const.value) in _POW_CONST)


def vector_width(kernel: Kernel, classes: tuple[int, ...]) -> int:
    """Elements per vector access for a kernel whose pointers have `classes` (1 when some
    pointer is strided): 16 bytes for the widest contiguous pointer, at most 8 elements."""
    if any(c == 2 for c in classes) or 1 not in classes:
        return 1
    dtypes = list(kernel.access_dtypes) + list(kernel.output_dtypes)
    widest = max(d.itemsize for d, c in zip(dtypes, classes) if c == 1)
    return max(1, min(8, 16 // widest))
