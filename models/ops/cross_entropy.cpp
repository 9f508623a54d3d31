// CPU reference of the fused, chunked lm_head + cross-entropy. Per chunk of tokens: logits by
// one product, a parallel pass over rows for logsumexp and the loss (and, in the backward,
// dlogits written over the logits), then dhidden and dweight by two more products.
#include "models/ops/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "models/ops/matmul_cpu.h"
#include "models/ops/op_checks.h"

namespace models::ops {
namespace {

template <typename Scalar>
std::int64_t check_arguments(std::string_view op, std::span<const Scalar> hidden, std::span<const Scalar> weight,
                             std::span<const std::int32_t> targets, std::int64_t dim, std::int64_t vocab,
                             std::int64_t chunk_tokens) {
  checks::require_positive(op, "dim", dim);
  checks::require_positive(op, "vocab", vocab);
  checks::require_non_negative(op, "chunk_tokens", chunk_tokens);
  const auto tokens = static_cast<std::int64_t>(targets.size());
  checks::require_size(op, "hidden", hidden, tokens * dim, "tokens * dim");
  checks::require_size(op, "weight", weight, vocab * dim, "vocab * dim");
  std::int64_t count = 0;
  for (std::size_t n = 0; n < targets.size(); ++n) {
    const std::int32_t t = targets[n];
    if (t == kIgnoreIndex) continue;
    if (t < 0 || t >= vocab) {
      checks::fail(op, "target " + std::to_string(t) + " at position " + std::to_string(n) +
                           " is outside the vocabulary [0, " + std::to_string(vocab) + ") and is not the ignore index " +
                           std::to_string(kIgnoreIndex));
    }
    ++count;
  }
  return count;
}

// Shared body: the loss, and the gradients when `dhidden` is not null.
template <typename Scalar>
CrossEntropyResult run(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                       std::span<const std::int32_t> targets, std::int64_t dim, std::int64_t vocab,
                       std::int64_t count, std::int64_t chunk_tokens, Scalar* dhidden, Scalar* dweight,
                       double grad_scale) {
  const auto tokens = static_cast<std::int64_t>(targets.size());
  if (count == 0) {
    if (dhidden != nullptr) std::fill(dhidden, dhidden + tokens * dim, Scalar{0});
    return {};
  }
  const std::int64_t chunk = std::min(tokens, cross_entropy_chunk_tokens(vocab, chunk_tokens));
  const double coefficient = grad_scale / static_cast<double>(count);
  std::vector<Scalar> logits(static_cast<std::size_t>(chunk * vocab));
  std::vector<double> row_loss(static_cast<std::size_t>(tokens), 0.0);

  for (std::int64_t first = 0; first < tokens; first += chunk) {
    const std::int64_t rows = std::min(chunk, tokens - first);
    const Scalar* hidden_chunk = hidden.data() + first * dim;
    matmul_nt_cpu(hidden_chunk, weight.data(), rows, vocab, dim, logits.data(), Accumulate::overwrite);
    bool any_counted = false;
#pragma omp parallel for schedule(static) reduction(|| : any_counted)
    for (std::int64_t r = 0; r < rows; ++r) {
      Scalar* row = logits.data() + r * vocab;
      const std::int32_t target = targets[static_cast<std::size_t>(first + r)];
      if (target == kIgnoreIndex) {
        if (dhidden != nullptr) std::fill(row, row + vocab, Scalar{0});
        continue;
      }
      any_counted = true;
      double max_logit = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < vocab; ++j) max_logit = std::max(max_logit, static_cast<double>(row[j]));
      double sum = 0.0;
      for (std::int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(row[j]) - max_logit);
      const double lse = max_logit + std::log(sum);
      row_loss[static_cast<std::size_t>(first + r)] = lse - static_cast<double>(row[target]);
      if (dhidden != nullptr) {
        for (std::int64_t j = 0; j < vocab; ++j) {
          const double p = std::exp(static_cast<double>(row[j]) - lse);
          row[j] = static_cast<Scalar>(coefficient * (j == target ? p - 1.0 : p));
        }
      }
    }
    if (dhidden == nullptr) continue;
    Scalar* dhidden_chunk = dhidden + first * dim;
    if (!any_counted) {
      std::fill(dhidden_chunk, dhidden_chunk + rows * dim, Scalar{0});
      continue;
    }
    matmul_nn_cpu(logits.data(), weight.data(), rows, dim, vocab, dhidden_chunk, Accumulate::overwrite);
    matmul_tn_cpu(logits.data(), hidden_chunk, vocab, dim, rows, dweight, Accumulate::add);
  }

