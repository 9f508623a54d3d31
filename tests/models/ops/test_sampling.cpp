// Token sampling, CPU reference (models/ops/sampling.h): greedy (ties to the lowest id, NaN
// ignored), top-k = 1 and tiny top-p equal greedy, the frequencies of a uniform grid of draws
// equal softmax(logits / T) (the inverse CDF is exact up to the grid's spacing), top-k and top-p
// keep exactly the sets they define (ties at the boundary included for top-k, the shortest
// prefix for top-p), sampling_exp against std::exp, parameter checks, seeded draws.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "core/error.h"
#include "models/ops/sampling.h"
#include "support/test_support.h"

namespace {

using models::ops::SamplingParams;
using models::ops::sample_cpu;

std::int32_t argmax(const std::vector<float>& logits) {
  return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// Frequencies of each id over draws u = (i + 0.5) / n.
std::vector<double> frequencies(const std::vector<float>& logits, const SamplingParams& params, int n) {
  std::vector<double> counts(logits.size(), 0.0);
  for (int i = 0; i < n; ++i) counts[sample_cpu(logits, params, static_cast<float>((i + 0.5) / n))] += 1.0 / n;
  return counts;
}

std::vector<double> softmax(const std::vector<float>& logits, double temperature) {
  double max = -INFINITY, sum = 0;
  for (float v : logits) max = std::max(max, v / temperature);
  std::vector<double> p(logits.size());
  for (std::size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp(logits[i] / temperature - max);
  for (double& v : p) v /= sum;
  return p;
}

TEST(Sampling, GreedyPicksTheLargestLowestIdOnTiesIgnoringNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const SamplingParams greedy;
  EXPECT_EQ(sample_cpu(std::vector<float>{1, 3, 2}, greedy, 0.5f), 1);
  EXPECT_EQ(sample_cpu(std::vector<float>{1, 3, 3, 2}, greedy, 0.9f), 1);
  EXPECT_EQ(sample_cpu(std::vector<float>{nan, -1, nan, -0.5f}, greedy, 0.0f), 3);
  EXPECT_EQ(sample_cpu(std::vector<float>{-inf, -inf, -inf}, greedy, 0.3f), 0);
  EXPECT_EQ(sample_cpu(std::vector<float>{7}, greedy, 0.3f), 0);
  // Sampling with every logit masked also gives id 0.
  EXPECT_EQ(sample_cpu(std::vector<float>{-inf, nan, -inf}, {.temperature = 1.0f}, 0.7f), 0);
}

TEST(Sampling, TopK1AndTinyTopPAreGreedy) {
  std::mt19937_64 rng(test::fresh_seed());
  for (int trial = 0; trial < 50; ++trial) {
    const auto logits = test::random_normal(rng, 1 + rng() % 3000, 3.0f);
    const std::int32_t best = argmax(logits);
    for (float u : {0.0f, 0.3f, 0.999999f}) {
      for (float t : {0.1f, 1.0f, 7.0f}) {
        EXPECT_EQ(sample_cpu(logits, {.temperature = t, .top_k = 1}, u), best);
        EXPECT_EQ(sample_cpu(logits, {.temperature = t, .top_p = 1e-7f}, u), best);
      }
    }
  }
}

TEST(Sampling, FrequenciesFollowTheTemperature) {
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 0.0f};
  for (double t : {0.5, 1.0, 2.5}) {
    const auto p = softmax(logits, t);
    const auto f = frequencies(logits, {.temperature = static_cast<float>(t)}, 200000);
    for (std::size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(f[i], p[i], 2e-5) << "temperature " << t << " id " << i;
  }
  // Hotter is flatter: the largest probability falls with the temperature.
  EXPECT_GT(frequencies(logits, {.temperature = 0.5f}, 10000)[4], frequencies(logits, {.temperature = 2.0f}, 10000)[4]);
}

TEST(Sampling, TopKKeepsTheKLargestAndTheirTies) {
  const std::vector<float> logits = {0.0f, 5.0f, 3.0f, 3.0f, 4.0f, 3.0f, -2.0f, 1.0f};
  // k = 3: 5, 4 and every 3 (ids 2, 3, 5); renormalised.
  const auto f = frequencies(logits, {.temperature = 1.0f, .top_k = 3}, 100000);
  std::vector<float> kept_logits = {5.0f, 4.0f, 3.0f, 3.0f, 3.0f};
  const auto p = softmax(kept_logits, 1.0);
  const std::vector<int> kept = {1, 4, 2, 3, 5};
  double mass = 0;
  for (std::size_t j = 0; j < kept.size(); ++j) {
    EXPECT_NEAR(f[kept[j]], p[j], 2e-5) << "id " << kept[j];
    mass += f[kept[j]];
  }
  EXPECT_NEAR(mass, 1.0, 1e-12);
  // k at or above the vocabulary: no truncation.
  const auto all = frequencies(logits, {.temperature = 1.0f, .top_k = 8}, 100000);
  const auto none = frequencies(logits, {.temperature = 1.0f}, 100000);
  EXPECT_EQ(all, none);
}

TEST(Sampling, TopPKeepsTheShortestPrefixReachingP) {
  const float inf = std::numeric_limits<float>::infinity();
  // Four equal tokens (exact probabilities 1/4), the rest masked: p = 0.5 keeps exactly two, the
  // two lowest ids, each drawn half the time; u = 0.5 is the exact boundary between them.
  const std::vector<float> logits = {-inf, 2.0f, -inf, 2.0f, 2.0f, -inf, 2.0f};
  const SamplingParams half{.temperature = 1.0f, .top_p = 0.5f};
  EXPECT_EQ(sample_cpu(logits, half, 0.0f), 1);
  EXPECT_EQ(sample_cpu(logits, half, 0.4999999f), 1);
  EXPECT_EQ(sample_cpu(logits, half, 0.5f), 3);
  EXPECT_EQ(sample_cpu(logits, half, 0.9999999f), 3);
  // Just above a quarter's boundary keeps two; exactly a quarter keeps one.
  EXPECT_EQ(sample_cpu(logits, {.temperature = 1.0f, .top_p = 0.25f}, 0.99f), 1);
  EXPECT_EQ(sample_cpu(logits, {.temperature = 1.0f, .top_p = 0.2500001f}, 0.99f), 3);
  EXPECT_EQ(sample_cpu(logits, {.temperature = 1.0f, .top_p = 0.75f}, 0.99f), 4);
  EXPECT_EQ(sample_cpu(logits, {.temperature = 1.0f, .top_p = 1.0f}, 0.99f), 6);

  // Random logits: the kept set is the shortest prefix of the descending order whose mass reaches p.
  std::mt19937_64 rng(test::fresh_seed());
  for (int trial = 0; trial < 20; ++trial) {
    const auto values = test::random_normal(rng, 50, 2.0f);
    const float top_p = 0.2f + 0.7f * static_cast<float>(trial) / 20.0f;
    const auto p = softmax(values, 1.0);
    std::vector<int> order(values.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return values[a] > values[b]; });
    std::set<int> expected;
    double mass = 0;
    for (int id : order) {
      expected.insert(id);
      mass += p[id];
      if (mass >= top_p) break;
    }
    std::set<int> seen;
    for (int i = 0; i < 4000; ++i)
      seen.insert(sample_cpu(values, {.temperature = 1.0f, .top_p = top_p}, (i + 0.5f) / 4000));
    EXPECT_TRUE(std::includes(expected.begin(), expected.end(), seen.begin(), seen.end())) << "top_p " << top_p;
    EXPECT_EQ(*seen.begin(), *expected.begin());
  }
}

TEST(Sampling, TopKThenTopPAsTransformersOrdersThem) {
  // top_k = 2 keeps {5: logit 3, 1: logit 2}; top_p = 0.6 of their renormalised mass keeps only id 5
  // (p = e^3 / (e^3 + e^2) = 0.73).
  const std::vector<float> logits = {0.0f, 2.0f, 1.0f, 0.5f, 1.5f, 3.0f};
  for (float u : {0.0f, 0.5f, 0.99f})
    EXPECT_EQ(sample_cpu(logits, {.temperature = 1.0f, .top_k = 2, .top_p = 0.6f}, u), 5);
  EXPECT_EQ(sample_cpu(logits, {.temperature = 1.0f, .top_k = 2, .top_p = 0.8f}, 0.99f), 1);
}

TEST(Sampling, ExpMatchesTheLibrary) {
  for (double x = -707.9; x <= 0.0; x += 0.0137) {
    const double ours = models::ops::sampling_exp(x), ref = std::exp(x);
    ASSERT_NEAR(ours, ref, 4e-16 * ref) << x;
  }
  EXPECT_EQ(models::ops::sampling_exp(0.0), 1.0);
  EXPECT_EQ(models::ops::sampling_exp(-800.0), 0.0);
  EXPECT_EQ(models::ops::sampling_exp(-std::numeric_limits<double>::infinity()), 0.0);
  EXPECT_EQ(models::ops::sampling_exp(std::numeric_limits<double>::quiet_NaN()), 0.0);
}

TEST(Sampling, ParametersAreChecked) {
  const std::vector<float> logits = {1.0f, 2.0f};
  EXPECT_THROW(sample_cpu(logits, {.temperature = -1.0f}, 0.5f), core::InputError);
  EXPECT_THROW(sample_cpu(logits, {.temperature = std::numeric_limits<float>::infinity()}, 0.5f), core::InputError);
  EXPECT_THROW(sample_cpu(logits, {.temperature = 1.0f, .top_k = -1}, 0.5f), core::InputError);
  EXPECT_THROW(sample_cpu(logits, {.temperature = 1.0f, .top_p = 0.0f}, 0.5f), core::InputError);
  EXPECT_THROW(sample_cpu(logits, {.temperature = 1.0f, .top_p = 1.5f}, 0.5f), core::InputError);
  EXPECT_THROW(sample_cpu(std::vector<float>{}, {}, 0.5f), core::Error);
}

TEST(Sampling, DrawsAreSeededPerToken) {
  EXPECT_EQ(models::ops::sampling_uniform(7, 3), models::ops::sampling_uniform(7, 3));
  EXPECT_NE(models::ops::sampling_uniform(7, 3), models::ops::sampling_uniform(7, 4));
  EXPECT_NE(models::ops::sampling_uniform(7, 3), models::ops::sampling_uniform(8, 3));
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    const float u = models::ops::sampling_uniform(99, static_cast<std::uint64_t>(i));
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.01);
}

}  // namespace

TEST(Sampling, WeightsAreFixedPointRoundedToNearestEven) {
  using models::ops::sampling_weight;
  EXPECT_EQ(sampling_weight(1.0), std::uint64_t{1} << 41);
  EXPECT_EQ(sampling_weight(0.5), std::uint64_t{1} << 40);
  EXPECT_EQ(sampling_weight(0.0), 0u);
  EXPECT_EQ(sampling_weight(std::ldexp(1.0, -42)), 0u);  // half a unit: to even
  EXPECT_EQ(sampling_weight(std::ldexp(3.0, -42)), 2u);  // one and a half: to even
  EXPECT_EQ(sampling_weight(std::ldexp(5.0, -43)), 1u);  // a unit and a quarter
  // The largest vocabulary's sum fits 64 bits.
  EXPECT_LE(static_cast<double>(models::ops::kMaxSamplingVocab) * std::ldexp(1.0, 41), std::ldexp(1.0, 64));
  // A token whose e is below half a unit is never chosen, even at the largest u.
  EXPECT_EQ(sample_cpu(std::vector<float>{0.0f, -40.0f}, {.temperature = 1.0f}, 0.99999994f), 0);
}
