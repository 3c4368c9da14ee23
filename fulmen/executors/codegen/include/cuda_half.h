
#include <cuda_fp16.h>
__device__ __forceinline__ float fm_f16_round(float a) { return __half2float(__float2half_rn(a)); }
