"""C++ renderer: a pointwise `Kernel` -> C++17 source with one `extern "C"` entry point.

    void fulmen_kernel(int64_t ndim, const int64_t* sizes, const int64_t* strides,
                       char* const* ptrs, int64_t block, int64_t nthreads)

`strides` holds one row of `ndim` element strides per pointer (accesses, then outputs). The
iteration space is split into rows (all dims but the last) and blocks of `block` elements of
the last dim; OpenMP shares (row, block) tasks among `nthreads` threads. The inner loop is a
`#pragma omp simd` loop; its addressing is specialised on each pointer's inner-stride class
(`layout`: 1 contiguous, 0 broadcast, 2 any stride), so the compiled kernel serves every shape
and stride of that layout.

float16/bfloat16 are loaded and stored as such and computed in float32; every float16/bfloat16
result is rounded to its dtype, as eager rounds after each op; bool elements are bytes (0/1).
exp and erf of float32 are the vectorisable polynomials of the prelude (ulp bounds there). No
flag changes IEEE semantics, and no statement has undefined behaviour: float -> integer
conversions give eager's x86-64 results through the prelude's `f_to_i64`/`f_to_i32`. A Python
number exponent of a float32 `pow` stays a double, as in eager's CPU kernel.
"""

from __future__ import annotations

import math

import torch

from fulmen.executors.codegen.ir import Const, Kernel, Load, Op

# bool tensors are read and written as bytes: GCC 12 vectorises no loop that loads a C++ `bool`
# ("no vectype"), so every kernel with a mask input (attention, where, dropout) ran scalar
STORAGE = {
    torch.float16: "_Float16", torch.bfloat16: "uint16_t", torch.float32: "float",
    torch.float64: "double", torch.int8: "int8_t", torch.int16: "int16_t",
    torch.int32: "int32_t", torch.int64: "int64_t", torch.uint8: "uint8_t", torch.bool: "uint8_t",
}  # fmt: skip
COMPUTE = {**STORAGE, torch.float16: "float", torch.bfloat16: "float", torch.bool: "bool"}
_LOW = (torch.float16, torch.bfloat16)

PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

static inline float bf16_load(uint16_t b) {
  uint32_t u = (uint32_t)b << 16; float f; std::memcpy(&f, &u, 4); return f;
}
static inline uint16_t bf16_store(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }
static inline float f16_round(float f) { return (float)(_Float16)f; }

