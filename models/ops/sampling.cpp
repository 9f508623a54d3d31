// CPU reference of token sampling (see sampling.h for the semantics) and the TokenSampler that
// dispatches to it or to the CUDA kernels.
#include "models/ops/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"

namespace models::ops {
namespace {

// z = logit / temperature made total-orderable: NaN -> -inf, +inf -> max float, -0 -> +0.
float scaled_logit(float logit, float temperature) {
  float z = logit / temperature;
  if (std::isnan(z)) return -std::numeric_limits<float>::infinity();
  if (z == std::numeric_limits<float>::infinity()) return std::numeric_limits<float>::max();
  return z + 0.0f;
}

}  // namespace

void check_sampling(const SamplingParams& params) {
  if (!std::isfinite(params.temperature) || params.temperature < 0.0f) {
    throw core::InputError("sampling: temperature must be finite and >= 0 (0 = greedy), got " +
                           std::to_string(params.temperature));
  }
  if (params.top_k < 0)
    throw core::InputError("sampling: top_k must be >= 0 (0 = off), got " + std::to_string(params.top_k));
  if (!(params.top_p > 0.0f && params.top_p <= 1.0f)) {
    throw core::InputError("sampling: top_p must lie in (0, 1] (1 = off), got " + std::to_string(params.top_p));
  }
}

std::int32_t sample_cpu(std::span<const float> logits, const SamplingParams& params, float uniform) {
  check_sampling(params);
  const auto vocab = static_cast<std::int64_t>(logits.size());
  if (vocab <= 0 || vocab > kMaxSamplingVocab) {
    throw core::Error("sample_cpu: vocabulary of " + std::to_string(vocab) + " entries (at most " +
                      std::to_string(kMaxSamplingVocab) + ")");
  }
  if (is_greedy(params)) {
    std::int64_t best = 0;
    float best_value = -std::numeric_limits<float>::infinity();
    for (std::int64_t i = 0; i < vocab; ++i) {
      const float v = std::isnan(logits[i]) ? -std::numeric_limits<float>::infinity() : logits[i];
      if (v > best_value) {
        best_value = v;
        best = i;
      }
    }
    return static_cast<std::int32_t>(best);
  }

  std::vector<float> z(static_cast<std::size_t>(vocab));
  for (std::int64_t i = 0; i < vocab; ++i) z[i] = scaled_logit(logits[i], params.temperature);
  std::vector<std::int32_t> order(static_cast<std::size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return z[a] > z[b]; });
  const float z_max = z[order[0]];
  if (z_max == -std::numeric_limits<float>::infinity()) return order[0];

  std::int64_t kept = vocab;
  if (params.top_k > 0 && params.top_k < vocab) {
    const float kth = z[order[params.top_k - 1]];
    kept = params.top_k;
    while (kept < vocab && z[order[kept]] == kth) ++kept;
  }
  std::vector<std::uint64_t> cum(static_cast<std::size_t>(kept));
  std::uint64_t running = 0;
  for (std::int64_t i = 0; i < kept; ++i) {
    running += sampling_weight(sampling_exp(static_cast<double>(z[order[i]]) - static_cast<double>(z_max)));
    cum[i] = running;
  }
  if (params.top_p < 1.0f) {
    const double threshold = static_cast<double>(params.top_p) * static_cast<double>(cum[kept - 1]);
    kept = std::lower_bound(cum.begin(), cum.begin() + kept, threshold,
                            [](std::uint64_t c, double t) { return static_cast<double>(c) < t; }) -
           cum.begin() + 1;
  }
  const double target = static_cast<double>(uniform) * static_cast<double>(cum[kept - 1]);
  const std::int64_t chosen = std::upper_bound(cum.begin(), cum.begin() + kept, target,
                                               [](double t, std::uint64_t c) { return t < static_cast<double>(c); }) -
                              cum.begin();
  return order[std::min(chosen, kept - 1)];
}

TokenSampler::TokenSampler(const core::DeviceContext& context, std::int64_t vocab) : context_(context), vocab_(vocab) {
  if (vocab <= 0) throw core::Error("TokenSampler: vocabulary must be positive");
  if (context.is_cuda()) workspace_ = core::Buffer(context.device(), sample_cuda_workspace_bytes(vocab));
}

void TokenSampler::sample(const float* logits, const SamplingParams& params, float uniform, std::int32_t* out_id) {
  if (context_.is_cuda()) {
    sample_cuda(logits, vocab_, params, uniform, out_id, workspace_.data(), workspace_.bytes(), context_.stream());
  } else {
    *out_id = sample_cpu({logits, static_cast<std::size_t>(vocab_)}, params, uniform);
  }
}

}  // namespace models::ops
