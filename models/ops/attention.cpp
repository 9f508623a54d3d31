// CPU reference of causal GQA attention. The forward runs one (batch, head, query) row per
// iteration with a per-thread score row. The backward makes two passes so that every output
// element is owned by one iteration (no atomics, thread-count independent results): dq by query
// rows, then dk and dv by key rows, each recomputing the probabilities it needs from lse.
#include "models/ops/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "models/ops/matmul_cpu.h"
#include "models/ops/op_checks.h"

namespace models::ops {
namespace {

// Element offsets of one head vector in the [batch, seq, heads, head_dim] layouts.
struct Index {
  const AttentionShape& s;
  std::int64_t q(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return ((b * s.seq + t) * s.q_heads + h) * s.head_dim;
  }
  std::int64_t kv(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return ((b * s.seq + t) * s.kv_heads + h) * s.head_dim;
  }
  std::int64_t row(std::int64_t b, std::int64_t h, std::int64_t t) const { return (b * s.q_heads + h) * s.seq + t; }
  // The inverse of row(): the (batch, head, position) of query row r.
  struct QueryRow {
    std::int64_t b, h, t;
  };
  QueryRow query_row(std::int64_t r) const { return {r / (s.seq * s.q_heads), (r / s.seq) % s.q_heads, r % s.seq}; }
};

void check_shape(std::string_view op, const AttentionShape& s) {
  checks::require_non_negative(op, "batch", s.batch);
  checks::require_non_negative(op, "seq", s.seq);
  checks::require_positive(op, "q_heads", s.q_heads);
  checks::require_positive(op, "kv_heads", s.kv_heads);
  checks::require_positive(op, "head_dim", s.head_dim);
  if (s.q_heads % s.kv_heads != 0) {
    checks::fail(op, "q_heads (" + std::to_string(s.q_heads) + ") must be a multiple of kv_heads (" +
                         std::to_string(s.kv_heads) + ")");
  }
}

template <typename Scalar>
void check_sizes(std::string_view op, const AttentionShape& s, std::span<const Scalar> q, std::span<const Scalar> k,
                 std::span<const Scalar> v) {
  checks::require_size(op, "q", q, s.batch * s.seq * s.q_heads * s.head_dim, "batch * seq * q_heads * head_dim");
  checks::require_size(op, "k", k, s.batch * s.seq * s.kv_heads * s.head_dim, "batch * seq * kv_heads * head_dim");
  checks::require_size(op, "v", v, s.batch * s.seq * s.kv_heads * s.head_dim, "batch * seq * kv_heads * head_dim");
}

}  // namespace

template <typename Scalar>
double attention_row_cpu(const Scalar* q, const Scalar* k, const Scalar* v, std::int64_t kv_stride, std::int64_t last,
                         std::int64_t dim, double scale, double* weights, double* acc, Scalar* out) {
  double max_score = -std::numeric_limits<double>::infinity();
  for (std::int64_t j = 0; j <= last; ++j) {
    weights[j] = scale * dot_double(q, k + j * kv_stride, dim);
    max_score = std::max(max_score, weights[j]);
  }
  double sum = 0.0;
  std::fill(acc, acc + dim, 0.0);
  for (std::int64_t j = 0; j <= last; ++j) {
    const double p = std::exp(weights[j] - max_score);
    sum += p;
    const Scalar* v_j = v + j * kv_stride;
    for (std::int64_t d = 0; d < dim; ++d) acc[d] += p * static_cast<double>(v_j[d]);
  }
  for (std::int64_t d = 0; d < dim; ++d) out[d] = static_cast<Scalar>(acc[d] / sum);
  return max_score + std::log(sum);
}

template <typename Scalar>
void attention_forward_cpu(const AttentionShape& shape, std::span<const Scalar> q, std::span<const Scalar> k,
                           std::span<const Scalar> v, std::span<Scalar> out, std::span<Scalar> lse) {
  constexpr std::string_view op = "attention_forward";
  check_shape(op, shape);
  check_sizes(op, shape, q, k, v);
  checks::require_size(op, "out", out, static_cast<std::int64_t>(q.size()), "batch * seq * q_heads * head_dim");
  checks::require_size(op, "lse", lse, shape.batch * shape.q_heads * shape.seq, "batch * q_heads * seq");
  checks::require_disjoint(op, {checks::region("out", out), checks::region("lse", lse)},
                           {checks::region("q", q), checks::region("k", k), checks::region("v", v)});

  const Index at{shape};
  const std::int64_t seq = shape.seq, dim = shape.head_dim;
  const std::int64_t group = shape.q_heads / shape.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  const std::int64_t rows = shape.batch * shape.q_heads * seq;
  const std::int64_t kv_stride = shape.kv_heads * dim;

#pragma omp parallel
  {
    std::vector<double> weights(static_cast<std::size_t>(seq));
    std::vector<double> acc(static_cast<std::size_t>(dim));
#pragma omp for schedule(dynamic, 8)
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto [b, h, i] = at.query_row(r);
      const std::int64_t kv_first = at.kv(b, 0, h / group);  // key j of the head at kv_first + j * kv_stride
      lse[static_cast<std::size_t>(r)] = static_cast<Scalar>(
          attention_row_cpu(q.data() + at.q(b, i, h), k.data() + kv_first, v.data() + kv_first, kv_stride, i, dim,
                            scale, weights.data(), acc.data(), out.data() + at.q(b, i, h)));
    }
  }
}

