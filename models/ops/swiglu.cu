// CUDA kernels of SwiGLU on bf16 gate_up [rows, 2F]: elementwise, a grid-stride loop over Vec
// consecutive features of a row per thread, fp32 arithmetic, one bf16 rounding per output.
#include "core/error.h"
#include "models/ops/bf16_rows.cuh"
#include "models/ops/op_checks.h"
#include "models/ops/swiglu.h"

namespace models::ops {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <int Vec>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(const __nv_bfloat16* __restrict__ gate_up, std::int64_t rows, std::int64_t features,
                          __nv_bfloat16* __restrict__ out) {
  gpu::for_each_chunk<Vec>(rows, features, [&](std::int64_t n, std::int64_t f) {
    const __nv_bfloat16* gate = gate_up + n * 2 * features + f;
    float g[Vec], u[Vec], y[Vec];
    gpu::load_bf16<Vec>(gate, g);
    gpu::load_bf16<Vec>(gate + features, u);
#pragma unroll
    for (int k = 0; k < Vec; ++k) y[k] = g[k] * sigmoid(g[k]) * u[k];
    gpu::store_bf16<Vec>(out + n * features + f, y);
  });
}

// dgate = dout * up * s * (1 + g * (1 - s)), dup = dout * g * s with s = sigmoid(g).
template <int Vec>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(const __nv_bfloat16* __restrict__ dout, const __nv_bfloat16* __restrict__ gate_up,
                           std::int64_t rows, std::int64_t features, __nv_bfloat16* __restrict__ dgate_up) {
  gpu::for_each_chunk<Vec>(rows, features, [&](std::int64_t n, std::int64_t f) {
    const __nv_bfloat16* gate = gate_up + n * 2 * features + f;
    __nv_bfloat16* dgate = dgate_up + n * 2 * features + f;
    float g[Vec], u[Vec], d[Vec], dg[Vec], du[Vec];
    gpu::load_bf16<Vec>(gate, g);
    gpu::load_bf16<Vec>(gate + features, u);
    gpu::load_bf16<Vec>(dout + n * features + f, d);
#pragma unroll
    for (int k = 0; k < Vec; ++k) {
      const float s = sigmoid(g[k]);
      dg[k] = d[k] * u[k] * s * (1.0f + g[k] * (1.0f - s));
      du[k] = d[k] * g[k] * s;
    }
    gpu::store_bf16<Vec>(dgate, dg);
    gpu::store_bf16<Vec>(dgate + features, du);
  });
}

void check_shape(std::string_view op, std::int64_t rows, std::int64_t features) {
  checks::require_non_negative(op, "rows", rows);
  checks::require_positive(op, "features", features);
}

}  // namespace

void swiglu_forward_cuda(const __nv_bfloat16* gate_up, std::int64_t rows, std::int64_t features, __nv_bfloat16* out,
                         cudaStream_t stream) {
  check_shape("swiglu_forward_cuda", rows, features);
  if (rows == 0) return;
  if (features % gpu::kVector == 0 && gpu::aligned_16(gate_up) && gpu::aligned_16(out)) {
    swiglu_forward_kernel<gpu::kVector>
        <<<gpu::grid_for(rows * (features / gpu::kVector), kThreads), kThreads, 0, stream>>>(gate_up, rows, features,
                                                                                             out);
  } else {
    swiglu_forward_kernel<1>
        <<<gpu::grid_for(rows * features, kThreads), kThreads, 0, stream>>>(gate_up, rows, features, out);
  }
  CUDA_CHECK_LAUNCH("swiglu_forward_kernel");
}

void swiglu_backward_cuda(const __nv_bfloat16* dout, const __nv_bfloat16* gate_up, std::int64_t rows,
                          std::int64_t features, __nv_bfloat16* dgate_up, cudaStream_t stream) {
  check_shape("swiglu_backward_cuda", rows, features);
  if (rows == 0) return;
  if (features % gpu::kVector == 0 && gpu::aligned_16(dout) && gpu::aligned_16(gate_up) && gpu::aligned_16(dgate_up)) {
    swiglu_backward_kernel<gpu::kVector>
        <<<gpu::grid_for(rows * (features / gpu::kVector), kThreads), kThreads, 0, stream>>>(dout, gate_up, rows,
                                                                                             features, dgate_up);
  } else {
    swiglu_backward_kernel<1>
        <<<gpu::grid_for(rows * features, kThreads), kThreads, 0, stream>>>(dout, gate_up, rows, features, dgate_up);
  }
  CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
}

}  // namespace models::ops
