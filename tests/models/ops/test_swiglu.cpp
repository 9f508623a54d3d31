// SwiGLU on the fused [gate | up] layout: forward against silu(gate) * up, gradients against
// fp64 finite differences, finite results for saturated gates, rejection of wrong sizes.
#include <limits>

#include "models/ops/swiglu.h"
#include "support/op_test_support.h"

namespace {

namespace ops = models::ops;

TEST(SwiGlu, ForwardMatchesFormula) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t rows = 13, features = 97;
  const auto gate_up = test::random_normal(rng, rows * 2 * features, 3.0f);
  std::vector<float> out(rows * features);
  ops::swiglu_forward_cpu<float>(gate_up, rows, features, out);
  std::vector<double> expected(out.size());
  for (std::int64_t n = 0; n < rows; ++n) {
    for (std::int64_t f = 0; f < features; ++f) {
      const double g = gate_up[n * 2 * features + f], u = gate_up[n * 2 * features + features + f];
      expected[n * features + f] = g / (1.0 + std::exp(-g)) * u;
    }
  }
  EXPECT_TRUE(test::all_close(out, optest::narrow(expected), 1e-6, 1e-7));
}

TEST(SwiGlu, GradientMatchesFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const std::int64_t features : {7, 64}) {
    const std::int64_t rows = 5;
    auto gate_up = optest::random_doubles(rng, rows * 2 * features, 2.0f);
    const auto weights = optest::random_doubles(rng, rows * features);
    std::vector<double> out(rows * features);
    auto loss = [&] {
      ops::swiglu_forward_cpu<double>(gate_up, rows, features, out);
      return optest::weighted_sum(out, weights);
    };
    std::vector<double> dgate_up(gate_up.size());
    ops::swiglu_backward_cpu<double>(weights, gate_up, rows, features, dgate_up);
    EXPECT_TRUE(optest::matches_finite_differences("dgate_up", gate_up, dgate_up, loss, rng)) << features;
  }
}

TEST(SwiGlu, SaturatedGatesStayFiniteAndFloatMatchesDouble) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t rows = 3, features = 41;
  auto gate_up = test::random_normal(rng, rows * 2 * features, 4.0f);
  const float extremes[] = {-1000.0f, -100.0f, -30.0f, 30.0f, 100.0f, 1000.0f};
  for (std::size_t i = 0; i < std::size(extremes); ++i) gate_up[i] = extremes[i];
  const auto dout = test::random_normal(rng, rows * features);
  std::vector<float> out(rows * features), dgate_up(gate_up.size(), std::numeric_limits<float>::quiet_NaN());
  ops::swiglu_forward_cpu<float>(gate_up, rows, features, out);
  ops::swiglu_backward_cpu<float>(dout, gate_up, rows, features, dgate_up);
  for (const float x : out) ASSERT_TRUE(std::isfinite(x));
  for (const float x : dgate_up) ASSERT_TRUE(std::isfinite(x));
  std::vector<double> outd(out.size()), dgate_upd(gate_up.size());
  ops::swiglu_forward_cpu<double>(optest::widen(gate_up), rows, features, outd);
  ops::swiglu_backward_cpu<double>(optest::widen(dout), optest::widen(gate_up), rows, features, dgate_upd);
  EXPECT_TRUE(test::all_close(out, optest::narrow(outd), 1e-6, 1e-7));
  EXPECT_TRUE(test::all_close(dgate_up, optest::narrow(dgate_upd), 1e-6, 1e-7));
}

TEST(SwiGlu, RejectsWrongSizes) {
  std::vector<float> gate_up(2 * 10), out(2 * 5), dgate_up(2 * 10);
  EXPECT_OP_ERROR(ops::swiglu_forward_cpu<float>(gate_up, 2, 4, out), "gate_up has 20 elements, expected 16");
  EXPECT_OP_ERROR(ops::swiglu_forward_cpu<float>(gate_up, 2, 5, std::span<float>(out.data(), 9)), "out has 9");
  EXPECT_OP_ERROR(ops::swiglu_backward_cpu<float>(out, gate_up, 2, 5, std::span<float>(gate_up)), "dgate_up overlaps");
}

}  // namespace
