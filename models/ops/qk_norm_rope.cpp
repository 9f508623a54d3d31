// CPU reference of the fused q/k norm + RoPE: the q and k heads split out of the packed rows, each
// through head_rmsnorm and rope (their own references), and merged back.
#include "models/ops/qk_norm_rope.h"

#include <string>
#include <vector>

#include "models/ops/op_checks.h"
#include "models/ops/rmsnorm.h"
#include "models/ops/rope.h"

namespace models::ops {
namespace {

constexpr std::string_view kForward = "qk_norm_rope_forward";
constexpr std::string_view kBackward = "qk_norm_rope_backward";

void check_shape(std::string_view op, const QkNormRopeShape& s) {
  checks::require_non_negative(op, "tokens", s.tokens);
  checks::require_positive(op, "q_heads", s.q_heads);
  checks::require_positive(op, "kv_heads", s.kv_heads);
  checks::require_positive(op, "head_dim", s.head_dim);
}

// Rows [tokens, heads, head_dim] of heads [first, first + heads) of packed rows of `total` heads.
template <typename Scalar>
std::vector<Scalar> split(std::span<const Scalar> packed, std::int64_t tokens, std::int64_t total, std::int64_t first,
                          std::int64_t heads, std::int64_t head_dim) {
  std::vector<Scalar> out(static_cast<std::size_t>(tokens * heads * head_dim));
  for (std::int64_t n = 0; n < tokens; ++n) {
    for (std::int64_t e = 0; e < heads * head_dim; ++e) {
      out[static_cast<std::size_t>(n * heads * head_dim + e)] = packed[(n * total + first) * head_dim + e];
    }
  }
  return out;
}

template <typename Scalar>
void merge(const std::vector<Scalar>& part, std::int64_t tokens, std::int64_t total, std::int64_t first,
           std::int64_t heads, std::int64_t head_dim, std::span<Scalar> packed) {
  for (std::int64_t n = 0; n < tokens; ++n) {
    for (std::int64_t e = 0; e < heads * head_dim; ++e) {
      packed[(n * total + first) * head_dim + e] = part[static_cast<std::size_t>(n * heads * head_dim + e)];
    }
  }
}

}  // namespace

template <typename Scalar>
void qk_norm_rope_forward_cpu(std::span<const Scalar> x, std::span<const Scalar> q_weight,
                              std::span<const Scalar> k_weight, std::span<const std::int32_t> positions,
                              const QkNormRopeShape& s, std::span<Scalar> y, std::span<Scalar> rstd_q,
                              std::span<Scalar> rstd_k) {
  check_shape(kForward, s);
  const std::int64_t total = s.q_heads + s.kv_heads;
  checks::require_size(kForward, "x", x, s.tokens * total * s.head_dim, "tokens * (q_heads + kv_heads) * head_dim");
  checks::require_size(kForward, "y", y, s.tokens * total * s.head_dim, "tokens * (q_heads + kv_heads) * head_dim");
  checks::require_size(kForward, "positions", positions, s.tokens, "tokens");
  const struct {
    std::int64_t first, heads;
    std::span<const Scalar> weight;
    std::span<Scalar> rstd;
  } parts[] = {{0, s.q_heads, q_weight, rstd_q}, {s.q_heads, s.kv_heads, k_weight, rstd_k}};
  for (const auto& p : parts) {
    const std::vector<Scalar> in = split(x, s.tokens, total, p.first, p.heads, s.head_dim);
    std::vector<Scalar> normed(in.size());
    head_rmsnorm_forward_cpu<Scalar>(in, p.weight, s.tokens, p.heads, s.head_dim, s.eps, normed, p.rstd);
    rope_forward_cpu<Scalar>(normed, positions, p.heads, s.head_dim, s.theta, normed);
    merge(normed, s.tokens, total, p.first, p.heads, s.head_dim, y);
  }
}

template <typename Scalar>
void qk_norm_rope_backward_cpu(std::span<const Scalar> dy, std::span<const Scalar> x, std::span<const Scalar> q_weight,
                               std::span<const Scalar> k_weight, std::span<const Scalar> rstd_q,
                               std::span<const Scalar> rstd_k, std::span<const std::int32_t> positions,
                               const QkNormRopeShape& s, std::span<Scalar> dx, std::span<Scalar> dq_weight,
                               std::span<Scalar> dk_weight) {
  check_shape(kBackward, s);
  const std::int64_t total = s.q_heads + s.kv_heads;
  for (const auto& [name, span] : {std::pair{"dy", dy}, std::pair{"x", x}}) {
    checks::require_size(kBackward, name, span, s.tokens * total * s.head_dim,
                         "tokens * (q_heads + kv_heads) * head_dim");
  }
  checks::require_size(kBackward, "dx", dx, s.tokens * total * s.head_dim, "tokens * (q_heads + kv_heads) * head_dim");
  checks::require_size(kBackward, "positions", positions, s.tokens, "tokens");
  const struct {
    std::int64_t first, heads;
    std::span<const Scalar> weight, rstd;
    std::span<Scalar> dweight;
  } parts[] = {{0, s.q_heads, q_weight, rstd_q, dq_weight}, {s.q_heads, s.kv_heads, k_weight, rstd_k, dk_weight}};
  for (const auto& p : parts) {
    std::vector<Scalar> d = split(dy, s.tokens, total, p.first, p.heads, s.head_dim);
    rope_backward_cpu<Scalar>(d, positions, p.heads, s.head_dim, s.theta, d);
    const std::vector<Scalar> in = split(x, s.tokens, total, p.first, p.heads, s.head_dim);
    std::vector<Scalar> out(in.size());
    head_rmsnorm_backward_cpu<Scalar>(d, in, p.weight, p.rstd, s.tokens, p.heads, s.head_dim, out, p.dweight);
    merge(out, s.tokens, total, p.first, p.heads, s.head_dim, dx);
  }
}

template void qk_norm_rope_forward_cpu<double>(std::span<const double>, std::span<const double>,
                                               std::span<const double>, std::span<const std::int32_t>,
                                               const QkNormRopeShape&, std::span<double>, std::span<double>,
                                               std::span<double>);
template void qk_norm_rope_backward_cpu<double>(std::span<const double>, std::span<const double>,
                                                std::span<const double>, std::span<const double>,
                                                std::span<const double>, std::span<const double>,
                                                std::span<const std::int32_t>, const QkNormRopeShape&,
                                                std::span<double>, std::span<double>, std::span<double>);
template void qk_norm_rope_forward_cpu<float>(std::span<const float>, std::span<const float>, std::span<const float>,
                                              std::span<const std::int32_t>, const QkNormRopeShape&, std::span<float>,
                                              std::span<float>, std::span<float>);
template void qk_norm_rope_backward_cpu<float>(std::span<const float>, std::span<const float>, std::span<const float>,
                                               std::span<const float>, std::span<const float>, std::span<const float>,
                                               std::span<const std::int32_t>, const QkNormRopeShape&, std::span<float>,
                                               std::span<float>, std::span<float>);

}  // namespace models::ops
