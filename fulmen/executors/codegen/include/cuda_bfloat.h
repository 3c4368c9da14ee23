
#include <cuda_bf16.h>
__device__ __forceinline__ float fm_bf16_round(float a) {
  return __bfloat162float(__float2bfloat16_rn(a));
}
