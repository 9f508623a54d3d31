// CUDA kernel of the fused AdamW update: one block per work chunk, 16-byte accesses, every
// stream touched once (read-once loads and stores marked evict-first). `grad` is indexed by
// global element (Slab::grad_origin()) and only chunk elements are touched, so the gradient
// buffer may cover the whole slab or only the owned shard.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/error.h"
#include "optim/adamw.h"
#include "optim/adamw_span.cuh"

namespace optim {

namespace {

constexpr int kUpdateThreads = 256;

template <typename Half>
__global__ void __launch_bounds__(kUpdateThreads)
    adamw_update_kernel(float* __restrict__ master, float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                        float* __restrict__ grad, Half* __restrict__ mirror, std::int64_t owned_begin,
                        const WorkChunk* __restrict__ chunks, std::int64_t num_chunks,
                        const Segment* __restrict__ segments, StepScalars* __restrict__ scalars,
                        AdamWStepParams params) {
  __shared__ AdamWElementParams shared_params;
  __shared__ bool shared_skip;
  __shared__ WorkChunk shared_chunk;
  const bool has_chunk = blockIdx.x < num_chunks;
  if (threadIdx.x == 0) {
    // Every block derives clip, skip and bias correction from the step's statistics itself.
    const bool skip = skips_step(params.policy, scalars->nonfinite);
    shared_skip = skip;
    if (has_chunk) {
      const WorkChunk chunk = chunks[blockIdx.x];
      const Segment seg = segments[chunk.segment];
      const float clip = clip_coefficient(scalars->grad_sq_sum, params.max_norm);
      shared_params = adamw_element_params(params, clip, scalars->step + 1, seg.lr_scale, seg.decay);
      shared_chunk = chunk;
    }
  }
  __syncthreads();

  if (has_chunk) {
    const WorkChunk chunk = shared_chunk;
    const AdamWElementParams e = shared_params;
    const std::int64_t local = chunk.offset - owned_begin;
    float* w = master + local;
    float* m = exp_avg + local;
    float* v = exp_avg_sq + local;
    float* g = grad + chunk.offset;
    if (shared_skip) {
      zero_gradients(g, chunk.length, kUpdateThreads);
    } else {
      adamw_update_span<true>(w, m, v, g, mirror + chunk.offset, chunk.length, e, kUpdateThreads);
    }
  }

  finish_update(scalars, shared_skip);
}

}  // namespace

void launch_adamw_update(const AdamWBuffers& b, const WorkChunk* chunks, std::int64_t num_chunks,
                         const Segment* segments, StepScalars* scalars, const AdamWStepParams& params,
                         cudaStream_t stream) {
  const auto blocks = static_cast<unsigned int>(num_chunks > 0 ? num_chunks : 1);
  if (b.mirror_dtype == core::DType::bf16) {
    adamw_update_kernel<<<blocks, kUpdateThreads, 0, stream>>>(b.master, b.exp_avg, b.exp_avg_sq, b.grad,
                                                               static_cast<__nv_bfloat16*>(b.mirror), b.owned_begin,
                                                               chunks, num_chunks, segments, scalars, params);
  } else {
    adamw_update_kernel<<<blocks, kUpdateThreads, 0, stream>>>(b.master, b.exp_avg, b.exp_avg_sq, b.grad,
                                                               static_cast<__half*>(b.mirror), b.owned_begin, chunks,
                                                               num_chunks, segments, scalars, params);
  }
  CUDA_CHECK_LAUNCH("adamw_update_kernel");
}

}  // namespace optim
