// CPU reference of the token embedding. The backward groups tokens by id (a stable sort of the
// token indices), so each table row is owned by one thread: no atomics, fixed summation order.
#include "models/ops/embedding.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "models/ops/op_checks.h"

namespace models::ops {
namespace {

void check_ids(std::string_view op, std::span<const std::int32_t> ids, std::int64_t vocab) {
  for (std::size_t n = 0; n < ids.size(); ++n) {
    if (ids[n] < 0 || ids[n] >= vocab) {
      checks::fail(op, "token id " + std::to_string(ids[n]) + " at position " + std::to_string(n) +
                           " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
}

}  // namespace

template <typename Scalar>
void embedding_forward_cpu(std::span<const std::int32_t> ids, std::span<const Scalar> table, std::int64_t vocab,
                           std::int64_t dim, std::span<Scalar> out) {
  constexpr std::string_view op = "embedding_forward";
  checks::require_positive(op, "vocab", vocab);
  checks::require_positive(op, "dim", dim);
  const auto tokens = static_cast<std::int64_t>(ids.size());
  checks::require_size(op, "table", table, vocab * dim, "vocab * dim");
  checks::require_size(op, "out", out, tokens * dim, "tokens * dim");
  checks::require_disjoint(op, {checks::region("out", out)},
                           {checks::region("table", table), checks::region("ids", ids)});
  check_ids(op, ids, vocab);

#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < tokens; ++n) {
    const Scalar* row = table.data() + static_cast<std::int64_t>(ids[n]) * dim;
    std::copy(row, row + dim, out.data() + n * dim);
  }
}

template <typename Scalar>
void embedding_backward_cpu(std::span<const std::int32_t> ids, std::span<const Scalar> dout, std::int64_t vocab,
                            std::int64_t dim, std::span<Scalar> dtable) {
  embedding_backward_cpu<Scalar>(ids, dout, vocab, dim, 0, vocab, dtable);
}

template <typename Scalar>
void embedding_backward_cpu(std::span<const std::int32_t> ids, std::span<const Scalar> dout, std::int64_t vocab,
                            std::int64_t dim, std::int64_t row_begin, std::int64_t row_end,
                            std::span<Scalar> dtable_rows) {
  constexpr std::string_view op = "embedding_backward";
  checks::require_positive(op, "vocab", vocab);
  checks::require_positive(op, "dim", dim);
  if (row_begin < 0 || row_begin > row_end || row_end > vocab) {
    checks::fail(op, "row window [" + std::to_string(row_begin) + ", " + std::to_string(row_end) +
                         ") is not inside [0, vocab = " + std::to_string(vocab) + ")");
  }
  const auto tokens = static_cast<std::int64_t>(ids.size());
  checks::require_size(op, "dout", dout, tokens * dim, "tokens * dim");
  const bool full = row_begin == 0 && row_end == vocab;
  checks::require_size(op, full ? "dtable" : "dtable_rows", dtable_rows, (row_end - row_begin) * dim,
                       full ? "vocab * dim" : "(row_end - row_begin) * dim");
  checks::require_disjoint(op, {checks::region(full ? "dtable" : "dtable_rows", dtable_rows)},
                           {checks::region("dout", dout), checks::region("ids", ids)});
  check_ids(op, ids, vocab);

  // Indices of the window's tokens grouped by id, in token order within a group (the same order
  // per id whatever the window, so every row gets the same sum as in the full backward).
  const std::int32_t* id_of = ids.data();
  std::vector<std::int64_t> order;
  for (std::int64_t n = 0; n < tokens; ++n) {
    if (id_of[n] >= row_begin && id_of[n] < row_end) order.push_back(n);
  }
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) { return id_of[a] < id_of[b]; });
  const auto used = static_cast<std::int64_t>(order.size());
  std::vector<std::int64_t> group_begin;
  for (std::int64_t i = 0; i < used; ++i) {
    if (i == 0 || id_of[order[i]] != id_of[order[i - 1]]) group_begin.push_back(i);
  }
  group_begin.push_back(used);
  const auto groups = static_cast<std::int64_t>(group_begin.size()) - 1;

#pragma omp parallel
  {
    std::vector<double> acc(static_cast<std::size_t>(dim));
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t g = 0; g < groups; ++g) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t i = group_begin[g]; i < group_begin[g + 1]; ++i) {
        const Scalar* row = dout.data() + order[i] * dim;
        for (std::int64_t d = 0; d < dim; ++d) acc[d] += static_cast<double>(row[d]);
      }
      const std::int64_t r = id_of[order[group_begin[g]]];
      Scalar* grad_row = dtable_rows.data() + (r - row_begin) * dim;
      for (std::int64_t d = 0; d < dim; ++d)
        grad_row[d] = static_cast<Scalar>(static_cast<double>(grad_row[d]) + acc[d]);
    }
  }
}

template void embedding_forward_cpu<float>(std::span<const std::int32_t>, std::span<const float>, std::int64_t,
                                           std::int64_t, std::span<float>);
template void embedding_forward_cpu<double>(std::span<const std::int32_t>, std::span<const double>, std::int64_t,
                                            std::int64_t, std::span<double>);
template void embedding_backward_cpu<float>(std::span<const std::int32_t>, std::span<const float>, std::int64_t,
                                            std::int64_t, std::span<float>);
template void embedding_backward_cpu<double>(std::span<const std::int32_t>, std::span<const double>, std::int64_t,
                                             std::int64_t, std::span<double>);
template void embedding_backward_cpu<float>(std::span<const std::int32_t>, std::span<const float>, std::int64_t,
                                            std::int64_t, std::int64_t, std::int64_t, std::span<float>);
template void embedding_backward_cpu<double>(std::span<const std::int32_t>, std::span<const double>, std::int64_t,
                                             std::int64_t, std::int64_t, std::int64_t, std::span<double>);

}  // namespace models::ops
