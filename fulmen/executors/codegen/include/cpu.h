
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
// float tanh the compiler can vectorise (libm's tanhf is a scalar call; 21x slower at 65536
// elements): |x| + |x|^3 Q(x^2) for |x| < 0.55 (Q of degree 5, a least-squares fit on Chebyshev
// nodes) and 1 - 2 / (exp(2|x|) + 1) beyond, with the vectorisable f_exp (its clamp makes large
// |x| give exactly 1); the sign of x is put back last, so -0.0 stays -0.0, and NaN takes the
// second form and stays NaN. Within 1.52 ulp of tanh over every 7th float, with and without FMA
// (checked against float64 tanh).
static inline float f_tanh(float x) {
  const float ax = std::fabs(x);
  const float t = ax * ax;
  float q = 0x1.4b67e40000000p-9f;
  q = f_madd(q, t, -0x1.1770f80000000p-7f);
  q = f_madd(q, t, 0x1.657aea0000000p-6f);
  q = f_madd(q, t, -0x1.ba14460000000p-5f);
  q = f_madd(q, t, 0x1.1111060000000p-3f);
  q = f_madd(q, t, -0x1.5555560000000p-2f);
  const float small = f_madd(ax * t, q, ax);
  const float big = 1.0f - 2.0f / (f_exp(2.0f * ax) + 1.0f);
  return std::copysign(ax < 0.55f ? small : big, x);
}