  double total = 0.0;
  for (const double l : row_loss) total += l;
  return {total / static_cast<double>(count), count};
}

}  // namespace

std::int64_t cross_entropy_chunk_tokens(std::int64_t vocab, std::int64_t requested) {
  checks::require_positive("cross_entropy_chunk_tokens", "vocab", vocab);
  checks::require_non_negative("cross_entropy_chunk_tokens", "requested", requested);
  if (requested > 0) return requested;
  return std::max<std::int64_t>(1, kCrossEntropyChunkLogits / vocab);
}

template <typename Scalar>
CrossEntropyResult cross_entropy_forward_cpu(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                                             std::span<const std::int32_t> targets, std::int64_t dim,
                                             std::int64_t vocab, std::int64_t chunk_tokens) {
  const std::int64_t count =
      check_arguments("cross_entropy_forward", hidden, weight, targets, dim, vocab, chunk_tokens);
  return run<Scalar>(hidden, weight, targets, dim, vocab, count, chunk_tokens, nullptr, nullptr, 0.0);
}

template <typename Scalar>
CrossEntropyResult cross_entropy_backward_cpu(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                                              std::span<const std::int32_t> targets, std::int64_t dim,
                                              std::int64_t vocab, std::span<Scalar> dhidden,
                                              std::span<Scalar> dweight, double grad_scale,
                                              std::int64_t chunk_tokens) {
  constexpr std::string_view op = "cross_entropy_backward";
  const std::int64_t count = check_arguments(op, hidden, weight, targets, dim, vocab, chunk_tokens);
  checks::require_size(op, "dhidden", dhidden, static_cast<std::int64_t>(hidden.size()), "tokens * dim");
  checks::require_size(op, "dweight", dweight, vocab * dim, "vocab * dim");
  checks::require_disjoint(op, {checks::region("dhidden", dhidden), checks::region("dweight", dweight)},
                           {checks::region("hidden", hidden), checks::region("weight", weight),
                            checks::region("targets", targets)});
  if (!std::isfinite(grad_scale)) checks::fail(op, "grad_scale must be finite, got " + std::to_string(grad_scale));
  return run<Scalar>(hidden, weight, targets, dim, vocab, count, chunk_tokens, dhidden.data(), dweight.data(),
                     grad_scale);
}

template CrossEntropyResult cross_entropy_forward_cpu<float>(std::span<const float>, std::span<const float>,
                                                             std::span<const std::int32_t>, std::int64_t,
                                                             std::int64_t, std::int64_t);
template CrossEntropyResult cross_entropy_forward_cpu<double>(std::span<const double>, std::span<const double>,
                                                              std::span<const std::int32_t>, std::int64_t,
                                                              std::int64_t, std::int64_t);
template CrossEntropyResult cross_entropy_backward_cpu<float>(std::span<const float>, std::span<const float>,
                                                              std::span<const std::int32_t>, std::int64_t,
                                                              std::int64_t, std::span<float>, std::span<float>,
                                                              double, std::int64_t);
template CrossEntropyResult cross_entropy_backward_cpu<double>(std::span<const double>, std::span<const double>,
                                                               std::span<const std::int32_t>, std::int64_t,
                                                               std::int64_t, std::span<double>, std::span<double>,
                                                               double, std::int64_t);

}  // namespace models::ops
