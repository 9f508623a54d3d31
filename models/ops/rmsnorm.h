// RMSNorm as in Qwen3 (Hugging Face Qwen3RMSNorm), over the last dimension:
//   rstd[n] = 1 / sqrt(mean_d(x[n, d]^2) + eps),   y[n, d] = x[n, d] * rstd[n] * w[d].
// Statistics are computed in double; rstd is saved (rounded to the element type) for the
// backward, which recomputes x_hat = x * rstd from it.
//
// Layouts (row-major): x, y, dy, dx [rows, dim]; w, dw [dim]; rstd [rows].
// The per-head norm of q and k is the same op over [tokens, heads, head_dim] viewed as
// [tokens * heads, head_dim] with a weight of [head_dim]: head_rmsnorm_* below.
//
// CUDA kernels (rmsnorm.cu): x, y, dy, dx bf16, the weight the slab's bf16 mirror, rstd fp32 and
// dweight the slab's fp32 gradient (accumulated). Statistics and all arithmetic are fp32; eps is
// rounded to fp32. A row group of 4 to 32 lanes (sized to the row) owns a row; its sums use a
// fixed shuffle tree. dweight is reduced without atomics: fixed chunks of rows write per-column
// partial sums to the workspace, then a second launch adds the partials in chunk order and adds
// the total to dweight, so results are bit-identical run to run. The head variants take a token
// stride (elements between consecutive tokens) for every [tokens, heads, head_dim] tensor, so q and
// k can be read from and dq, dk written into a packed qkv buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "models/ops/op_checks.h"

namespace models::ops {

template <typename Scalar>
void rmsnorm_forward_cpu(std::span<const Scalar> x, std::span<const Scalar> weight, std::int64_t rows, std::int64_t dim,
                         double eps, std::span<Scalar> y, std::span<Scalar> rstd);

// dx = rstd * (g - x_hat * mean_d(g * x_hat)) with g = dy * w (written);
// dw[d] += sum_n dy[n, d] * x_hat[n, d] (accumulated, summed in double in row order).
template <typename Scalar>
void rmsnorm_backward_cpu(std::span<const Scalar> dy, std::span<const Scalar> x, std::span<const Scalar> weight,
                          std::span<const Scalar> rstd, std::int64_t rows, std::int64_t dim, std::span<Scalar> dx,
                          std::span<Scalar> dweight);

// Per-head RMSNorm of q or k: x [tokens, heads, head_dim], weight [head_dim], rstd [tokens * heads].
template <typename Scalar>
void head_rmsnorm_forward_cpu(std::span<const Scalar> x, std::span<const Scalar> weight, std::int64_t tokens,
                              std::int64_t heads, std::int64_t head_dim, double eps, std::span<Scalar> y,
                              std::span<Scalar> rstd) {
  checks::require_non_negative("head_rmsnorm_forward", "tokens", tokens);
  checks::require_positive("head_rmsnorm_forward", "heads", heads);
  rmsnorm_forward_cpu<Scalar>(x, weight, tokens * heads, head_dim, eps, y, rstd);
}

template <typename Scalar>
void head_rmsnorm_backward_cpu(std::span<const Scalar> dy, std::span<const Scalar> x, std::span<const Scalar> weight,
                               std::span<const Scalar> rstd, std::int64_t tokens, std::int64_t heads,
                               std::int64_t head_dim, std::span<Scalar> dx, std::span<Scalar> dweight) {
  checks::require_non_negative("head_rmsnorm_backward", "tokens", tokens);
  checks::require_positive("head_rmsnorm_backward", "heads", heads);
  rmsnorm_backward_cpu<Scalar>(dy, x, weight, rstd, tokens * heads, head_dim, dx, dweight);
}

// y = rmsnorm(x) * w, rstd[rows], on `stream`. All pointers are device memory; y must not overlap x.
void rmsnorm_forward_cuda(const __nv_bfloat16* x, const __nv_bfloat16* weight, std::int64_t rows, std::int64_t dim,
                          double eps, __nv_bfloat16* y, float* rstd, cudaStream_t stream);

// Bytes of device workspace the backward needs (the dweight partials).
std::size_t rmsnorm_backward_workspace_bytes(std::int64_t rows, std::int64_t dim);

// dx written, dweight accumulated (+=), from the forward's rstd. dx must not overlap the inputs.
void rmsnorm_backward_cuda(const __nv_bfloat16* dy, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                           const float* rstd, std::int64_t rows, std::int64_t dim, __nv_bfloat16* dx, float* dweight,
                           void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// Per-head RMSNorm of [tokens, heads, head_dim] tensors whose tokens are `*_token_stride` elements
// apart (>= heads * head_dim); rstd is dense [tokens * heads].
void head_rmsnorm_forward_cuda(const __nv_bfloat16* x, std::int64_t x_token_stride, const __nv_bfloat16* weight,
                               std::int64_t tokens, std::int64_t heads, std::int64_t head_dim, double eps,
                               __nv_bfloat16* y, std::int64_t y_token_stride, float* rstd, cudaStream_t stream);

std::size_t head_rmsnorm_backward_workspace_bytes(std::int64_t tokens, std::int64_t heads, std::int64_t head_dim);

void head_rmsnorm_backward_cuda(const __nv_bfloat16* dy, std::int64_t dy_token_stride, const __nv_bfloat16* x,
                                std::int64_t x_token_stride, const __nv_bfloat16* weight, const float* rstd,
                                std::int64_t tokens, std::int64_t heads, std::int64_t head_dim, __nv_bfloat16* dx,
                                std::int64_t dx_token_stride, float* dweight, void* workspace,
                                std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace models::ops
