// CPU reference of the fused, chunked lm_head + cross-entropy. Per chunk of tokens: logits by
// one product, a parallel pass over rows for logsumexp and the loss (and, in the backward,
// dlogits written over the logits), then dhidden and dweight (or a window of its rows) by two
// more products.
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
                           " is outside the vocabulary [0, " + std::to_string(vocab) +
                           ") and is not the ignore index " + std::to_string(kIgnoreIndex));
    }
    ++count;
  }
  return count;
}

// The gradient outputs of run(): dhidden [tokens, dim] (written; null: not computed) and the
// rows [row_begin, row_end) of dweight, accumulated into dweight_rows [(row_end - row_begin), dim].
template <typename Scalar>
struct Gradients {
  Scalar* dhidden = nullptr;
  Scalar* dweight_rows = nullptr;
  std::int64_t row_begin = 0, row_end = 0;
  double grad_scale = 1.0;
};

// Shared body: the loss, and the gradients when `gradients` is not null.
template <typename Scalar>
CrossEntropyResult run(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                       std::span<const std::int32_t> targets, std::int64_t dim, std::int64_t vocab, std::int64_t count,
                       std::int64_t chunk_tokens, const Gradients<Scalar>* gradients,
                       std::span<float> token_losses = {}) {
  const auto tokens = static_cast<std::int64_t>(targets.size());
  const bool backward = gradients != nullptr;
  Scalar* dhidden = backward ? gradients->dhidden : nullptr;
  std::fill(token_losses.begin(), token_losses.end(), 0.0f);
  if (count == 0) {
    if (dhidden != nullptr) std::fill(dhidden, dhidden + tokens * dim, Scalar{0});
    return {};
  }
  const std::int64_t chunk = std::min(tokens, cross_entropy_chunk_tokens(vocab, chunk_tokens));
  const double coefficient = backward ? gradients->grad_scale / static_cast<double>(count) : 0.0;
  std::vector<Scalar> logits(static_cast<std::size_t>(chunk * vocab));
  std::vector<double> row_loss(static_cast<std::size_t>(tokens), 0.0);
  // A window narrower than the vocabulary takes its dlogits columns from a contiguous copy.
  const std::int64_t window_begin = backward ? gradients->row_begin : 0;
  const std::int64_t window_rows = backward ? gradients->row_end - gradients->row_begin : 0;
  std::vector<Scalar> window(backward && window_rows < vocab ? static_cast<std::size_t>(chunk * window_rows) : 0);

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
        if (backward) std::fill(row, row + vocab, Scalar{0});
        continue;
      }
      any_counted = true;
      double max_logit = -std::numeric_limits<double>::infinity();
      for (std::int64_t j = 0; j < vocab; ++j) max_logit = std::max(max_logit, static_cast<double>(row[j]));
      double sum = 0.0;
      for (std::int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(row[j]) - max_logit);
      const double lse = max_logit + std::log(sum);
      row_loss[static_cast<std::size_t>(first + r)] = lse - static_cast<double>(row[target]);
      if (backward) {
        for (std::int64_t j = 0; j < vocab; ++j) {
          const double p = std::exp(static_cast<double>(row[j]) - lse);
          row[j] = static_cast<Scalar>(coefficient * (j == target ? p - 1.0 : p));
        }
      }
    }
    if (!backward) continue;
    Scalar* dhidden_chunk = dhidden != nullptr ? dhidden + first * dim : nullptr;
    if (!any_counted) {
      if (dhidden_chunk != nullptr) std::fill(dhidden_chunk, dhidden_chunk + rows * dim, Scalar{0});
      continue;
    }
    if (dhidden_chunk != nullptr) {
      matmul_nn_cpu(logits.data(), weight.data(), rows, dim, vocab, dhidden_chunk, Accumulate::overwrite);
    }
    const Scalar* dlogits = logits.data();
    if (!window.empty()) {
      for (std::int64_t r = 0; r < rows; ++r) {
        std::copy_n(logits.data() + r * vocab + window_begin, window_rows, window.data() + r * window_rows);
      }
      dlogits = window.data();
    }
    matmul_tn_cpu(dlogits, hidden_chunk, window_rows, dim, rows, gradients->dweight_rows, Accumulate::add);
  }

  double total = 0.0;
  for (const double l : row_loss) total += l;
  if (!token_losses.empty()) {
    for (std::size_t n = 0; n < row_loss.size(); ++n) token_losses[n] = static_cast<float>(row_loss[n]);
  }
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
                                             std::int64_t vocab, std::int64_t chunk_tokens,
                                             std::span<float> token_losses) {
  const std::int64_t count =
      check_arguments("cross_entropy_forward", hidden, weight, targets, dim, vocab, chunk_tokens);
  if (!token_losses.empty()) {
    checks::require_size("cross_entropy_forward", "token_losses", std::span<const float>(token_losses),
                         static_cast<std::int64_t>(targets.size()), "tokens");
  }
  return run<Scalar>(hidden, weight, targets, dim, vocab, count, chunk_tokens, nullptr, token_losses);
}