// NaN from either side; on a tie the first operand, so clamp/relu keep the input's -0.0 as
// eager's clamp does (maximum/minimum are decomposed with the input first)
template <typename T> static inline T f_max(T a, T b) { return (a >= b || a != a) ? a : b; }
template <typename T> static inline T f_min(T a, T b) { return (a <= b || a != a) ? a : b; }
// float -> integer as eager's casts run on x86-64 (cvttss2si/cvttsd2si): a value out of the
// 32- or 64-bit range, or NaN, gives that width's INT_MIN; int8/int16 keep the low bits of the
// 32-bit conversion, uint8 those of the 64-bit one (c10 casts to uint8 through int64). Written
// with defined operations: the plain C++ cast of such values is undefined behaviour.
static inline int64_t f_to_i64(double x) {
  return (x >= -0x1p63 && x < 0x1p63) ? (int64_t)x : std::numeric_limits<int64_t>::min();
}
static inline int32_t f_to_i32(double x) {
  return (x > -2147483649.0 && x < 0x1p31) ? (int32_t)x : std::numeric_limits<int32_t>::min();
}
template <typename T> static inline T f_remainder(T a, T b) {
  T m = std::fmod(a, b);
  if (m != 0 && ((b < 0) != (m < 0))) m += b;
  return m;
}
template <typename T> static inline T f_floor_div(T a, T b) {
  if (b == 0) return a / b;
  T m = std::fmod(a, b);
  T d = (a - m) / b;
  if (m != 0 && ((b < 0) != (m < 0))) d -= 1;
  if (d != 0) {
    T f = std::floor(d);
    if (d - f > T(0.5)) f += 1;
    return f;
  }
  return std::copysign(T(0), a / b);
}
static inline bool f_signbit(float a) { uint32_t u; std::memcpy(&u, &a, 4); return u >> 31; }
static inline bool f_signbit(double a) { uint64_t u; std::memcpy(&u, &a, 8); return u >> 63; }
template <typename T> static inline T f_sign(T a) { return (T)((T(0) < a) - (a < T(0))); }
// polynomial steps of our own approximations: one fused multiply-add where the CPU has it (the
// error bounds below hold either way; user arithmetic is never contracted: -ffp-contract=off)
#ifdef __FMA__
#define f_madd(a, b, c) __builtin_fmaf(a, b, c)
#else
#define f_madd(a, b, c) ((a) * (b) + (c))
#endif
// float exp the compiler can vectorise (libm's expf is a scalar call): exp(x) = 2^k exp(r) with
// |r| <= ln2/2, ln2 split in two (the high part has 15 bits, so k * high is exact and the
// reduction loses nothing with or without FMA), exp(r) = 1 + r P(r) with P of degree 5 (a
// Chebyshev fit; within 0.94 ulp over the normal range, checked against float64 exp).
static inline float f_exp_reduced(float xc, float& k) {
  k = __builtin_rintf(xc * 1.44269504088896341f);
  float r = f_madd(k, -0x1.62e4000000000p-1f, xc);
  r = f_madd(k, -0x1.7f7d1c0000000p-20f, r);
  float p = 0x1.6d754c0000000p-10f;
  p = f_madd(p, r, 0x1.123d9a0000000p-7f);
  p = f_madd(p, r, 0x1.5554ac0000000p-5f);
  p = f_madd(p, r, 0x1.55547c0000000p-3f);
  p = f_madd(p, r, 0.5f);
  p = f_madd(p, r, 1.0f);
  return f_madd(p, r, 1.0f);
}
// exp over all floats: x is clamped to [-104, 89] first (two plain selects: a compare and a
// blend each in vector code), so out-of-range results overflow to inf or underflow to 0
// exactly as exp does; NaN passes through the clamps and the arithmetic. 2^k is applied as two
// factors so results down to the smallest subnormal round once.
static inline float f_exp(float x) {
  float xc = x > 89.0f ? 89.0f : x;
  xc = xc < -104.0f ? -104.0f : xc;
  float k;
  const float p = f_exp_reduced(xc, k);
  const int32_t ki = (int32_t)k;
  const int32_t k1 = ki >> 1;
  const uint32_t b1 = (uint32_t)(k1 + 127) << 23, b2 = (uint32_t)(ki - k1 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  return p * s1 * s2;
}
// exp of x <= 0 or NaN (softmax's x - max(x)): no upper clamp, and 2^k applied as one factor
// 2^(k + 24), normal for every k >= -150, times the constant 2^-24 (exact for normal results,
// one rounding for subnormal ones).
static inline float f_exp_nonpos(float x) {
  const float xc = x < -104.0f ? -104.0f : x;
  float k;
  const float p = f_exp_reduced(xc, k);
  const uint32_t bits = (uint32_t)((int32_t)k + 151) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale * 0x1.0p-24f;
}
// float erf the compiler can vectorise, two polynomials (Chebyshev fits, 19 multiply-adds in
// all): x * P(x^2) for |x| < 1.25 and 1 - E(|x| - 2.585) for 1.25 <= |x| < 3.92 (E ~ erfc),
// 1 beyond (erf rounds to 1 there). Within 2.6 ulp of erf over all floats with FMA (checked
// against float64 erf on a dense grid). x * P keeps the sign and NaN (the comparisons send NaN
// there); the sign bit of x is put on 1 - E by an xor.
static inline float f_erf(float x) {
  const float ax = std::fabs(x);
  const float t = ax * ax;
  float p = 0x1.06424c0000000p-14f;
  p = f_madd(p, t, -0x1.8697ae0000000p-11f);
  p = f_madd(p, t, 0x1.4f2af40000000p-8f);
  p = f_madd(p, t, -0x1.b73ab80000000p-6f);
  p = f_madd(p, t, 0x1.ce1fc40000000p-4f);
  p = f_madd(p, t, -0x1.8126e80000000p-2f);
  p = f_madd(p, t, 0x1.20dd740000000p+0f);
  const float u = ax - 2.585f;  // only used for ax < 3.92
  float e = 0x1.22257c0000000p-17f;
  e = f_madd(e, u, -0x1.76ce560000000p-17f);
  e = f_madd(e, u, -0x1.3984fe0000000p-14f);
  e = f_madd(e, u, 0x1.c61c1c0000000p-13f);
  e = f_madd(e, u, -0x1.a2b9c60000000p-14f);
  e = f_madd(e, u, -0x1.6b66e80000000p-11f);
  e = f_madd(e, u, 0x1.3f9e5a0000000p-9f);
  e = f_madd(e, u, -0x1.38330a0000000p-8f);
  e = f_madd(e, u, 0x1.9dad5c0000000p-8f);
  e = f_madd(e, u, -0x1.7e1cae0000000p-8f);
  e = f_madd(e, u, 0x1.df0ea20000000p-9f);
  e = f_madd(e, u, -0x1.7293440000000p-10f);
  e = f_madd(e, u, 0x1.0ce4b40000000p-12f);
  const float big = ax < 3.92f ? 1.0f - e : 1.0f;
  uint32_t bits, sign;
  std::memcpy(&bits, &big, 4);
  std::memcpy(&sign, &x, 4);
  bits ^= sign & 0x80000000u;
  float signed_big;
  std::memcpy(&signed_big, &bits, 4);
  return ax >= 1.25f ? signed_big : x * p;
}
"""

_UNARY = {
    "neg": "(-{a})", "exp": "std::exp({a})", "exp2": "std::exp2({a})",
    "expm1": "std::expm1({a})", "log": "std::log({a})", "log1p": "std::log1p({a})",
    "log2": "std::log2({a})", "log10": "std::log10({a})", "sqrt": "std::sqrt({a})",
    "rsqrt": "({one} / std::sqrt({a}))", "sin": "std::sin({a})", "cos": "std::cos({a})",
    "tan": "std::tan({a})", "asin": "std::asin({a})", "acos": "std::acos({a})",
    "atan": "std::atan({a})", "sinh": "std::sinh({a})", "cosh": "std::cosh({a})",
    "tanh": "std::tanh({a})", "asinh": "std::asinh({a})", "acosh": "std::acosh({a})",
    "atanh": "std::atanh({a})", "erf": "std::erf({a})", "erfc": "std::erfc({a})",
    "reciprocal": "({one} / {a})", "logical_not": "(!({a} != 0))", "sign": "f_sign({a})",
}  # fmt: skip
_FLOAT_ONLY_UNARY = {
    "abs": "std::abs({a})", "floor": "std::floor({a})", "ceil": "std::ceil({a})",
    "round": "std::nearbyint({a})", "trunc": "std::trunc({a})", "isnan": "({a} != {a})",
    "isinf": "std::isinf({a})", "isfinite": "std::isfinite({a})",
    "signbit": "f_signbit({a})",
}  # fmt: skip
_INT_UNARY = {
    "abs": "({a} < 0 ? -{a} : {a})", "floor": "{a}", "ceil": "{a}", "round": "{a}",
    "trunc": "{a}", "isnan": "false", "isinf": "false", "isfinite": "true",
    "signbit": "({a} < 0)", "bitwise_not": "(~{a})",
}  # fmt: skip
_BOOL_UNARY = {"isnan": "false", "isinf": "false", "isfinite": "true", "signbit": "false",
               "bitwise_not": "(!{a})"}  # fmt: skip
_BINARY = {
    "add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})", "div": "({a} / {b})",
    "remainder": "f_remainder({a}, {b})", "fmod": "std::fmod({a}, {b})",
    "floor_div": "f_floor_div({a}, {b})", "trunc_div": "std::trunc({a} / {b})",
    "pow": "std::pow({a}, {b})", "atan2": "std::atan2({a}, {b})",
    "copysign": "std::copysign({a}, {b})", "maximum": "f_max({a}, {b})",
    "minimum": "f_min({a}, {b})", "bitwise_and": "({a} & {b})", "bitwise_or": "({a} | {b})",
    "bitwise_xor": "({a} ^ {b})", "eq": "({a} == {b})", "ne": "({a} != {b})",
    "lt": "({a} < {b})", "le": "({a} <= {b})", "gt": "({a} > {b})", "ge": "({a} >= {b})",
}  # fmt: skip
_BOOL_BINARY = {"add": "({a} || {b})", "mul": "({a} && {b})"}
# float -> integer conversions (see f_to_i64 in the prelude)
_FLOAT_TO_INT = {
    torch.int64: "f_to_i64({a})", torch.int32: "f_to_i32({a})",
    torch.int16: "(int16_t)f_to_i32({a})", torch.int8: "(int8_t)f_to_i32({a})",
    torch.uint8: "(uint8_t)f_to_i64({a})",
}  # fmt: skip
# torch computes x ** c for these constant exponents without pow.
_POW_CONST = {2.0: "({a} * {a})", 3.0: "({a} * {a} * {a})", 0.5: "std::sqrt({a})",
              -0.5: "({one} / std::sqrt({a}))", -1.0: "({one} / {a})",
              -2.0: "({one} / ({a} * {a}))", 1.0: "{a}"}  # fmt: skip


def literal(value, dtype: torch.dtype) -> str:
    """A C++ literal of `value` in the compute type of `dtype`."""
    ctype = COMPUTE[dtype]
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        value = float(value)
        if math.isnan(value):
            return f"std::numeric_limits<{ctype}>::quiet_NaN()"
        if math.isinf(value):
            sign = "" if value > 0 else "-"
            return f"{sign}std::numeric_limits<{ctype}>::infinity()"
        return f"{ctype}({value.hex()})" if ctype == "double" else f"{value.hex()}f"
    if int(value) == -(2**63):
        return "std::numeric_limits<int64_t>::min()"
    return f"{ctype}({int(value)}LL)"


def _expr(kernel: Kernel, op: Op, names: list[str]) -> str:
    arg_dtype = kernel.values[op.args[0]].dtype if op.args else op.dtype
    a = names[op.args[0]] if op.args else ""
    b = names[op.args[1]] if len(op.args) > 1 else ""
    one = literal(1, arg_dtype) if arg_dtype.is_floating_point else "1"
    name = op.name
    if name == "convert_element_type":
        if op.dtype == torch.bool:
            return f"({a} != 0)"
        if arg_dtype == torch.bool:  # a select: GCC 12 does not vectorise bool -> float casts
            return f"({a} ? {literal(1, op.dtype)} : {literal(0, op.dtype)})"
        if arg_dtype.is_floating_point and op.dtype in _FLOAT_TO_INT:
            return _FLOAT_TO_INT[op.dtype].format(a=a)
        return f"({COMPUTE[op.dtype]})({a})"
    if name == "where":
        return f"({a} ? {b} : {names[op.args[2]]})"
    if name in ("exp", "erf") and COMPUTE[arg_dtype] == "float":
        return f"f_{name}({a})"
    if name == "pow":
        const = kernel.values[op.args[1]]
        if isinstance(const, Const) and float(const.value) in _POW_CONST:
            return _POW_CONST[float(const.value)].format(a=a, one=one)
    if arg_dtype == torch.bool:
        template = _BOOL_UNARY.get(name) or _BOOL_BINARY.get(name)
        if template:
            return template.format(a=a, b=b)
    if arg_dtype.is_floating_point and name in _FLOAT_ONLY_UNARY:
        return _FLOAT_ONLY_UNARY[name].format(a=a)
    if not arg_dtype.is_floating_point and name in _INT_UNARY:
        return _INT_UNARY[name].format(a=a)
    if name in _UNARY:
        return _UNARY[name].format(a=a, one=one)
    return _BINARY[name].format(a=a, b=b)


def render(kernel: Kernel, layout: tuple[int, ...]) -> str:
    """C++ source of `kernel` for inner-stride classes `layout` (one per access, then output)."""
    nptr = len(kernel.accesses) + len(kernel.outputs)
    assert len(layout) == nptr
    lines = [PRELUDE, 'extern "C" void fulmen_kernel(int64_t ndim, const int64_t* sizes, '
             "const int64_t* strides, char* const* ptrs, int64_t block, int64_t nthreads) {",
             "  const int64_t inner = sizes[ndim - 1];",
             "  int64_t rows = 1;",
             "  for (int64_t d = 0; d + 1 < ndim; ++d) rows *= sizes[d];",
             "  const int64_t nblocks = (inner + block - 1) / block;",
             "  #pragma omp parallel for num_threads(nthreads) schedule(static) if(nthreads > 1)",
             "  for (int64_t task = 0; task < rows * nblocks; ++task) {",
             "    const int64_t row = task / nblocks;",
             "    const int64_t j0 = (task % nblocks) * block;",
             "    const int64_t j1 = inner < j0 + block ? inner : j0 + block;",
             f"    int64_t off[{nptr}] = {{0}};",
             "    int64_t r = row;",
             "    for (int64_t d = ndim - 2; d >= 0; --d) {",
             "      const int64_t i = r % sizes[d];",
             "      r /= sizes[d];",
             f"      for (int p = 0; p < {nptr}; ++p) off[p] += i * strides[p * ndim + d];",
             "    }"]
    dtypes = list(kernel.access_dtypes) + list(kernel.output_dtypes)
    for p, dtype in enumerate(dtypes):
        const = "const " if p < len(kernel.accesses) else ""
        ctype = STORAGE[dtype]
        lines.append(f"    {const}{ctype}* __restrict__ p{p} = ({const}{ctype}*)ptrs[{p}] + off[{p}];")
        if layout[p] == 2:
            lines.append(f"    const int64_t s{p} = strides[{p} * ndim + ndim - 1];")
    lines.append("    #pragma omp simd")
    lines.append("    for (int64_t j = j0; j < j1; ++j) {")
    names: list[str] = []
    for v, value in enumerate(kernel.values):
        name = f"v{v}"
        ctype = COMPUTE[value.dtype]
        if isinstance(value, Load):
            expr = f"p{value.access}[{_index(layout[value.access], value.access)}]"
            expr = load(expr, value.dtype)
        elif isinstance(value, Const):
            expr = literal(value.value, value.dtype)
        else:
            expr = rounded(f"({ctype})({_expr(kernel, value, names)})", value.dtype)
        lines.append(f"      const {ctype} {name} = {expr};")
        names.append(name)
    for k, v in enumerate(kernel.outputs):
        p = len(kernel.accesses) + k
        dtype = kernel.values[v].dtype
        value = store(names[v], dtype)
        lines.append(f"      p{p}[{_index(layout[p], p)}] = {value};")
    lines += ["    }", "  }", "}", ""]
    return "\n".join(lines)


# how an element of each storage type becomes its compute value, and back; and how a computed
# float16/bfloat16 value is rounded to its dtype (as eager rounds after each op)
_LOAD = {torch.bfloat16: "bf16_load({})", torch.float16: "(float)({})", torch.bool: "({} != 0)"}
_STORE = {torch.bfloat16: "bf16_store({})", torch.float16: "(_Float16)({})",
          torch.bool: "(uint8_t)({})"}  # fmt: skip
_ROUND = {torch.bfloat16: "bf16_round({})", torch.float16: "f16_round({})"}


def load(expr: str, dtype: torch.dtype) -> str:
    """The compute value of the stored element `expr` of `dtype`."""
    return _LOAD.get(dtype, "{}").format(expr)


def store(expr: str, dtype: torch.dtype) -> str:
    """The stored element of `dtype` for the compute value `expr`."""
    return _STORE.get(dtype, "{}").format(expr)


def rounded(expr: str, dtype: torch.dtype) -> str:
    """The compute value `expr` of a `dtype` result, rounded to `dtype` (float16/bfloat16)."""
    return _ROUND.get(dtype, "{}").format(expr)


def _index(kind: int, p: int) -> str:
    return {0: "0", 1: "j"}.get(kind, f"j * s{p}")
