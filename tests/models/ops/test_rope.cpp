// RoPE: the rotate-half formula with per-token positions, identity at position 0, per-pair
// norms preserved, rotations compose (angles add), backward inverts the forward, in place equals
// out of place, fp64 finite differences, and rejection of bad arguments.
#include <limits>

#include "models/ops/rope.h"
#include "support/op_test_support.h"

namespace {

namespace ops = models::ops;

constexpr double kTheta = 1e6;

std::vector<std::int32_t> random_positions(std::mt19937_64& rng, std::size_t n, std::int32_t max_position) {
  std::uniform_int_distribution<std::int32_t> pick(0, max_position);
  std::vector<std::int32_t> positions(n);
  for (auto& p : positions) p = pick(rng);
  return positions;
}

TEST(Rope, MatchesRotateHalfFormula) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const std::int64_t head_dim : {6, 64, 128}) {
    const std::int64_t heads = 3;
    auto positions = random_positions(rng, 17, 40000);
    positions[0] = 0;
    positions[1] = 1;
    const auto x = test::random_normal(rng, positions.size() * heads * head_dim);
    std::vector<float> out(x.size());
    ops::rope_forward_cpu<float>(x, positions, heads, head_dim, kTheta, out);
    const std::int64_t half = head_dim / 2;
    std::vector<double> expected(x.size());
    for (std::size_t n = 0; n < positions.size(); ++n) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::size_t base = (n * heads + h) * head_dim;
        for (std::int64_t i = 0; i < half; ++i) {
          const double angle = positions[n] * std::pow(kTheta, -2.0 * i / head_dim);
          expected[base + i] = x[base + i] * std::cos(angle) - x[base + i + half] * std::sin(angle);
          expected[base + i + half] = x[base + i + half] * std::cos(angle) + x[base + i] * std::sin(angle);
        }
      }
    }
    EXPECT_TRUE(test::all_close(out, optest::narrow(expected), 1e-6, 1e-6)) << "head_dim " << head_dim;
  }
}

TEST(Rope, PositionZeroIsIdentityAndPairNormsArePreserved) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t heads = 4, head_dim = 128, half = head_dim / 2;
  const auto x = test::random_normal(rng, 9 * heads * head_dim);
  std::vector<float> out(x.size());
  ops::rope_forward_cpu<float>(x, std::vector<std::int32_t>(9, 0), heads, head_dim, kTheta, out);
  EXPECT_EQ(out, x);

  const auto positions = random_positions(rng, 9, 1 << 20);
  ops::rope_forward_cpu<float>(x, positions, heads, head_dim, kTheta, out);
  for (std::int64_t row = 0; row < 9 * heads; ++row) {
    for (std::int64_t i = 0; i < half; ++i) {
      const std::size_t a = row * head_dim + i, b = a + half;
      const double before = double(x[a]) * x[a] + double(x[b]) * x[b];
      const double after = double(out[a]) * out[a] + double(out[b]) * out[b];
      ASSERT_NEAR(after, before, 1e-6 * before + 1e-12) << "row " << row << " pair " << i;
    }
  }
}

TEST(Rope, RotationsCompose) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t heads = 2, head_dim = 64;
  const auto first = random_positions(rng, 13, 3000), second = random_positions(rng, 13, 3000);
  std::vector<std::int32_t> sum(13);
  for (std::size_t n = 0; n < sum.size(); ++n) sum[n] = first[n] + second[n];
  const auto x = optest::random_doubles(rng, 13 * heads * head_dim);
  std::vector<double> once(x.size()), twice(x.size()), direct(x.size());
  ops::rope_forward_cpu<double>(x, first, heads, head_dim, kTheta, once);
  ops::rope_forward_cpu<double>(once, second, heads, head_dim, kTheta, twice);
  ops::rope_forward_cpu<double>(x, sum, heads, head_dim, kTheta, direct);
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(twice[i], direct[i], 1e-10) << i;
}

TEST(Rope, BackwardInvertsForwardAndInPlaceMatches) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t heads = 5, head_dim = 128;
  const auto positions = random_positions(rng, 21, 100000);
  const auto x = test::random_normal(rng, positions.size() * heads * head_dim);
  std::vector<float> out(x.size()), back(x.size());
  ops::rope_forward_cpu<float>(x, positions, heads, head_dim, kTheta, out);
  ops::rope_backward_cpu<float>(out, positions, heads, head_dim, kTheta, back);
  EXPECT_TRUE(test::all_close(back, x, 1e-6, 1e-6));

  auto in_place = x;
  ops::rope_forward_cpu<float>(in_place, positions, heads, head_dim, kTheta, in_place);
  EXPECT_EQ(in_place, out);
  ops::rope_backward_cpu<float>(in_place, positions, heads, head_dim, kTheta, in_place);
  EXPECT_EQ(in_place, back);
}

TEST(Rope, GradientMatchesFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const std::int64_t head_dim : {6, 64}) {
    const std::int64_t heads = 3;
    const auto positions = random_positions(rng, 7, 5000);
    auto x = optest::random_doubles(rng, positions.size() * heads * head_dim);
    const auto weights = optest::random_doubles(rng, x.size());
    std::vector<double> out(x.size());
    auto loss = [&] {
      ops::rope_forward_cpu<double>(x, positions, heads, head_dim, kTheta, out);
      return optest::weighted_sum(out, weights);
    };
    std::vector<double> dx(x.size());
    ops::rope_backward_cpu<double>(weights, positions, heads, head_dim, kTheta, dx);
    EXPECT_TRUE(optest::matches_finite_differences("dx", x, dx, loss, rng)) << "head_dim " << head_dim;
  }
}

TEST(Rope, RejectsBadArguments) {
  std::vector<float> x(2 * 3 * 8), out(x.size());
  const std::vector<std::int32_t> positions = {0, 5}, negative = {0, -3};
  EXPECT_OP_ERROR(ops::rope_forward_cpu<float>(std::span<const float>(x.data(), 2 * 3 * 7), positions, 3, 7, kTheta,
                                               std::span<float>(out.data(), 2 * 3 * 7)),
                  "head_dim must be even");
  EXPECT_OP_ERROR(ops::rope_forward_cpu<float>(x, negative, 3, 8, kTheta, out), "position -3 of token 1");
  EXPECT_OP_ERROR(ops::rope_forward_cpu<float>(x, positions, 4, 8, kTheta, out), "x has 48 elements, expected 64");
  EXPECT_OP_ERROR(ops::rope_forward_cpu<float>(x, positions, 3, 8, 0.0, out), "theta must be positive");
  std::vector<float> big(x.size() + 8);
  EXPECT_OP_ERROR(ops::rope_forward_cpu<float>(std::span<const float>(big.data(), x.size()), positions, 3, 8, kTheta,
                                               std::span<float>(big.data() + 8, x.size())),
                  "out overlaps the input x");
}

}  // namespace