template <typename Scalar>
CrossEntropyResult cross_entropy_backward_cpu(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                                              std::span<const std::int32_t> targets, std::int64_t dim,
                                              std::int64_t vocab, std::span<Scalar> dhidden, std::span<Scalar> dweight,
                                              double grad_scale, std::int64_t chunk_tokens) {
  constexpr std::string_view op = "cross_entropy_backward";
  const std::int64_t count = check_arguments(op, hidden, weight, targets, dim, vocab, chunk_tokens);
  checks::require_size(op, "dhidden", dhidden, static_cast<std::int64_t>(hidden.size()), "tokens * dim");
  checks::require_size(op, "dweight", dweight, vocab * dim, "vocab * dim");
  checks::require_disjoint(
      op, {checks::region("dhidden", dhidden), checks::region("dweight", dweight)},
      {checks::region("hidden", hidden), checks::region("weight", weight), checks::region("targets", targets)});
  if (!std::isfinite(grad_scale)) checks::fail(op, "grad_scale must be finite, got " + std::to_string(grad_scale));
  const Gradients<Scalar> gradients{dhidden.data(), dweight.data(), 0, vocab, grad_scale};
  return run<Scalar>(hidden, weight, targets, dim, vocab, count, chunk_tokens, &gradients);
}

template <typename Scalar>
void cross_entropy_backward_weight_rows_cpu(std::span<const Scalar> hidden, std::span<const Scalar> weight,
                                            std::span<const std::int32_t> targets, std::int64_t dim, std::int64_t vocab,
                                            std::int64_t row_begin, std::int64_t row_end,
                                            std::span<Scalar> dweight_rows, double grad_scale,
                                            std::int64_t chunk_tokens) {
  constexpr std::string_view op = "cross_entropy_backward_weight_rows";
  const std::int64_t count = check_arguments(op, hidden, weight, targets, dim, vocab, chunk_tokens);
  if (row_begin < 0 || row_begin >= row_end || row_end > vocab) {
    checks::fail(op, "rows [" + std::to_string(row_begin) + ", " + std::to_string(row_end) +
                         ") must be a non-empty range within the vocabulary [0, " + std::to_string(vocab) + ")");
  }
  checks::require_size(op, "dweight_rows", dweight_rows, (row_end - row_begin) * dim, "(row_end - row_begin) * dim");
  checks::require_disjoint(
      op, {checks::region("dweight_rows", dweight_rows)},
      {checks::region("hidden", hidden), checks::region("weight", weight), checks::region("targets", targets)});
  if (!std::isfinite(grad_scale)) checks::fail(op, "grad_scale must be finite, got " + std::to_string(grad_scale));
  const Gradients<Scalar> gradients{nullptr, dweight_rows.data(), row_begin, row_end, grad_scale};
  run<Scalar>(hidden, weight, targets, dim, vocab, count, chunk_tokens, &gradients);
}

template CrossEntropyResult cross_entropy_forward_cpu<float>(std::span<const float>, std::span<const float>,
                                                             std::span<const std::int32_t>, std::int64_t, std::int64_t,
                                                             std::int64_t, std::span<float>);
template CrossEntropyResult cross_entropy_forward_cpu<double>(std::span<const double>, std::span<const double>,
                                                              std::span<const std::int32_t>, std::int64_t, std::int64_t,
                                                              std::int64_t, std::span<float>);
template CrossEntropyResult cross_entropy_backward_cpu<float>(std::span<const float>, std::span<const float>,
                                                              std::span<const std::int32_t>, std::int64_t, std::int64_t,
                                                              std::span<float>, std::span<float>, double, std::int64_t);
template CrossEntropyResult cross_entropy_backward_cpu<double>(std::span<const double>, std::span<const double>,
                                                               std::span<const std::int32_t>, std::int64_t,
                                                               std::int64_t, std::span<double>, std::span<double>,
                                                               double, std::int64_t);
template void cross_entropy_backward_weight_rows_cpu<float>(std::span<const float>, std::span<const float>,
                                                            std::span<const std::int32_t>, std::int64_t, std::int64_t,
                                                            std::int64_t, std::int64_t, std::span<float>, double,
                                                            std::int64_t);
template void cross_entropy_backward_weight_rows_cpu<double>(std::span<const double>, std::span<const double>,
                                                             std::span<const std::int32_t>, std::int64_t, std::int64_t,
                                                             std::int64_t, std::int64_t, std::span<double>, double,
                                                             std::int64_t);

}  // namespace models::ops