template <typename Scalar>
void attention_backward_cpu(const AttentionShape& shape, std::span<const Scalar> q, std::span<const Scalar> k,
                            std::span<const Scalar> v, std::span<const Scalar> out, std::span<const Scalar> lse,
                            std::span<const Scalar> dout, std::span<Scalar> dq, std::span<Scalar> dk,
                            std::span<Scalar> dv) {
  constexpr std::string_view op = "attention_backward";
  check_shape(op, shape);
  check_sizes(op, shape, q, k, v);
  const auto q_size = static_cast<std::int64_t>(q.size());
  const auto kv_size = static_cast<std::int64_t>(k.size());
  checks::require_size(op, "out", out, q_size, "batch * seq * q_heads * head_dim");
  checks::require_size(op, "lse", lse, shape.batch * shape.q_heads * shape.seq, "batch * q_heads * seq");
  checks::require_size(op, "dout", dout, q_size, "batch * seq * q_heads * head_dim");
  checks::require_size(op, "dq", dq, q_size, "batch * seq * q_heads * head_dim");
  checks::require_size(op, "dk", dk, kv_size, "batch * seq * kv_heads * head_dim");
  checks::require_size(op, "dv", dv, kv_size, "batch * seq * kv_heads * head_dim");
  checks::require_disjoint(op, {checks::region("dq", dq), checks::region("dk", dk), checks::region("dv", dv)},
                           {checks::region("q", q), checks::region("k", k), checks::region("v", v),
                            checks::region("out", out), checks::region("lse", lse), checks::region("dout", dout)});

  const Index at{shape};
  const std::int64_t seq = shape.seq, dim = shape.head_dim;
  const std::int64_t group = shape.q_heads / shape.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  const std::int64_t rows = shape.batch * shape.q_heads * seq;

  // D_i = dout_i . out_i for every query row, indexed like lse.
  std::vector<double> row_dot(static_cast<std::size_t>(rows));
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto [b, h, i] = at.query_row(r);
    row_dot[r] = dot_double(dout.data() + at.q(b, i, h), out.data() + at.q(b, i, h), dim);
  }

  // dq: one query row per iteration.
