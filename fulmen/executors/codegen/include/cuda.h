
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
