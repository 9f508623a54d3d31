// Fused lm_head + cross-entropy: loss against an unchunked fp64 reference with ignored
// targets, independence from the chunk size (token count and vocab not multiples of it),
// gradients against fp64 finite differences, the all-ignored case, grad_scale, bad targets; the
// vocabulary-row windows of dweight (ZeRO-2's split backward) against the whole dweight.
#include <limits>

#include "models/ops/cross_entropy.h"
#include "support/op_test_support.h"

namespace {

namespace ops = models::ops;

std::vector<std::int32_t> random_targets(std::mt19937_64& rng, std::size_t n, std::int32_t vocab,
                                         double ignored_fraction) {
  std::uniform_int_distribution<std::int32_t> pick(0, vocab - 1);
  std::bernoulli_distribution ignore(ignored_fraction);
  std::vector<std::int32_t> targets(n);
  for (auto& t : targets) t = ignore(rng) ? ops::kIgnoreIndex : pick(rng);
  return targets;
}

// Mean over counted tokens of logsumexp(h W^T) - (h W^T)[target], with all logits at once, in double.
double unchunked_loss(const std::vector<float>& hidden, const std::vector<float>& weight,
                      const std::vector<std::int32_t>& targets, std::int64_t dim, std::int64_t vocab) {
  double total = 0.0;
  std::int64_t count = 0;
  std::vector<double> logits(targets.size() * vocab);
  for (std::size_t n = 0; n < targets.size(); ++n) {
    for (std::int64_t v = 0; v < vocab; ++v) {
      double dot = 0.0;
      for (std::int64_t d = 0; d < dim; ++d) dot += double(hidden[n * dim + d]) * weight[v * dim + d];
      logits[n * vocab + v] = dot;
    }
  }
  for (std::size_t n = 0; n < targets.size(); ++n) {
    if (targets[n] == ops::kIgnoreIndex) continue;
    const double* row = logits.data() + n * vocab;
    const double max_logit = *std::max_element(row, row + vocab);
    double sum = 0.0;
    for (std::int64_t v = 0; v < vocab; ++v) sum += std::exp(row[v] - max_logit);
    total += max_logit + std::log(sum) - row[targets[n]];
    ++count;
  }
  return count == 0 ? 0.0 : total / double(count);
}

TEST(CrossEntropy, MatchesUnchunkedReference) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t tokens = 37, dim = 64, vocab = 1000;
  const auto hidden = test::random_normal(rng, tokens * dim), weight = test::random_normal(rng, vocab * dim, 0.2f);
  auto targets = random_targets(rng, tokens, vocab, 0.25);
  targets[0] = ops::kIgnoreIndex;
  targets[1] = vocab - 1;
  const std::int64_t counted =
      std::count_if(targets.begin(), targets.end(), [](auto t) { return t != ops::kIgnoreIndex; });
  const double expected = unchunked_loss(hidden, weight, targets, dim, vocab);
  const auto result = ops::cross_entropy_forward_cpu<float>(hidden, weight, targets, dim, vocab, 8);
  EXPECT_EQ(result.count, counted);
  EXPECT_NEAR(result.loss, expected, 1e-6 * std::fabs(expected));
}