#pragma omp parallel
  {
    std::vector<double> acc(static_cast<std::size_t>(dim));
#pragma omp for schedule(dynamic, 8)
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto [b, h, i] = at.query_row(r);
      const std::int64_t kv_head = h / group;
      const Scalar* q_i = q.data() + at.q(b, i, h);
      const Scalar* dout_i = dout.data() + at.q(b, i, h);
      const double lse_i = static_cast<double>(lse[static_cast<std::size_t>(r)]);
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t j = 0; j <= i; ++j) {
        const Scalar* k_j = k.data() + at.kv(b, j, kv_head);
        const double p = std::exp(scale * dot_double(q_i, k_j, dim) - lse_i);
        const double ds = p * (dot_double(dout_i, v.data() + at.kv(b, j, kv_head), dim) - row_dot[r]);
        for (std::int64_t d = 0; d < dim; ++d) acc[d] += ds * static_cast<double>(k_j[d]);
      }
      Scalar* dq_i = dq.data() + at.q(b, i, h);
      for (std::int64_t d = 0; d < dim; ++d) dq_i[d] = static_cast<Scalar>(scale * acc[d]);
    }
  }

  // dk, dv: one key row per iteration, summing over the later queries of every head in the group.
  const std::int64_t key_rows = shape.batch * shape.kv_heads * seq;
#pragma omp parallel
  {
    std::vector<double> acc_k(static_cast<std::size_t>(dim)), acc_v(static_cast<std::size_t>(dim));
#pragma omp for schedule(dynamic, 8)
    for (std::int64_t r = 0; r < key_rows; ++r) {
      const std::int64_t j = r % seq, kv_head = (r / seq) % shape.kv_heads, b = r / (seq * shape.kv_heads);
      const Scalar* k_j = k.data() + at.kv(b, j, kv_head);
      const Scalar* v_j = v.data() + at.kv(b, j, kv_head);
      std::fill(acc_k.begin(), acc_k.end(), 0.0);
      std::fill(acc_v.begin(), acc_v.end(), 0.0);
      for (std::int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        for (std::int64_t i = j; i < seq; ++i) {
          const std::int64_t row = at.row(b, h, i);
          const Scalar* q_i = q.data() + at.q(b, i, h);
          const Scalar* dout_i = dout.data() + at.q(b, i, h);
          const double p =
              std::exp(scale * dot_double(q_i, k_j, dim) - static_cast<double>(lse[static_cast<std::size_t>(row)]));
          const double ds = p * (dot_double(dout_i, v_j, dim) - row_dot[row]);
          for (std::int64_t d = 0; d < dim; ++d) {
            acc_v[d] += p * static_cast<double>(dout_i[d]);
            acc_k[d] += ds * static_cast<double>(q_i[d]);
          }
        }
      }
      Scalar* dk_j = dk.data() + at.kv(b, j, kv_head);
      Scalar* dv_j = dv.data() + at.kv(b, j, kv_head);
      for (std::int64_t d = 0; d < dim; ++d) {
        dk_j[d] = static_cast<Scalar>(scale * acc_k[d]);
        dv_j[d] = static_cast<Scalar>(acc_v[d]);
      }
    }
  }
}

template double attention_row_cpu<float>(const float*, const float*, const float*, std::int64_t, std::int64_t,
                                         std::int64_t, double, double*, double*, float*);
template double attention_row_cpu<double>(const double*, const double*, const double*, std::int64_t, std::int64_t,
                                          std::int64_t, double, double*, double*, double*);
template void attention_forward_cpu<float>(const AttentionShape&, std::span<const float>, std::span<const float>,
                                           std::span<const float>, std::span<float>, std::span<float>);
template void attention_forward_cpu<double>(const AttentionShape&, std::span<const double>, std::span<const double>,
                                            std::span<const double>, std::span<double>, std::span<double>);
template void attention_backward_cpu<float>(const AttentionShape&, std::span<const float>, std::span<const float>,
                                            std::span<const float>, std::span<const float>, std::span<const float>,
                                            std::span<const float>, std::span<float>, std::span<float>,
                                            std::span<float>);
template void attention_backward_cpu<double>(const AttentionShape&, std::span<const double>, std::span<const double>,
                                             std::span<const double>, std::span<const double>, std::span<const double>,
                                             std::span<const double>, std::span<double>, std::span<double>,
                                             std::span<double>);

}  // namespace models::ops
