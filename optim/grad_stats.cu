// Single-launch, deterministic gradient statistics (see grad_stats.h).
#include "core/error.h"
#include "core/block_reduce.cuh"
#include "optim/grad_stats.h"

namespace optim {

using core::block_sum;
using core::warp_sum;

namespace {

constexpr int kStatsThreads = 512;

__device__ __forceinline__ void accumulate(float g, double& sum, unsigned int& count) {
  if (isfinite(g)) {
    sum = fma(static_cast<double>(g), static_cast<double>(g), sum);
  } else {
    ++count;
  }
}

__global__ void __launch_bounds__(kStatsThreads)
    grad_stats_kernel(const float* __restrict__ grad, const WorkChunk* __restrict__ chunks, std::int64_t num_chunks,
                      double* __restrict__ partial_sums, unsigned long long* __restrict__ partial_counts,
                      StepScalars* __restrict__ scalars) {
  __shared__ double sum_scratch[kStatsThreads / 32];
  __shared__ unsigned long long count_scratch[kStatsThreads / 32];
  __shared__ bool is_last;

  double sum = 0;
  unsigned int count = 0;
  for (std::int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const WorkChunk chunk = chunks[c];
    const float* g = grad + chunk.offset;
    const int vectors = chunk.length >> 2;
    const float4* g4 = reinterpret_cast<const float4*>(g);
    for (int i = threadIdx.x; i < vectors; i += blockDim.x) {
      const float4 x = __ldcs(g4 + i);
      accumulate(x.x, sum, count);
      accumulate(x.y, sum, count);
      accumulate(x.z, sum, count);
      accumulate(x.w, sum, count);
    }
    for (int i = (vectors << 2) + threadIdx.x; i < chunk.length; i += blockDim.x) accumulate(g[i], sum, count);
  }

  const double block_total = block_sum(sum, sum_scratch);
  const unsigned long long block_count = block_sum(static_cast<unsigned long long>(count), count_scratch);
  if (threadIdx.x == 0) {
    partial_sums[blockIdx.x] = block_total;
    partial_counts[blockIdx.x] = block_count;
    __threadfence();  // partials visible to the last block before it learns it is last
    is_last = atomicAdd(&scalars->stats_arrivals, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last) return;

  // Last block: add the partials in block order.
  __threadfence();
  double total = 0;
  unsigned long long nonfinite = 0;
  for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += blockDim.x) {
    total += __ldcg(partial_sums + b);
    nonfinite += __ldcg(partial_counts + b);
  }
  total = block_sum(total, sum_scratch);
  nonfinite = block_sum(nonfinite, count_scratch);
  if (threadIdx.x == 0) {
    scalars->grad_sq_sum = total;
    scalars->nonfinite = nonfinite;
    scalars->stats_arrivals = 0;  // ready for the next step (and for graph replay)
  }
}

}  // namespace

void launch_grad_stats(const float* grad, const WorkChunk* chunks, std::int64_t num_chunks, double* partial_sums,
                       unsigned long long* partial_counts, StepScalars* scalars, cudaStream_t stream) {
  const int blocks = grad_stats_blocks(num_chunks);
  grad_stats_kernel<<<blocks, kStatsThreads, 0, stream>>>(grad, chunks, num_chunks, partial_sums, partial_counts,
                                                          scalars);
  CUDA_CHECK_LAUNCH("grad_stats_kernel");
}

}  // namespace optim
