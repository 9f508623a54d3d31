// CPU reference of the bias-free linear layer, on the blocked double-accumulating products.
#include "models/ops/linear.h"

#include "models/ops/matmul_cpu.h"
#include "models/ops/op_checks.h"

namespace models::ops {
namespace {

void check_shape(std::string_view op, std::int64_t rows, std::int64_t in_features, std::int64_t out_features) {
  checks::require_non_negative(op, "rows", rows);
  checks::require_positive(op, "in_features", in_features);
  checks::require_positive(op, "out_features", out_features);
}

}  // namespace

template <typename Scalar>
void linear_forward_cpu(std::span<const Scalar> x, std::span<const Scalar> weight, std::int64_t rows,
                        std::int64_t in_features, std::int64_t out_features, std::span<Scalar> y) {
  constexpr std::string_view op = "linear_forward";
  check_shape(op, rows, in_features, out_features);
  checks::require_size(op, "x", x, rows * in_features, "rows * in_features");
  checks::require_size(op, "weight", weight, out_features * in_features, "out_features * in_features");
  checks::require_size(op, "y", y, rows * out_features, "rows * out_features");
  checks::require_disjoint(op, {checks::region("y", y)}, {checks::region("x", x), checks::region("weight", weight)});
  matmul_nt_cpu(x.data(), weight.data(), rows, out_features, in_features, y.data(), Accumulate::overwrite);
}

template <typename Scalar>
void linear_backward_cpu(std::span<const Scalar> dy, std::span<const Scalar> x, std::span<const Scalar> weight,
                         std::int64_t rows, std::int64_t in_features, std::int64_t out_features, std::span<Scalar> dx,
                         std::span<Scalar> dweight) {
  constexpr std::string_view op = "linear_backward";
  check_shape(op, rows, in_features, out_features);
  checks::require_size(op, "dy", dy, rows * out_features, "rows * out_features");
  checks::require_size(op, "x", x, rows * in_features, "rows * in_features");
  checks::require_size(op, "weight", weight, out_features * in_features, "out_features * in_features");
  checks::require_size(op, "dx", dx, rows * in_features, "rows * in_features");
  checks::require_size(op, "dweight", dweight, out_features * in_features, "out_features * in_features");
  checks::require_disjoint(op, {checks::region("dx", dx), checks::region("dweight", dweight)},
                           {checks::region("dy", dy), checks::region("x", x), checks::region("weight", weight)});
  matmul_nn_cpu(dy.data(), weight.data(), rows, in_features, out_features, dx.data(), Accumulate::overwrite);
  matmul_tn_cpu(dy.data(), x.data(), out_features, in_features, rows, dweight.data(), Accumulate::add);
}

template void linear_forward_cpu<float>(std::span<const float>, std::span<const float>, std::int64_t, std::int64_t,
                                        std::int64_t, std::span<float>);
template void linear_forward_cpu<double>(std::span<const double>, std::span<const double>, std::int64_t, std::int64_t,
                                         std::int64_t, std::span<double>);
template void linear_backward_cpu<float>(std::span<const float>, std::span<const float>, std::span<const float>,
                                         std::int64_t, std::int64_t, std::int64_t, std::span<float>, std::span<float>);
template void linear_backward_cpu<double>(std::span<const double>, std::span<const double>, std::span<const double>,
                                          std::int64_t, std::int64_t, std::int64_t, std::span<double>,
                                          std::span<double>);

}  // namespace models::ops
