// CUDA kernel of RoPE (rotate-half form) on bf16 [tokens, heads, head_dim] with token strides.
// A thread owns Vec consecutive rotation pairs (i, i + head_dim / 2) of one token: it computes
// their cos and sin once (see rope.h for how) and rotates those pairs in every head, reading each
// element once and writing it once, so in-place rotation is safe.
#include <cmath>

#include "core/error.h"
#include "models/ops/bf16_rows.cuh"
#include "models/ops/op_checks.h"
#include "models/ops/rope.h"
#include "models/ops/rope_math.cuh"

namespace models::ops {
namespace {

constexpr int kThreads = 256;
using gpu::InverseFrequencies;
using gpu::kRopeMaxHalf;

template <int Vec>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const __nv_bfloat16* in, std::int64_t in_stride, __nv_bfloat16* out, std::int64_t out_stride,
                const std::int32_t* __restrict__ positions, std::int64_t tokens, int heads, int half, float direction,
                const InverseFrequencies inv_freq) {
  __shared__ double shared_inv_freq[kRopeMaxHalf];
  for (int i = threadIdx.x; i < half; i += blockDim.x) shared_inv_freq[i] = inv_freq.values[i];
  __syncthreads();

  const int groups = half / Vec;
  const int head_dim = 2 * half;
  const std::int64_t total = tokens * groups;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < total;
       item += stride) {
    const std::int64_t token = item / groups;
    const int first = static_cast<int>(item - token * groups) * Vec;
    const double position = static_cast<double>(positions[token]);
    float cos_of[Vec], sin_of[Vec];
#pragma unroll
    for (int k = 0; k < Vec; ++k)
      gpu::rope_cos_sin(position, shared_inv_freq[first + k], direction, cos_of[k], sin_of[k]);
    const __nv_bfloat16* src = in + token * in_stride + first;
    __nv_bfloat16* dst = out + token * out_stride + first;
    for (int h = 0; h < heads; ++h) {
      float a[Vec], b[Vec], out_a[Vec], out_b[Vec];
      gpu::load_bf16<Vec>(src + h * head_dim, a);
      gpu::load_bf16<Vec>(src + h * head_dim + half, b);
#pragma unroll
      for (int k = 0; k < Vec; ++k) {
        out_a[k] = gpu::rope_first(a[k], b[k], cos_of[k], sin_of[k]);
        out_b[k] = gpu::rope_second(a[k], b[k], cos_of[k], sin_of[k]);
      }
      gpu::store_bf16<Vec>(dst + h * head_dim, out_a);
      gpu::store_bf16<Vec>(dst + h * head_dim + half, out_b);
    }
  }
}

void rotate(std::string_view op, const __nv_bfloat16* in, std::int64_t in_stride, __nv_bfloat16* out,
            std::int64_t out_stride, const std::int32_t* positions, std::int64_t tokens, std::int64_t heads,
            std::int64_t head_dim, double theta, float direction, cudaStream_t stream) {
  checks::require_non_negative(op, "tokens", tokens);
  checks::require_positive(op, "heads", heads);
  checks::require_positive(op, "head_dim", head_dim);
  if (head_dim % 2 != 0) checks::fail(op, "head_dim must be even, got " + std::to_string(head_dim));
  if (head_dim > 2 * kRopeMaxHalf) {
    checks::fail(op,
                 "head_dim must be at most " + std::to_string(2 * kRopeMaxHalf) + ", got " + std::to_string(head_dim));
  }
  if (heads * head_dim > INT32_MAX) checks::fail(op, "heads * head_dim must be below 2^31");
  if (!(theta > 0.0) || !std::isfinite(theta)) checks::fail(op, "theta must be positive, got " + std::to_string(theta));
  const std::int64_t row = heads * head_dim;
  if (in_stride < row || out_stride < row) {
    checks::fail(op, "token strides (" + std::to_string(in_stride) + ", " + std::to_string(out_stride) +
                         ") must be at least heads * head_dim = " + std::to_string(row));
  }
  if (static_cast<const void*>(in) == static_cast<const void*>(out) && in_stride != out_stride) {
    checks::fail(op, "in-place rotation needs equal input and output token strides");
  }
  if (tokens == 0) return;

  const std::int64_t half = head_dim / 2;
  const InverseFrequencies inv_freq = gpu::inverse_frequencies(head_dim, theta);
  const bool vector = half % gpu::kVector == 0 && in_stride % gpu::kVector == 0 && out_stride % gpu::kVector == 0 &&
                      gpu::aligned_16(in) && gpu::aligned_16(out);
  const auto h = static_cast<int>(heads);
  const auto hf = static_cast<int>(half);
  if (vector) {
    rope_kernel<gpu::kVector><<<gpu::grid_for(tokens * (half / gpu::kVector), kThreads), kThreads, 0, stream>>>(
        in, in_stride, out, out_stride, positions, tokens, h, hf, direction, inv_freq);
  } else {
    rope_kernel<1><<<gpu::grid_for(tokens * half, kThreads), kThreads, 0, stream>>>(
        in, in_stride, out, out_stride, positions, tokens, h, hf, direction, inv_freq);
  }
  CUDA_CHECK_LAUNCH("rope_kernel");
}

}  // namespace

void rope_forward_cuda(const __nv_bfloat16* x, std::int64_t x_token_stride, __nv_bfloat16* out,
                       std::int64_t out_token_stride, const std::int32_t* positions, std::int64_t tokens,
                       std::int64_t heads, std::int64_t head_dim, double theta, cudaStream_t stream) {
  rotate("rope_forward_cuda", x, x_token_stride, out, out_token_stride, positions, tokens, heads, head_dim, theta, 1.0f,
         stream);
}

void rope_backward_cuda(const __nv_bfloat16* dout, std::int64_t dout_token_stride, __nv_bfloat16* dx,
                        std::int64_t dx_token_stride, const std::int32_t* positions, std::int64_t tokens,
                        std::int64_t heads, std::int64_t head_dim, double theta, cudaStream_t stream) {
  rotate("rope_backward_cuda", dout, dout_token_stride, dx, dx_token_stride, positions, tokens, heads, head_dim, theta,
         -1.0f, stream);
}

}  // namespace models::ops
