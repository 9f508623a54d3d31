// The warp-level bf16 tensor-core product (mma.sync m16n8k16, fp32 accumulation) and the bf16
// pair packing its operands take; shared by attention.cu and the persistent E29a kernels.
//
// Fragments, with g = lane / 4 and c = lane % 4: A (16 x 16, row-major) a[0] = A[g][2c, 2c + 1],
// a[1] = A[g + 8][2c, 2c + 1], a[2] = A[g][2c + 8, 2c + 9], a[3] = A[g + 8][2c + 8, 2c + 9];
// B (16 x 8) b0 = B[2c, 2c + 1][g], b1 = B[2c + 8, 2c + 9][g]; C (16 x 8) c[0], c[1] = C[g][2c, 2c + 1],
// c[2], c[3] = C[g + 8][2c, 2c + 1]. Each register holds its pair with the lower index in the low half.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace models::ops::gpu {

// c += a b for one 16x8x16 tile: a is 16x16 bf16 (4 registers), b 16x8 bf16 (2 registers), c fp32.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                         std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair, rounded to nearest (the first in the low half, as mma operands expect).
__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&pair);
}

// The two floats of a bf16 pair (exact).
__device__ __forceinline__ float low_of(std::uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float high_of(std::uint32_t pair) { return __uint_as_float(pair & 0xffff0000u); }

}  // namespace models::ops::gpu
