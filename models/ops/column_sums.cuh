// The second half of the norms' deterministic weight gradients (rmsnorm.cu, qk_norm_rope.cu): a
// block of 32 columns adds the per-chunk partial sums of its columns in a fixed order, so the
// total is bit-identical run to run whatever the device.
#pragma once

#include <cstdint>

namespace models::ops::gpu {

// partials [rows, width]: warp w of the block adds rows w, w + warps, ... in order, then warp 0
// adds the warps' sums in warp order; the total of `column` is returned in warp 0 (0 elsewhere).
template <int Threads>
__device__ __forceinline__ float fixed_order_column_sum(const float* __restrict__ partials, std::int64_t rows,
                                                        std::int64_t width, std::int64_t column) {
  constexpr int kWarps = Threads / 32;
  __shared__ float warp_sums[kWarps][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float sum = 0.0f;
  if (column < width) {
    for (std::int64_t r = warp; r < rows; r += kWarps) sum += partials[r * width + column];
  }
  warp_sums[warp][lane] = sum;
  __syncthreads();
  float total = 0.0f;
  if (warp == 0) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w][lane];
  }
  return total;
}

}  // namespace models::ops::gpu