TEST(CrossEntropy, ChunkSizeChangesOnlyRounding) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t tokens = 29, dim = 24, vocab = 307;
  const auto hidden = test::random_normal(rng, tokens * dim), weight = test::random_normal(rng, vocab * dim, 0.3f);
  const auto targets = random_targets(rng, tokens, vocab, 0.3);
  const auto dweight_initial = test::random_normal(rng, vocab * dim, 1e-2f);
  std::vector<float> reference_dhidden, reference_dweight;
  double reference_loss = 0.0;
  for (const std::int64_t chunk : {tokens, std::int64_t{1}, std::int64_t{5}, std::int64_t{16}, std::int64_t{0}}) {
    std::vector<float> dhidden(hidden.size(), std::numeric_limits<float>::quiet_NaN());
    auto dweight = dweight_initial;
    const auto result =
        ops::cross_entropy_backward_cpu<float>(hidden, weight, targets, dim, vocab, dhidden, dweight, 1.0, chunk);
    const auto forward = ops::cross_entropy_forward_cpu<float>(hidden, weight, targets, dim, vocab, chunk);
    EXPECT_EQ(result.loss, forward.loss) << "the backward returns the forward's loss";
    EXPECT_EQ(result.count, forward.count);
    if (chunk == tokens) {
      reference_loss = result.loss;
      reference_dhidden = dhidden;
      reference_dweight = dweight;
      continue;
    }
    EXPECT_NEAR(result.loss, reference_loss, 1e-12 * std::fabs(reference_loss)) << "chunk " << chunk;
    EXPECT_TRUE(test::all_close(dhidden, reference_dhidden, 1e-6, 1e-9)) << "chunk " << chunk;
    EXPECT_TRUE(test::all_close(dweight, reference_dweight, 1e-5, 1e-8)) << "chunk " << chunk;
  }
}

TEST(CrossEntropy, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  struct Case {
    std::int64_t tokens, dim, vocab, chunk;
  };
  for (const Case& c : {Case{9, 6, 13, 4}, Case{1, 64, 50, 0}, Case{7, 128, 31, 3}}) {
    auto hidden = optest::random_doubles(rng, c.tokens * c.dim);
    auto weight = optest::random_doubles(rng, c.vocab * c.dim, 0.3f);
    auto targets = random_targets(rng, c.tokens, c.vocab, 0.3);
    targets[0] = static_cast<std::int32_t>(c.vocab - 1);
    const double grad_scale = 0.75;
    auto loss = [&] {
      return grad_scale * ops::cross_entropy_forward_cpu<double>(hidden, weight, targets, c.dim, c.vocab, c.chunk).loss;
    };
    std::vector<double> dhidden(hidden.size()), dweight(weight.size(), 0.0);
    ops::cross_entropy_backward_cpu<double>(hidden, weight, targets, c.dim, c.vocab, dhidden, dweight, grad_scale,
                                            c.chunk);
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + " dim " + std::to_string(c.dim) + " vocab " +
                 std::to_string(c.vocab));
    EXPECT_TRUE(optest::matches_finite_differences("dhidden", hidden, dhidden, loss, rng));
    EXPECT_TRUE(optest::matches_finite_differences("dweight", weight, dweight, loss, rng));
  }
}

TEST(CrossEntropy, FloatMatchesDoubleAndAccumulatesWeightGradient) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t tokens = 45, dim = 64, vocab = 500;
  const auto hidden = test::random_normal(rng, tokens * dim), weight = test::random_normal(rng, vocab * dim, 0.2f);
  const auto targets = random_targets(rng, tokens, vocab, 0.2);
  const auto dweight_initial = test::random_normal(rng, vocab * dim, 1e-2f);
  std::vector<float> dhidden(hidden.size(), std::numeric_limits<float>::quiet_NaN());
  auto dweight = dweight_initial;
  const auto result =
      ops::cross_entropy_backward_cpu<float>(hidden, weight, targets, dim, vocab, dhidden, dweight, 1.0, 7);
  std::vector<double> dhiddend(hidden.size()), dweightd = optest::widen(dweight_initial);
  const auto resultd = ops::cross_entropy_backward_cpu<double>(optest::widen(hidden), optest::widen(weight), targets,
                                                               dim, vocab, dhiddend, dweightd, 1.0, 7);
  EXPECT_NEAR(result.loss, resultd.loss, 1e-6 * resultd.loss);
  EXPECT_TRUE(test::all_close(dhidden, optest::narrow(dhiddend), 1e-5, 1e-7));
  EXPECT_TRUE(test::all_close(dweight, optest::narrow(dweightd), 1e-5, 1e-7));
}

