
struct FmSum { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const {
  return a + b; } };
struct FmProd { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const {
  return a * b; } };
struct FmMax { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const {
  return fm_max(a, b); } };
struct FmMin { template <typename T> __device__ __forceinline__ T operator()(T a, T b) const {
  return fm_min(a, b); } };
template <int W, typename T, typename Op> __device__ __forceinline__ T fm_warp_reduce(T v, Op op) {
  #pragma unroll
  for (int o = W / 2; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
