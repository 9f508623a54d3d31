// CUDA kernels of the fused q/k norm + RoPE (qk_norm_rope.h). A warp walks tokens; per token it
// computes the cosines and sines of its lanes' rotation pairs once, then takes the token's q and
// k heads 32 / L at a time, L = head_dim / 8 lanes to a head, each lane holding 8 consecutive
// elements (the layout and sum tree of the unfused norm kernels, so the sums round alike). The
// partner of element i in the rotation, i + head_dim / 2, sits L / 2 lanes away: one shuffle.
// Backward: each warp owns a fixed chunk of tokens and sums its lanes' weight-gradient terms in
// registers over the chunk, then the groups of the warp are added in a fixed tree and written as
// the chunk's partials; a second launch adds the chunks in order (column_sums.cuh).
#include <string>
#include <type_traits>

#include "core/error.h"
#include "models/ops/bf16_rows.cuh"
#include "models/ops/column_sums.cuh"
#include "models/ops/op_checks.h"
#include "models/ops/qk_norm_rope.h"
#include "models/ops/rmsnorm_math.cuh"
#include "models/ops/rope_math.cuh"

namespace models::ops {
namespace {

using gpu::ceil_div;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = gpu::kVector;
constexpr std::int64_t kTokensPerWarp = 8;  // the backward's chunk: one row of weight-gradient partials
constexpr unsigned kAll = 0xFFFFFFFFu;

struct Layout {
  std::int64_t tokens;
  int q_heads, kv_heads;
};

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// This lane's place: its 8 columns, which half of the rotation they are in, and its head group.
template <int Lanes>
struct LanePlace {
  static constexpr int kHeadDim = Lanes * kVec;
  static constexpr int kHalfLanes = Lanes / 2;
  static constexpr int kGroups = 32 / Lanes;
  int lane = threadIdx.x % 32;
  int column = (lane % Lanes) * kVec;
  int group = lane / Lanes;
  bool first_half = lane % Lanes < kHalfLanes;
  int pair = (lane % kHalfLanes) * kVec;  // the rotation pair of this lane's first element
};

// The element of the other half of the rotation, rotated with this lane's: y = rope(a, b).
template <int Lanes>
__device__ __forceinline__ void rotate(const LanePlace<Lanes>& at, const float (&v)[kVec], const float (&c)[kVec],
                                       const float (&s)[kVec], float (&out)[kVec]) {
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const float other = __shfl_xor_sync(kAll, v[k], LanePlace<Lanes>::kHalfLanes);
    out[k] = at.first_half ? gpu::rope_first(v[k], other, c[k], s[k]) : gpu::rope_second(other, v[k], c[k], s[k]);
  }
}

template <int Lanes>
__device__ __forceinline__ void cos_sin(const LanePlace<Lanes>& at, const double* inv_freq, std::int32_t position,
                                        float direction, float (&c)[kVec], float (&s)[kVec]) {
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    gpu::rope_cos_sin(static_cast<double>(position), inv_freq[at.pair + k], direction, c[k], s[k]);
  }
}

// The block's copy of the inverse frequencies in shared memory (every thread calls this once).
template <int Lanes>
__device__ __forceinline__ const double* stage_inverse_frequencies(const gpu::InverseFrequencies& inv_freq) {
  constexpr int kHalf = LanePlace<Lanes>::kHeadDim / 2;
  __shared__ double shared[kHalf];
  for (int i = threadIdx.x; i < kHalf; i += blockDim.x) shared[i] = inv_freq.values[i];
  __syncthreads();
  return shared;
}

// What both kernels start from: the lane's place, the block's inverse frequencies, and the lane's 8
// columns of both norm weights.
template <int Lanes>
struct KernelStart {
  LanePlace<Lanes> at;
  const double* inv_freq;
  float wq[kVec], wk[kVec];
  __device__ KernelStart(const gpu::InverseFrequencies& f, const __nv_bfloat16* q_weight, const __nv_bfloat16* k_weight)
      : inv_freq(stage_inverse_frequencies<Lanes>(f)) {
    gpu::load_bf16<kVec>(q_weight + at.column, wq);
    gpu::load_bf16<kVec>(k_weight + at.column, wk);
  }
  __device__ float weight(bool is_q, int k) const { return is_q ? wq[k] : wk[k]; }
};

