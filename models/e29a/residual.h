// How a layer's output y_l joins the residual stream (E29aConfig::residual), on the cpu:
//   pre_norm:    x_{l+1} = x_l + y_l
//   normed_sum:  s_l = x_l + y_l,   x_{l+1} = s_l / sqrt(mean_d(s_l^2) + eps)
// The normed sum is RMSNorm (ops/rmsnorm.h, its formulas and backward) with a unit weight: it adds
// no parameter, so both kinds have the same slab layout and Hugging Face tensors.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "models/e29a/config.h"

namespace models::e29a {

// What the normed sum's backward needs: the sum s [rows, dim] and its rstd [rows].
struct ResidualSaved {
  std::vector<float> sum, rstd;
};

// x = x_l in, x_{l+1} out. `saved` (may be null) receives the normed sum's s and rstd.
void residual_forward_cpu(Residual kind, std::span<const float> y, std::int64_t rows, std::int64_t dim, double eps,
                          std::span<float> x, ResidualSaved* saved);

// dx = dL/dx_{l+1} in, dL/ds_l out (what both terms of the sum get); unchanged for pre_norm.
void residual_backward_cpu(Residual kind, const ResidualSaved& saved, std::int64_t rows, std::int64_t dim,
                           std::span<float> dx);

}  // namespace models::e29a
