// Deterministic warp and block sums (a fixed butterfly, then warp order), the one definition
// for every kernel: the optimizers, the ops and the decoders.
#pragma once

namespace core {

// Sum over the warp, the same value in every lane (each lane adds the same pairs, commuted).
template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, offset);
  return x;
}

// Sum over the block; the result is valid in thread 0. `scratch` holds blockDim.x / 32 values.
// Ends with a barrier, so the scratch can be reused right after.
template <typename T>
__device__ T block_sum(T x, T* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  x = warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  T total = T(0);
  if (threadIdx.x == 0) {
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += scratch[w];
  }
  __syncthreads();
  return total;
}

// Sum over the block, the same value in every thread (blockDim.x a multiple of 32). `scratch`
// holds blockDim.x / 32 values; ends with a barrier, so the scratch can be reused right after.
template <typename T>
__device__ T block_sum_all(T x, T* scratch) {
  x = warp_sum(x);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
  __syncthreads();
  T total = T(0);
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += scratch[w];
  __syncthreads();
  return total;
}

}  // namespace core
