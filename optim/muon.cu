// CUDA kernels of Muon (muon.h): the momentum and assembly of the matrices' owned elements, the
// normalised bf16 Newton-Schulz inputs, and the matrices' update with mirror write and gradient
// zeroing. The element formulas are muon_math.h's, as in the CPU reference.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/block_reduce.cuh"
#include "core/error.h"
#include "optim/muon.h"
#include "optim/update_epilogue.cuh"

namespace optim {

namespace {

constexpr int kThreads = 256;
constexpr int kNormaliseThreads = 512;

__global__ void __launch_bounds__(kThreads)
    muon_momentum_kernel(const MuonChunk* __restrict__ chunks, std::int64_t num_chunks,
                         const MuonMatrixInfo* __restrict__ matrices, const float* __restrict__ grad,
                         float* __restrict__ momentum, std::int64_t owned_begin, float* __restrict__ assembly,
                         const StepScalars* __restrict__ scalars, MuonKernelParams params) {
  if (blockIdx.x >= num_chunks || skips_step(params.policy, scalars->nonfinite)) return;
  const MuonChunk chunk = chunks[blockIdx.x];
  const MuonMatrixInfo m = matrices[chunk.matrix];
  MuonMomentumParams p = params.momentum;
  p.clip = clip_coefficient(scalars->grad_sq_sum, params.max_norm);
  for (int k = threadIdx.x; k < chunk.length; k += kThreads) {
    const std::int64_t i = chunk.offset + k;
    assembly[m.packed + (i - m.offset)] = muon_momentum(momentum[i - owned_begin], grad[i], p);
  }
}

__global__ void __launch_bounds__(kNormaliseThreads)
    muon_normalise_kernel(const MuonMatrixInfo* __restrict__ matrices, const float* __restrict__ assembly,
                          __nv_bfloat16* __restrict__ x, float eps) {
  __shared__ double scratch[kNormaliseThreads / 32];
  const MuonMatrixInfo m = matrices[blockIdx.x];
  const std::int64_t n = m.rows * m.cols;
  const float* u = assembly + m.packed;
  double sum = 0;
  for (std::int64_t i = threadIdx.x; i < n; i += kNormaliseThreads) sum = fma(double(u[i]), double(u[i]), sum);
  const double total = core::block_sum_all(sum, scratch);
  const float norm = fmaxf(static_cast<float>(sqrt(total)), eps);
  const bool transposed = m.rows > m.cols;
  for (std::int64_t i = threadIdx.x; i < n; i += kNormaliseThreads) {
    const std::int64_t row = i / m.cols, col = i - row * m.cols;
    const std::int64_t at = transposed ? col * m.rows + row : i;
    x[m.x + at] = __float2bfloat16_rn(__fdiv_rn(u[i], norm));
  }
}

template <typename Half>
__global__ void __launch_bounds__(kThreads)
    muon_update_kernel(const MuonChunk* __restrict__ chunks, std::int64_t num_chunks,
                       const MuonMatrixInfo* __restrict__ matrices, const __nv_bfloat16* __restrict__ orthogonal,
                       float* __restrict__ master, float* __restrict__ grad, Half* __restrict__ mirror,
                       std::int64_t owned_begin, const StepScalars* __restrict__ scalars, MuonKernelParams params) {
  if (blockIdx.x >= num_chunks) return;
  const MuonChunk chunk = chunks[blockIdx.x];
  if (skips_step(params.policy, scalars->nonfinite)) {
    for (int k = threadIdx.x; k < chunk.length; k += kThreads) grad[chunk.offset + k] = 0.0f;
    return;
  }
  const MuonMatrixInfo m = matrices[chunk.matrix];
  const double rate = params.lr * static_cast<double>(m.lr_scale);
  const MuonWeightParams p{static_cast<float>(1.0 - rate * params.weight_decay * static_cast<double>(m.decay)),
                           static_cast<float>(rate * m.adjust)};
  const bool transposed = m.rows > m.cols;
  for (int k = threadIdx.x; k < chunk.length; k += kThreads) {
    const std::int64_t i = chunk.offset + k;
    const std::int64_t e = i - m.offset, row = e / m.cols, col = e - row * m.cols;
    const float o = __bfloat162float(orthogonal[m.x + (transposed ? col * m.rows + row : e)]);
    float* w = master + (i - owned_begin);
    write_back(w, grad + i, mirror + i, muon_weight(*w, o, p));
  }
}

}  // namespace

void launch_muon_momentum(const MuonChunk* chunks, std::int64_t num_chunks, const MuonMatrixInfo* matrices,
                          const float* grad, float* momentum, std::int64_t owned_begin, float* assembly,
                          const StepScalars* scalars, const MuonKernelParams& params, cudaStream_t stream) {
  if (num_chunks == 0) return;
  muon_momentum_kernel<<<static_cast<unsigned int>(num_chunks), kThreads, 0, stream>>>(
      chunks, num_chunks, matrices, grad, momentum, owned_begin, assembly, scalars, params);
  CUDA_CHECK_LAUNCH("muon_momentum_kernel");
}

void launch_muon_normalise(const MuonMatrixInfo* matrices, std::int64_t count, const float* assembly, void* x,
                           const MuonKernelParams& params, cudaStream_t stream) {
  if (count == 0) return;
  muon_normalise_kernel<<<static_cast<unsigned int>(count), kNormaliseThreads, 0, stream>>>(
      matrices, assembly, static_cast<__nv_bfloat16*>(x), params.eps);
  CUDA_CHECK_LAUNCH("muon_normalise_kernel");
}

void launch_muon_update(const MuonChunk* chunks, std::int64_t num_chunks, const MuonMatrixInfo* matrices,
                        const void* orthogonal, float* master, float* grad, void* mirror, core::DType mirror_dtype,
                        std::int64_t owned_begin, const StepScalars* scalars, const MuonKernelParams& params,
                        cudaStream_t stream) {
  if (num_chunks == 0) return;
  const auto blocks = static_cast<unsigned int>(num_chunks);
  const auto* o = static_cast<const __nv_bfloat16*>(orthogonal);
  if (mirror_dtype == core::DType::bf16) {
    muon_update_kernel<<<blocks, kThreads, 0, stream>>>(chunks, num_chunks, matrices, o, master, grad,
                                                        static_cast<__nv_bfloat16*>(mirror), owned_begin, scalars,
                                                        params);
  } else {
    muon_update_kernel<<<blocks, kThreads, 0, stream>>>(chunks, num_chunks, matrices, o, master, grad,
                                                        static_cast<__half*>(mirror), owned_begin, scalars, params);
  }
  CUDA_CHECK_LAUNCH("muon_update_kernel");
}

}  // namespace optim
