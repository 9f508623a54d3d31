// Device helpers that write the 16-bit forward copy (the mirror) of fp32 master weights, rounding
// to nearest like core::float_to_bf16 / core::float_to_fp16: four elements as one 8-byte
// streaming store, or one element.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace optim {

__device__ __forceinline__ void store_mirror4(__nv_bfloat16* dst, float4 w) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(w.x, w.y);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(w.z, w.w);
  uint2 packed;
  packed.x = *reinterpret_cast<const unsigned int*>(&lo);
  packed.y = *reinterpret_cast<const unsigned int*>(&hi);
  __stcs(reinterpret_cast<uint2*>(dst), packed);
}

__device__ __forceinline__ void store_mirror4(__half* dst, float4 w) {
  const __half2 lo = __floats2half2_rn(w.x, w.y);
  const __half2 hi = __floats2half2_rn(w.z, w.w);
  uint2 packed;
  packed.x = *reinterpret_cast<const unsigned int*>(&lo);
  packed.y = *reinterpret_cast<const unsigned int*>(&hi);
  __stcs(reinterpret_cast<uint2*>(dst), packed);
}

__device__ __forceinline__ void store_mirror(__nv_bfloat16* dst, float w) { *dst = __float2bfloat16_rn(w); }
__device__ __forceinline__ void store_mirror(__half* dst, float w) { *dst = __float2half_rn(w); }

}  // namespace optim