template <int Lanes>
__global__ void __launch_bounds__(kThreads)
    qk_norm_rope_forward_kernel(const __nv_bfloat16* __restrict__ x, std::int64_t x_stride,
                                const __nv_bfloat16* __restrict__ q_weight, const __nv_bfloat16* __restrict__ k_weight,
                                const std::int32_t* __restrict__ positions, Layout layout, float eps,
                                __nv_bfloat16* __restrict__ y, std::int64_t y_stride, float* __restrict__ rstd_q,
                                float* __restrict__ rstd_k, const gpu::InverseFrequencies inv_freq) {
  using Place = LanePlace<Lanes>;
  const KernelStart<Lanes> start(inv_freq, q_weight, k_weight);
  const Place& at = start.at;
  const int heads = layout.q_heads + layout.kv_heads;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarps;
  for (std::int64_t token = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; token < layout.tokens;
       token += warps) {
    float c[kVec], s[kVec];
    cos_sin(at, start.inv_freq, positions[token], 1.0f, c, s);
    for (int h0 = 0; h0 < heads; h0 += Place::kGroups) {
      const int h = h0 + at.group;
      const bool active = h < heads, is_q = h < layout.q_heads;
      float v[kVec] = {};
      if (active) gpu::load_bf16<kVec>(x + token * x_stride + h * Place::kHeadDim + at.column, v);
      float sum_sq = 0.0f;
#pragma unroll
      for (int k = 0; k < kVec; ++k) sum_sq = fmaf(v[k], v[k], sum_sq);
      sum_sq = gpu::group_sum<Lanes>(sum_sq);
      const float r = gpu::rms_inverse(sum_sq, Place::kHeadDim, eps);
      float normed[kVec], out[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) normed[k] = round_bf16(gpu::rms_apply(v[k], r, start.weight(is_q, k)));
      rotate(at, normed, c, s, out);
      if (!active) continue;
      gpu::store_bf16<kVec>(y + token * y_stride + h * Place::kHeadDim + at.column, out);
      if (at.lane % Lanes == 0) {
        if (is_q) {
          rstd_q[token * layout.q_heads + h] = r;
        } else {
          rstd_k[token * layout.kv_heads + (h - layout.q_heads)] = r;
        }
      }
    }
  }
}

template <int Lanes>
__global__ void __launch_bounds__(kThreads)
    qk_norm_rope_backward_kernel(const __nv_bfloat16* __restrict__ dy, std::int64_t dy_stride,
                                 const __nv_bfloat16* __restrict__ x, std::int64_t x_stride,
                                 const __nv_bfloat16* __restrict__ q_weight, const __nv_bfloat16* __restrict__ k_weight,
                                 const float* __restrict__ rstd_q, const float* __restrict__ rstd_k,
                                 const std::int32_t* __restrict__ positions, Layout layout,
                                 __nv_bfloat16* __restrict__ dx, std::int64_t dx_stride, float* __restrict__ partials,
                                 const gpu::InverseFrequencies inv_freq) {
  using Place = LanePlace<Lanes>;
  const KernelStart<Lanes> start(inv_freq, q_weight, k_weight);
  const Place& at = start.at;
  const int heads = layout.q_heads + layout.kv_heads;
  const std::int64_t chunk = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const std::int64_t first = chunk * kTokensPerWarp;
  const std::int64_t last = first + kTokensPerWarp < layout.tokens ? first + kTokensPerWarp : layout.tokens;
  float acc_q[kVec] = {}, acc_k[kVec] = {};
  for (std::int64_t token = first; token < last; ++token) {
    float c[kVec], s[kVec];
    cos_sin(at, start.inv_freq, positions[token], -1.0f, c, s);
    for (int h0 = 0; h0 < heads; h0 += Place::kGroups) {
      const int h = h0 + at.group;
      const bool active = h < heads, is_q = h < layout.q_heads;
      float d[kVec] = {}, xv[kVec] = {}, g[kVec];
      if (active) {
        gpu::load_bf16<kVec>(dy + token * dy_stride + h * Place::kHeadDim + at.column, d);
        gpu::load_bf16<kVec>(x + token * x_stride + h * Place::kHeadDim + at.column, xv);
      }
      rotate(at, d, c, s, g);
      float g_dot_x = 0.0f;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        g[k] = round_bf16(g[k]);  // the rotated gradient as the unfused path stores it
        g_dot_x = fmaf(g[k] * (start.weight(is_q, k)), xv[k], g_dot_x);
      }
      g_dot_x = gpu::group_sum<Lanes>(g_dot_x);
      if (!active) continue;
      const float r =
          is_q ? rstd_q[token * layout.q_heads + h] : rstd_k[token * layout.kv_heads + (h - layout.q_heads)];
      const float mean = gpu::rms_mean(g_dot_x, r, Place::kHeadDim);
      float out[kVec];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        out[k] = gpu::rms_dx(g[k], start.weight(is_q, k), xv[k], r, mean);
        float& acc = is_q ? acc_q[k] : acc_k[k];
        acc = fmaf(g[k], xv[k] * r, acc);
      }
      gpu::store_bf16<kVec>(dx + token * dx_stride + h * Place::kHeadDim + at.column, out);
    }
  }
  // The warp's groups hold the same columns: a fixed tree over the group bits of the lane index.
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    for (int offset = Lanes; offset < 32; offset <<= 1) {
      acc_q[k] += __shfl_xor_sync(kAll, acc_q[k], offset);
      acc_k[k] += __shfl_xor_sync(kAll, acc_k[k], offset);
    }
  }
  if (at.group != 0 || first >= layout.tokens) return;
  float* row = partials + chunk * 2 * Place::kHeadDim;
  gpu::store_float<kVec>(row + at.column, acc_q);
  gpu::store_float<kVec>(row + Place::kHeadDim + at.column, acc_k);
}

