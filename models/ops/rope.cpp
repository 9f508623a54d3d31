// CPU reference of RoPE: per token, the cosines and sines of its position are computed once
// (double, rounded to the element type) and applied to every head.
#include "models/ops/rope.h"

#include <cmath>
#include <string>
#include <vector>

#include "models/ops/op_checks.h"

namespace models::ops {
namespace {

// Rotates every head of every token by +angle (forward) or -angle (backward).
template <typename Scalar>
void rotate(std::string_view op, std::string_view in_name, std::span<const Scalar> in,
            std::span<const std::int32_t> positions, std::int64_t heads, std::int64_t head_dim, double theta,
            std::string_view out_name, std::span<Scalar> out, double direction) {
  checks::require_positive(op, "heads", heads);
  checks::require_positive(op, "head_dim", head_dim);
  if (head_dim % 2 != 0) checks::fail(op, "head_dim must be even, got " + std::to_string(head_dim));
  if (!(theta > 0.0) || !std::isfinite(theta)) checks::fail(op, "theta must be positive, got " + std::to_string(theta));
  const auto tokens = static_cast<std::int64_t>(positions.size());
  checks::require_size(op, in_name, in, tokens * heads * head_dim, "tokens * heads * head_dim");
  checks::require_size(op, out_name, out, tokens * heads * head_dim, "tokens * heads * head_dim");
  if (static_cast<const void*>(out.data()) != static_cast<const void*>(in.data())) {
    checks::require_disjoint(op, {checks::region(out_name, out)}, {checks::region(in_name, in)});
  }
  checks::require_disjoint(op, {checks::region(out_name, out)}, {checks::region("positions", positions)});
  for (std::size_t n = 0; n < positions.size(); ++n) {
    if (positions[n] < 0) {
      checks::fail(op, "position " + std::to_string(positions[n]) + " of token " + std::to_string(n) + " is negative");
    }
  }

  const std::int64_t half = head_dim / 2;
  std::vector<double> inv_freq(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) {
    inv_freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  }

#pragma omp parallel
  {
    std::vector<double> cos_of(static_cast<std::size_t>(half)), sin_of(static_cast<std::size_t>(half));
#pragma omp for schedule(static)
    for (std::int64_t n = 0; n < tokens; ++n) {
      const double position = static_cast<double>(positions[static_cast<std::size_t>(n)]);
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = position * inv_freq[i];
        cos_of[i] = static_cast<double>(static_cast<Scalar>(std::cos(angle)));
        sin_of[i] = direction * static_cast<double>(static_cast<Scalar>(std::sin(angle)));
      }
      for (std::int64_t h = 0; h < heads; ++h) {
        const Scalar* src = in.data() + (n * heads + h) * head_dim;
        Scalar* dst = out.data() + (n * heads + h) * head_dim;
        for (std::int64_t i = 0; i < half; ++i) {
          const double first = static_cast<double>(src[i]);
          const double second = static_cast<double>(src[i + half]);
          dst[i] = static_cast<Scalar>(first * cos_of[i] - second * sin_of[i]);
          dst[i + half] = static_cast<Scalar>(second * cos_of[i] + first * sin_of[i]);
        }
      }
    }
  }
}

}  // namespace

template <typename Scalar>
void rope_forward_cpu(std::span<const Scalar> x, std::span<const std::int32_t> positions, std::int64_t heads,
                      std::int64_t head_dim, double theta, std::span<Scalar> out) {
  rotate<Scalar>("rope_forward", "x", x, positions, heads, head_dim, theta, "out", out, 1.0);
}

template <typename Scalar>
void rope_backward_cpu(std::span<const Scalar> dout, std::span<const std::int32_t> positions, std::int64_t heads,
                       std::int64_t head_dim, double theta, std::span<Scalar> dx) {
  rotate<Scalar>("rope_backward", "dout", dout, positions, heads, head_dim, theta, "dx", dx, -1.0);
}

template void rope_forward_cpu<float>(std::span<const float>, std::span<const std::int32_t>, std::int64_t, std::int64_t,
                                      double, std::span<float>);
template void rope_forward_cpu<double>(std::span<const double>, std::span<const std::int32_t>, std::int64_t,
                                       std::int64_t, double, std::span<double>);
template void rope_backward_cpu<float>(std::span<const float>, std::span<const std::int32_t>, std::int64_t,
                                       std::int64_t, double, std::span<float>);
template void rope_backward_cpu<double>(std::span<const double>, std::span<const std::int32_t>, std::int64_t,
                                        std::int64_t, double, std::span<double>);

}  // namespace models::ops
