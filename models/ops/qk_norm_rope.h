// Qwen3's q/k path before attention in one pass: the per-head RMSNorm of q and of k (rmsnorm.h,
// each with its own weight) followed by RoPE (rope.h), as one op over the q and k heads of a token,
// which lie next to each other in the packed qkv buffer (q heads, then k heads). Run as four
// launches this reads and writes q and k twice each way; fused it reads the projection once and
// writes the rotated q and k once, and the backward reads dq, dk and the projection once and
// writes the projection's gradient once, with the two norm weights' gradients summed on the way.
//
// Definition (the reference, qk_norm_rope.cpp): y = rope(head_rmsnorm(x)) with q's weight on heads
// [0, q_heads) and k's on [q_heads, q_heads + kv_heads); the backward is rope's inverse rotation
// then the norm's backward. Layouts (row-major): x, y, dy, dx [tokens, q_heads + kv_heads,
// head_dim]; rstd_q [tokens, q_heads], rstd_k [tokens, kv_heads]; positions [tokens].
//
// CUDA kernels (qk_norm_rope.cu), bf16 activations with token strides (the packed buffers), the
// weights the slab's bf16 mirror, rstd fp32, dweights the slab's fp32 gradients (accumulated). The
// arithmetic is the unfused kernels' own (rmsnorm_math.cuh, rope_math.cuh), including the bf16
// rounding of the normed q and k before the rotation and of the rotated gradient before the norm's
// backward: y, rstd and dx equal the four launches' bit for bit. The weight gradients are summed in
// a fixed order of their own (fixed chunks of tokens, then the chunks in order): bit-identical run
// to run, not to the unfused reduction. head_dim 32, 64, 128 or 256 with 16-byte aligned rows
// (qk_norm_rope_supported); other shapes use the separate kernels.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace models::ops {

struct QkNormRopeShape {
  std::int64_t tokens = 0;
  std::int64_t q_heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  double eps = 1e-6;
  double theta = 1e6;
};

// y = rope(head_rmsnorm(x)), rstd saved for the backward.
template <typename Scalar>
void qk_norm_rope_forward_cpu(std::span<const Scalar> x, std::span<const Scalar> q_weight,
                              std::span<const Scalar> k_weight, std::span<const std::int32_t> positions,
                              const QkNormRopeShape& shape, std::span<Scalar> y, std::span<Scalar> rstd_q,
                              std::span<Scalar> rstd_k);

// dx written, dq_weight and dk_weight accumulated (+=).
template <typename Scalar>
void qk_norm_rope_backward_cpu(std::span<const Scalar> dy, std::span<const Scalar> x, std::span<const Scalar> q_weight,
                               std::span<const Scalar> k_weight, std::span<const Scalar> rstd_q,
                               std::span<const Scalar> rstd_k, std::span<const std::int32_t> positions,
                               const QkNormRopeShape& shape, std::span<Scalar> dx, std::span<Scalar> dq_weight,
                               std::span<Scalar> dk_weight);

// Whether the fused kernels take this shape and these buffers (head_dim, strides, alignment).
bool qk_norm_rope_supported(const QkNormRopeShape& shape, std::initializer_list<std::int64_t> token_strides,
                            std::initializer_list<const void*> pointers);

// Device pointers; y must not overlap x.
void qk_norm_rope_forward_cuda(const __nv_bfloat16* x, std::int64_t x_token_stride, const __nv_bfloat16* q_weight,
                               const __nv_bfloat16* k_weight, const std::int32_t* positions,
                               const QkNormRopeShape& shape, __nv_bfloat16* y, std::int64_t y_token_stride,
                               float* rstd_q, float* rstd_k, cudaStream_t stream);

// Bytes of device workspace the backward needs (the weight gradients' partial sums).
std::size_t qk_norm_rope_backward_workspace_bytes(const QkNormRopeShape& shape);

// dx must not overlap dy or x.
void qk_norm_rope_backward_cuda(const __nv_bfloat16* dy, std::int64_t dy_token_stride, const __nv_bfloat16* x,
                                std::int64_t x_token_stride, const __nv_bfloat16* q_weight,
                                const __nv_bfloat16* k_weight, const float* rstd_q, const float* rstd_k,
                                const std::int32_t* positions, const QkNormRopeShape& shape, __nv_bfloat16* dx,
                                std::int64_t dx_token_stride, float* dq_weight, float* dk_weight, void* workspace,
                                std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace models::ops
