// Device helpers shared by the bf16 activation kernels (embedding, rmsnorm, rope, swiglu): a
// grid-stride loop over row chunks,
// loads and stores of `Vec` consecutive bf16 values converted to and from fp32 (Vec = 8 is one
// 16-byte access, Vec = 1 the scalar fallback for odd lengths or unaligned rows), a deterministic
// sum across the lanes of a row group, and the host-side tests that pick the vector width.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace models::ops::gpu {

// bf16 values per 16-byte access.
constexpr int kVector = 8;

template <int Vec>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* src, float (&out)[Vec]) {
  if constexpr (Vec == kVector) {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < Vec / 2; ++k) {
      const float2 f = __bfloat1622float2(pairs[k]);
      out[2 * k] = f.x;
      out[2 * k + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < Vec; ++k) out[k] = __bfloat162float(src[k]);
  }
}

template <int Vec>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* dst, const float (&in)[Vec]) {
  if constexpr (Vec == kVector) {
    uint4 raw;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < Vec / 2; ++k) pairs[k] = __floats2bfloat162_rn(in[2 * k], in[2 * k + 1]);
    *reinterpret_cast<uint4*>(dst) = raw;
  } else {
#pragma unroll
    for (int k = 0; k < Vec; ++k) dst[k] = __float2bfloat16_rn(in[k]);
  }
}

// Adds `Vec` fp32 values into dst[0, Vec) (16-byte accesses when Vec = 8; dst must then be
// 16-byte aligned).
template <int Vec>
__device__ __forceinline__ void add_to_float(float* dst, const float (&in)[Vec]) {
  if constexpr (Vec == kVector) {
    float4* d4 = reinterpret_cast<float4*>(dst);
    float4 a = d4[0], b = d4[1];
    a.x += in[0];
    a.y += in[1];
    a.z += in[2];
    a.w += in[3];
    b.x += in[4];
    b.y += in[5];
    b.z += in[6];
    b.w += in[7];
    d4[0] = a;
    d4[1] = b;
  } else {
#pragma unroll
    for (int k = 0; k < Vec; ++k) dst[k] += in[k];
  }
}

template <int Vec>
__device__ __forceinline__ void load_float(const float* src, float (&out)[Vec]) {
  if constexpr (Vec == kVector) {
    const float4 a = reinterpret_cast<const float4*>(src)[0], b = reinterpret_cast<const float4*>(src)[1];
    out[0] = a.x;
    out[1] = a.y;
    out[2] = a.z;
    out[3] = a.w;
    out[4] = b.x;
    out[5] = b.y;
    out[6] = b.z;
    out[7] = b.w;
  } else {
#pragma unroll
    for (int k = 0; k < Vec; ++k) out[k] = src[k];
  }
}

template <int Vec>
__device__ __forceinline__ void store_float(float* dst, const float (&in)[Vec]) {
  if constexpr (Vec == kVector) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(in[4], in[5], in[6], in[7]);
  } else {
#pragma unroll
    for (int k = 0; k < Vec; ++k) dst[k] = in[k];
  }
}

// Sum over the `Lanes` consecutive lanes of a row group (Lanes a power of two <= 32). A xor
// butterfly: at every step both partners add the same two values, so every lane of the group ends
// with the same, run-to-run identical result. The whole warp must call it.
template <int Lanes>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int offset = Lanes / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, offset, Lanes);
  return x;
}

// Grid-stride loop over the `Vec`-wide chunks of a row-major [rows, width] matrix: calls
// chunk(row, column) for each, column a multiple of Vec.
template <int Vec, class Chunk>
__device__ __forceinline__ void for_each_chunk(std::int64_t rows, std::int64_t width, Chunk chunk) {
  const std::int64_t per_row = width / Vec;
  const std::int64_t total = rows * per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t row = i / per_row;
    chunk(row, (i - row * per_row) * Vec);
  }
}

inline bool aligned_16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over `items` with `threads` per block (at least 1, capped so the
// grid stays far below the launch limit; the loop covers the rest).
inline unsigned int grid_for(std::int64_t items, int threads) {
  constexpr std::int64_t kMaxBlocks = std::int64_t{1} << 20;
  const std::int64_t blocks = ceil_div(items, threads);
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

}  // namespace models::ops::gpu
