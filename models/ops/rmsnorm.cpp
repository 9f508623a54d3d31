// CPU reference of RMSNorm. Rows are independent in the forward and for dx; the weight
// gradient is reduced over rows by column blocks, each owned by one thread, so the sum order is
// fixed whatever the thread count.
#include "models/ops/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "models/ops/matmul_cpu.h"
#include "models/ops/op_checks.h"

namespace models::ops {
namespace {

void check_shape(std::string_view op, std::int64_t rows, std::int64_t dim) {
  checks::require_non_negative(op, "rows", rows);
  checks::require_positive(op, "dim", dim);
}

}  // namespace

template <typename Scalar>
void rmsnorm_forward_cpu(std::span<const Scalar> x, std::span<const Scalar> weight, std::int64_t rows, std::int64_t dim,
                         double eps, std::span<Scalar> y, std::span<Scalar> rstd) {
  constexpr std::string_view op = "rmsnorm_forward";
  check_shape(op, rows, dim);
  if (!(eps >= 0.0)) checks::fail(op, "eps must be non-negative, got " + std::to_string(eps));
  checks::require_size(op, "x", x, rows * dim, "rows * dim");
  checks::require_size(op, "weight", weight, dim, "dim");
  checks::require_size(op, "y", y, rows * dim, "rows * dim");
  checks::require_size(op, "rstd", rstd, rows, "rows");
  checks::require_disjoint(op, {checks::region("y", y), checks::region("rstd", rstd)},
                           {checks::region("x", x), checks::region("weight", weight)});

  const Scalar* w = weight.data();
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < rows; ++n) {
    const Scalar* x_row = x.data() + n * dim;
    Scalar* y_row = y.data() + n * dim;
    const double r = 1.0 / std::sqrt(dot_double(x_row, x_row, dim) / static_cast<double>(dim) + eps);
    for (std::int64_t d = 0; d < dim; ++d) {
      y_row[d] = static_cast<Scalar>(static_cast<double>(x_row[d]) * r * static_cast<double>(w[d]));
    }
    rstd[static_cast<std::size_t>(n)] = static_cast<Scalar>(r);
  }
}

template <typename Scalar>
void rmsnorm_backward_cpu(std::span<const Scalar> dy, std::span<const Scalar> x, std::span<const Scalar> weight,
                          std::span<const Scalar> rstd, std::int64_t rows, std::int64_t dim, std::span<Scalar> dx,
                          std::span<Scalar> dweight) {
  constexpr std::string_view op = "rmsnorm_backward";
  check_shape(op, rows, dim);
  checks::require_size(op, "dy", dy, rows * dim, "rows * dim");
  checks::require_size(op, "x", x, rows * dim, "rows * dim");
  checks::require_size(op, "weight", weight, dim, "dim");
  checks::require_size(op, "rstd", rstd, rows, "rows");
  checks::require_size(op, "dx", dx, rows * dim, "rows * dim");
  checks::require_size(op, "dweight", dweight, dim, "dim");
  checks::require_disjoint(op, {checks::region("dx", dx), checks::region("dweight", dweight)},
                           {checks::region("dy", dy), checks::region("x", x), checks::region("weight", weight),
                            checks::region("rstd", rstd)});

  const Scalar* w = weight.data();
  const Scalar* r_of = rstd.data();
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < rows; ++n) {
    const Scalar* x_row = x.data() + n * dim;
    const Scalar* dy_row = dy.data() + n * dim;
    Scalar* dx_row = dx.data() + n * dim;
    const double r = static_cast<double>(r_of[n]);
    double g_dot_xhat = 0.0;
    for (std::int64_t d = 0; d < dim; ++d) {
      g_dot_xhat += static_cast<double>(dy_row[d]) * static_cast<double>(w[d]) * static_cast<double>(x_row[d]) * r;
    }
    const double mean = g_dot_xhat / static_cast<double>(dim);
    for (std::int64_t d = 0; d < dim; ++d) {
      const double g = static_cast<double>(dy_row[d]) * static_cast<double>(w[d]);
      const double x_hat = static_cast<double>(x_row[d]) * r;
      dx_row[d] = static_cast<Scalar>(r * (g - x_hat * mean));
    }
  }

  constexpr std::int64_t kColumns = 64;
  const std::int64_t blocks = (dim + kColumns - 1) / kColumns;
#pragma omp parallel for schedule(static)
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t d0 = b * kColumns, width = std::min(dim, d0 + kColumns) - d0;
    double acc[kColumns] = {};
    for (std::int64_t n = 0; n < rows; ++n) {
      const double r = static_cast<double>(r_of[n]);
      const Scalar* x_row = x.data() + n * dim + d0;
      const Scalar* dy_row = dy.data() + n * dim + d0;
      for (std::int64_t d = 0; d < width; ++d) {
        acc[d] += static_cast<double>(dy_row[d]) * (static_cast<double>(x_row[d]) * r);
      }
    }
    for (std::int64_t d = 0; d < width; ++d) {
      dweight[static_cast<std::size_t>(d0 + d)] =
          static_cast<Scalar>(static_cast<double>(dweight[static_cast<std::size_t>(d0 + d)]) + acc[d]);
    }
  }
}

template void rmsnorm_forward_cpu<float>(std::span<const float>, std::span<const float>, std::int64_t, std::int64_t,
                                         double, std::span<float>, std::span<float>);
template void rmsnorm_forward_cpu<double>(std::span<const double>, std::span<const double>, std::int64_t, std::int64_t,
                                          double, std::span<double>, std::span<double>);
template void rmsnorm_backward_cpu<float>(std::span<const float>, std::span<const float>, std::span<const float>,
                                          std::span<const float>, std::int64_t, std::int64_t, std::span<float>,
                                          std::span<float>);
template void rmsnorm_backward_cpu<double>(std::span<const double>, std::span<const double>, std::span<const double>,
                                           std::span<const double>, std::int64_t, std::int64_t, std::span<double>,
                                           std::span<double>);

}  // namespace models::ops
