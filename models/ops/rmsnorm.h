// RMSNorm as in Qwen3 (Hugging Face Qwen3RMSNorm), over the last dimension:
//   rstd[n] = 1 / sqrt(mean_d(x[n, d]^2) + eps),   y[n, d] = x[n, d] * rstd[n] * w[d].
// Statistics are computed in double; rstd is saved (rounded to the element type) for the
// backward, which recomputes x_hat = x * rstd from it.
//
// Layouts (row-major): x, y, dy, dx [rows, dim]; w, dw [dim]; rstd [rows].
// The per-head norm of q and k is the same op over [tokens, heads, head_dim] viewed as
// [tokens * heads, head_dim] with a weight of [head_dim]: head_rmsnorm_* below.
#pragma once

#include <cstdint>
#include <span>

#include "models/ops/op_checks.h"

namespace models::ops {

template <typename Scalar>
void rmsnorm_forward_cpu(std::span<const Scalar> x, std::span<const Scalar> weight, std::int64_t rows,
                         std::int64_t dim, double eps, std::span<Scalar> y, std::span<Scalar> rstd);

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

}  // namespace models::ops
