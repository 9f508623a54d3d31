// The end every optimizer's update kernel shares (AdamW, adamw8bit, Adafactor): the updated fp32
// weight stored, its gradient zeroed (the step consumes it), the 16-bit forward copy (the
// mirror) written rounding to nearest like core::float_to_bf16 / core::float_to_fp16; on a
// skipped step (non-finite gradients) only the gradients are zeroed; and the last block to
// finish advances the step or skipped counter. Each optimizer keeps only its element formula.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/dtype.h"
#include "optim/step_scalars.h"

namespace optim {

// ---- the mirror: four elements as one 8-byte streaming store, or one element

// Two values rounded to nearest as one 32-bit pair of the mirror's type.
__device__ __forceinline__ unsigned int mirror_pair(const __nv_bfloat16*, float a, float b) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const unsigned int*>(&pair);
}
__device__ __forceinline__ unsigned int mirror_pair(const __half*, float a, float b) {
  const __half2 pair = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned int*>(&pair);
}

template <typename Half>
__device__ __forceinline__ void store_mirror4(Half* dst, float4 w) {
  __stcs(reinterpret_cast<uint2*>(dst), make_uint2(mirror_pair(dst, w.x, w.y), mirror_pair(dst, w.z, w.w)));
}

__device__ __forceinline__ void store_mirror(__nv_bfloat16* dst, float w) { *dst = __float2bfloat16_rn(w); }
__device__ __forceinline__ void store_mirror(__half* dst, float w) { *dst = __float2half_rn(w); }

// A mirror whose type is chosen at run time (kernels not templated on it).
struct AnyMirror {
  void* base;
  core::DType dtype;
  struct At {
    void* base;
    core::DType dtype;
    std::int64_t i;
  };
  __device__ At operator+(std::int64_t i) const { return {base, dtype, i}; }
};

__device__ __forceinline__ void store_mirror4(AnyMirror::At at, float4 w) {
  if (at.dtype == core::DType::bf16) {
    store_mirror4(static_cast<__nv_bfloat16*>(at.base) + at.i, w);
  } else {
    store_mirror4(static_cast<__half*>(at.base) + at.i, w);
  }
}

__device__ __forceinline__ void store_mirror(AnyMirror::At at, float w) {
  if (at.dtype == core::DType::bf16) {
    store_mirror(static_cast<__nv_bfloat16*>(at.base) + at.i, w);
  } else {
    store_mirror(static_cast<__half*>(at.base) + at.i, w);
  }
}

// ---- one updated element group

// Four updated weights: the weight, the zeroed gradient and the mirror (at `mirror`, the group's
// first element), all streaming stores.
template <typename MirrorAt>
__device__ __forceinline__ void write_back4(float4* w4, float4* g4, MirrorAt mirror, float4 w) {
  __stcs(w4, w);
  __stcs(g4, make_float4(0.f, 0.f, 0.f, 0.f));
  store_mirror4(mirror, w);
}

template <typename MirrorAt>
__device__ __forceinline__ void write_back(float* w_slot, float* g_slot, MirrorAt mirror, float w) {
  *w_slot = w;
  *g_slot = 0.0f;
  store_mirror(mirror, w);
}

// The members of four elements selected by `mask` (bit k: element k), as write_back4 / write_back.
template <typename Half>
__device__ __forceinline__ void write_back4_masked(float* w_slot, float* g_slot, Half* mirror, float4 w,
                                                   unsigned mask) {
  if (mask == 0xFu) {
    write_back4(reinterpret_cast<float4*>(w_slot), reinterpret_cast<float4*>(g_slot), mirror, w);
    return;
  }
  const float v[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (mask & (1u << k)) write_back(w_slot + k, g_slot + k, mirror + k, v[k]);
  }
}

// A skipped step still consumes the gradients: g[0, n) zeroed by the block's `threads` threads
// (g 16-byte aligned).
__device__ __forceinline__ void zero_gradients(float* g, int n, int threads) {
  float4* g4 = reinterpret_cast<float4*>(g);
  const int vectors = n >> 2;
  for (int i = threadIdx.x; i < vectors; i += threads) __stcs(g4 + i, make_float4(0.f, 0.f, 0.f, 0.f));
  for (int i = (vectors << 2) + threadIdx.x; i < n; i += threads) g[i] = 0.0f;
}

// After the block's last access to the step scalars: the last block of the grid to arrive
// advances `step` (or `skipped`) and resets the arrival count, so every block read the counters
// of this step.
__device__ __forceinline__ void finish_update(StepScalars* scalars, bool skipped) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&scalars->update_arrivals, 1u) == gridDim.x - 1) {
      if (skipped) {
        ++scalars->skipped;
      } else {
        ++scalars->step;
      }
      scalars->update_arrivals = 0;
    }
  }
}

}  // namespace optim