TEST(CrossEntropy, AllTargetsIgnoredGivesZeroLossAndZeroGradients) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t tokens = 6, dim = 8, vocab = 11;
  const auto hidden = test::random_normal(rng, tokens * dim), weight = test::random_normal(rng, vocab * dim);
  const std::vector<std::int32_t> targets(tokens, ops::kIgnoreIndex);
  const auto dweight_initial = test::random_normal(rng, vocab * dim);
  std::vector<float> dhidden(hidden.size(), std::numeric_limits<float>::quiet_NaN());
  auto dweight = dweight_initial;
  const auto result = ops::cross_entropy_backward_cpu<float>(hidden, weight, targets, dim, vocab, dhidden, dweight);
  EXPECT_EQ(result.loss, 0.0);
  EXPECT_EQ(result.count, 0);
  EXPECT_EQ(dhidden, std::vector<float>(hidden.size(), 0.0f));
  EXPECT_EQ(dweight, dweight_initial);
  const auto forward = ops::cross_entropy_forward_cpu<float>(hidden, weight, targets, dim, vocab);
  EXPECT_EQ(forward.loss, 0.0);
  EXPECT_EQ(forward.count, 0);
  const std::vector<std::int32_t> no_tokens;
  const std::vector<float> no_hidden;
  EXPECT_EQ(ops::cross_entropy_forward_cpu<float>(no_hidden, weight, no_tokens, dim, vocab).count, 0);
}

TEST(CrossEntropy, RejectsBadTargetsAndSizes) {
  const std::int64_t dim = 4, vocab = 10;
  std::vector<float> hidden(3 * dim), weight(vocab * dim), dhidden(3 * dim), dweight(vocab * dim);
  const std::vector<std::int32_t> too_big = {1, 10, 2}, negative = {1, 2, -1}, fine = {1, ops::kIgnoreIndex, 2};
  EXPECT_OP_ERROR(ops::cross_entropy_forward_cpu<float>(hidden, weight, too_big, dim, vocab),
                  "target 10 at position 1");
  EXPECT_OP_ERROR(ops::cross_entropy_backward_cpu<float>(hidden, weight, negative, dim, vocab, dhidden, dweight),
                  "target -1 at position 2");
  EXPECT_OP_ERROR(ops::cross_entropy_forward_cpu<float>(hidden, weight, fine, dim, vocab + 1),
                  "weight has 40 elements");
  EXPECT_OP_ERROR(ops::cross_entropy_backward_cpu<float>(hidden, weight, fine, dim, vocab,
                                                         std::span<float>(dhidden.data(), 11), dweight),
                  "dhidden has 11 elements");
  EXPECT_OP_ERROR(ops::cross_entropy_forward_cpu<float>(hidden, weight, fine, dim, vocab, -1),
                  "chunk_tokens must not be negative");
  EXPECT_EQ(ops::cross_entropy_chunk_tokens(151936, 0), 27);
  EXPECT_EQ(ops::cross_entropy_chunk_tokens(1000, 0), 4194);
  EXPECT_EQ(ops::cross_entropy_chunk_tokens(1000, 3), 3);
}