// Adds the chunks' partials [chunks, 2 * head_dim] in order onto dq_weight and dk_weight.
__global__ void __launch_bounds__(kThreads)
    qk_norm_dweight_combine_kernel(const float* __restrict__ partials, std::int64_t chunks, int head_dim,
                                   float* __restrict__ dq_weight, float* __restrict__ dk_weight) {
  const std::int64_t column = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x % 32;
  const float total = gpu::fixed_order_column_sum<kThreads>(partials, chunks, 2 * head_dim, column);
  if (threadIdx.x >= 32 || column >= 2 * head_dim) return;
  if (column < head_dim) {
    dq_weight[column] += total;
  } else {
    dk_weight[column - head_dim] += total;
  }
}

std::int64_t chunks_for(std::int64_t tokens) { return ceil_div(tokens, kTokensPerWarp); }

void check(std::string_view op, const QkNormRopeShape& s, std::initializer_list<std::int64_t> strides,
           std::initializer_list<const void*> pointers) {
  checks::require_non_negative(op, "tokens", s.tokens);
  checks::require_positive(op, "q_heads", s.q_heads);
  checks::require_positive(op, "kv_heads", s.kv_heads);
  if (!qk_norm_rope_supported(s, strides, pointers)) {
    checks::fail(op, "needs head_dim 32, 64, 128 or 256 (got " + std::to_string(s.head_dim) +
                         "), token strides of at least (q_heads + kv_heads) * head_dim in multiples of 8, and "
                         "16-byte aligned buffers");
  }
  if (!(s.eps >= 0.0)) checks::fail(op, "eps must be non-negative, got " + std::to_string(s.eps));
  if (!(s.theta > 0.0)) checks::fail(op, "theta must be positive, got " + std::to_string(s.theta));
}

template <class Launch>
void dispatch(std::int64_t head_dim, Launch launch) {
  switch (head_dim) {
    case 32: launch(std::integral_constant<int, 4>{}); break;
    case 64: launch(std::integral_constant<int, 8>{}); break;
    case 128: launch(std::integral_constant<int, 16>{}); break;
    default: launch(std::integral_constant<int, 32>{}); break;
  }
}

}  // namespace

bool qk_norm_rope_supported(const QkNormRopeShape& s, std::initializer_list<std::int64_t> token_strides,
                            std::initializer_list<const void*> pointers) {
  if (s.head_dim != 32 && s.head_dim != 64 && s.head_dim != 128 && s.head_dim != 256) return false;
  if (s.q_heads <= 0 || s.kv_heads <= 0) return false;
  for (const std::int64_t stride : token_strides) {
    if (stride % gpu::kVector != 0 || stride < (s.q_heads + s.kv_heads) * s.head_dim) return false;
  }
  for (const void* p : pointers) {
    if (!gpu::aligned_16(p)) return false;
  }
  return true;
}

