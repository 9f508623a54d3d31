// CPU reference of SwiGLU: independent rows, elementwise math in double.
#include "models/ops/swiglu.h"

#include <cmath>

#include "models/ops/op_checks.h"

namespace models::ops {
namespace {

double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

void check_shape(std::string_view op, std::int64_t rows, std::int64_t features) {
  checks::require_non_negative(op, "rows", rows);
  checks::require_positive(op, "features", features);
}

}  // namespace

template <typename Scalar>
void swiglu_forward_cpu(std::span<const Scalar> gate_up, std::int64_t rows, std::int64_t features,
                        std::span<Scalar> out) {
  constexpr std::string_view op = "swiglu_forward";
  check_shape(op, rows, features);
  checks::require_size(op, "gate_up", gate_up, rows * 2 * features, "rows * 2 * features");
  checks::require_size(op, "out", out, rows * features, "rows * features");
  checks::require_disjoint(op, {checks::region("out", out)}, {checks::region("gate_up", gate_up)});

#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < rows; ++n) {
    const Scalar* gate = gate_up.data() + n * 2 * features;
    const Scalar* up = gate + features;
    Scalar* out_row = out.data() + n * features;
    for (std::int64_t f = 0; f < features; ++f) {
      const double g = static_cast<double>(gate[f]);
      out_row[f] = static_cast<Scalar>(g * sigmoid(g) * static_cast<double>(up[f]));
    }
  }
}

template <typename Scalar>
void swiglu_backward_cpu(std::span<const Scalar> dout, std::span<const Scalar> gate_up, std::int64_t rows,
                         std::int64_t features, std::span<Scalar> dgate_up) {
  constexpr std::string_view op = "swiglu_backward";
  check_shape(op, rows, features);
  checks::require_size(op, "dout", dout, rows * features, "rows * features");
  checks::require_size(op, "gate_up", gate_up, rows * 2 * features, "rows * 2 * features");
  checks::require_size(op, "dgate_up", dgate_up, rows * 2 * features, "rows * 2 * features");
  checks::require_disjoint(op, {checks::region("dgate_up", dgate_up)},
                           {checks::region("dout", dout), checks::region("gate_up", gate_up)});

#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < rows; ++n) {
    const Scalar* gate = gate_up.data() + n * 2 * features;
    const Scalar* up = gate + features;
    const Scalar* dout_row = dout.data() + n * features;
    Scalar* dgate = dgate_up.data() + n * 2 * features;
    Scalar* dup = dgate + features;
    for (std::int64_t f = 0; f < features; ++f) {
      const double g = static_cast<double>(gate[f]);
      const double s = sigmoid(g);
      const double d = static_cast<double>(dout_row[f]);
      dgate[f] = static_cast<Scalar>(d * static_cast<double>(up[f]) * s * (1.0 + g * (1.0 - s)));
      dup[f] = static_cast<Scalar>(d * g * s);
    }
  }
}

template void swiglu_forward_cpu<float>(std::span<const float>, std::int64_t, std::int64_t, std::span<float>);
template void swiglu_forward_cpu<double>(std::span<const double>, std::int64_t, std::int64_t, std::span<double>);
template void swiglu_backward_cpu<float>(std::span<const float>, std::span<const float>, std::int64_t, std::int64_t,
                                         std::span<float>);
template void swiglu_backward_cpu<double>(std::span<const double>, std::span<const double>, std::int64_t, std::int64_t,
                                          std::span<double>);

}  // namespace models::ops