TEST(CrossEntropy, WeightRowWindowsSumToWholeWeightGradient) {
  std::mt19937_64 rng(test::fresh_seed());
  struct Case {
    std::int64_t tokens, dim, vocab, chunk;
    std::vector<std::int64_t> bounds;  // windows [bounds[i], bounds[i + 1])
  };
  const Case cases[] = {
      {23, 16, 37, 0, {0, 5, 22, 37}},     // uneven windows, one chunk
      {23, 16, 37, 4, {0, 1, 2, 19, 37}},  // windows of one row, 6 chunks (the last of 3)
      {1, 9, 37, 0, {0, 36, 37}},          // one token
      {17, 8, 50, 5, {0, 50}},             // one window: the whole vocabulary
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + " dim " + std::to_string(c.dim) + " vocab " +
                 std::to_string(c.vocab) + " chunk " + std::to_string(c.chunk));
    const auto hidden = optest::random_doubles(rng, c.tokens * c.dim);
    const auto weight = optest::random_doubles(rng, c.vocab * c.dim, 0.5f);
    auto targets = random_targets(rng, c.tokens, c.vocab, 0.3);
    targets[0] = static_cast<std::int32_t>(c.vocab - 1);  // a target in the last window
    if (c.tokens > 2) targets[2] = ops::kIgnoreIndex;
    const double grad_scale = 0.625;
    const auto dweight_initial = optest::random_doubles(rng, c.vocab * c.dim, 0.1f);
    std::vector<double> dhidden(hidden.size()), dweight = dweight_initial;
    ops::cross_entropy_backward_cpu<double>(hidden, weight, targets, c.dim, c.vocab, dhidden, dweight, grad_scale,
                                            c.chunk);
    // Each window accumulated onto its rows of the same initial value, then concatenated.
    std::vector<double> windows;
    for (std::size_t w = 0; w + 1 < c.bounds.size(); ++w) {
      const std::int64_t begin = c.bounds[w], end = c.bounds[w + 1];
      std::vector<double> rows(dweight_initial.begin() + begin * c.dim, dweight_initial.begin() + end * c.dim);
      ops::cross_entropy_backward_weight_rows_cpu<double>(hidden, weight, targets, c.dim, c.vocab, begin, end, rows,
                                                          grad_scale, c.chunk);
      windows.insert(windows.end(), rows.begin(), rows.end());
    }
    ASSERT_EQ(windows.size(), dweight.size());
    double max_increment = 0.0;
    for (std::size_t i = 0; i < dweight.size(); ++i) {
      max_increment = std::max(max_increment, std::fabs(dweight[i] - dweight_initial[i]));
    }
    ASSERT_GT(max_increment, 0.0);
    for (std::size_t i = 0; i < dweight.size(); ++i) {
      // Same dlogits, same products in double: equal up to the last bits.
      ASSERT_NEAR(windows[i], dweight[i], 1e-12 * (std::fabs(dweight[i]) + max_increment))
          << "row " << i / c.dim << " column " << i % c.dim;
    }
  }
}

TEST(CrossEntropy, WeightRowsFloatMatchesDoubleAndRejectsBadWindows) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t tokens = 31, dim = 24, vocab = 101, begin = 33, end = 70;
  const auto hidden = test::random_normal(rng, tokens * dim), weight = test::random_normal(rng, vocab * dim, 0.3f);
  const auto targets = random_targets(rng, tokens, vocab, 0.2);
  const auto initial = test::random_normal(rng, (end - begin) * dim, 1e-2f);
  auto rows = initial;
  ops::cross_entropy_backward_weight_rows_cpu<float>(hidden, weight, targets, dim, vocab, begin, end, rows, 2.0, 8);
  auto rowsd = optest::widen(initial);
  ops::cross_entropy_backward_weight_rows_cpu<double>(optest::widen(hidden), optest::widen(weight), targets, dim, vocab,
                                                      begin, end, rowsd, 2.0, 8);
  EXPECT_TRUE(test::all_close(rows, optest::narrow(rowsd), 1e-5, 1e-7));
  EXPECT_FALSE(test::all_close(rows, initial, 1e-5, 1e-7)) << "the rows were not accumulated into";

  std::vector<float> out((end - begin) * dim);
  EXPECT_OP_ERROR(ops::cross_entropy_backward_weight_rows_cpu<float>(hidden, weight, targets, dim, vocab, 5, 5, out),
                  "non-empty range");
  EXPECT_OP_ERROR(ops::cross_entropy_backward_weight_rows_cpu<float>(hidden, weight, targets, dim, vocab, -1, 36, out),
                  "non-empty range");
  EXPECT_OP_ERROR(
      ops::cross_entropy_backward_weight_rows_cpu<float>(hidden, weight, targets, dim, vocab, 65, vocab + 1, out),
      "non-empty range");
  EXPECT_OP_ERROR(
      ops::cross_entropy_backward_weight_rows_cpu<float>(hidden, weight, targets, dim, vocab, begin, end + 1, out),
      "dweight_rows has");
  const std::vector<std::int32_t> bad = {1, 101};
  EXPECT_OP_ERROR(ops::cross_entropy_backward_weight_rows_cpu<float>(std::span<const float>(hidden.data(), 2 * dim),
                                                                     weight, bad, dim, vocab, begin, end, out),
                  "target 101 at position 1");
}

}  // namespace