void qk_norm_rope_forward_cuda(const __nv_bfloat16* x, std::int64_t x_token_stride, const __nv_bfloat16* q_weight,
                               const __nv_bfloat16* k_weight, const std::int32_t* positions, const QkNormRopeShape& s,
                               __nv_bfloat16* y, std::int64_t y_token_stride, float* rstd_q, float* rstd_k,
                               cudaStream_t stream) {
  check("qk_norm_rope_forward_cuda", s, {x_token_stride, y_token_stride}, {x, q_weight, k_weight, y});
  if (s.tokens == 0) return;
  const Layout layout{s.tokens, static_cast<int>(s.q_heads), static_cast<int>(s.kv_heads)};
  const gpu::InverseFrequencies inv_freq = gpu::inverse_frequencies(s.head_dim, s.theta);
  const auto blocks = static_cast<unsigned int>(ceil_div(s.tokens, kWarps));
  dispatch(s.head_dim, [&](auto lanes) {
    qk_norm_rope_forward_kernel<decltype(lanes)::value>
        <<<blocks, kThreads, 0, stream>>>(x, x_token_stride, q_weight, k_weight, positions, layout,
                                          static_cast<float>(s.eps), y, y_token_stride, rstd_q, rstd_k, inv_freq);
  });
  CUDA_CHECK_LAUNCH("qk_norm_rope_forward_kernel");
}

std::size_t qk_norm_rope_backward_workspace_bytes(const QkNormRopeShape& s) {
  return static_cast<std::size_t>(chunks_for(s.tokens)) * 2 * static_cast<std::size_t>(s.head_dim) * sizeof(float);
}

void qk_norm_rope_backward_cuda(const __nv_bfloat16* dy, std::int64_t dy_token_stride, const __nv_bfloat16* x,
                                std::int64_t x_token_stride, const __nv_bfloat16* q_weight,
                                const __nv_bfloat16* k_weight, const float* rstd_q, const float* rstd_k,
                                const std::int32_t* positions, const QkNormRopeShape& s, __nv_bfloat16* dx,
                                std::int64_t dx_token_stride, float* dq_weight, float* dk_weight, void* workspace,
                                std::size_t workspace_bytes, cudaStream_t stream) {
  constexpr std::string_view op = "qk_norm_rope_backward_cuda";
  check(op, s, {dy_token_stride, x_token_stride, dx_token_stride}, {dy, x, q_weight, k_weight, dx, workspace});
  if (s.tokens == 0) return;
  const std::size_t needed = qk_norm_rope_backward_workspace_bytes(s);
  if (workspace_bytes < needed) {
    checks::fail(op, "workspace has " + std::to_string(workspace_bytes) + " bytes, needs " + std::to_string(needed));
  }
  const Layout layout{s.tokens, static_cast<int>(s.q_heads), static_cast<int>(s.kv_heads)};
  const gpu::InverseFrequencies inv_freq = gpu::inverse_frequencies(s.head_dim, s.theta);
  const std::int64_t chunks = chunks_for(s.tokens);
  auto* partials = static_cast<float*>(workspace);
  dispatch(s.head_dim, [&](auto lanes) {
    qk_norm_rope_backward_kernel<decltype(lanes)::value>
        <<<static_cast<unsigned int>(ceil_div(chunks, kWarps)), kThreads, 0, stream>>>(
            dy, dy_token_stride, x, x_token_stride, q_weight, k_weight, rstd_q, rstd_k, positions, layout, dx,
            dx_token_stride, partials, inv_freq);
  });
  CUDA_CHECK_LAUNCH("qk_norm_rope_backward_kernel");
  qk_norm_dweight_combine_kernel<<<static_cast<unsigned int>(ceil_div(2 * s.head_dim, 32)), kThreads, 0, stream>>>(
      partials, chunks, static_cast<int>(s.head_dim), dq_weight, dk_weight);
  CUDA_CHECK_LAUNCH("qk_norm_dweight_combine_kernel");
}

}  // namespace models::ops
