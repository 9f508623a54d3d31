// Linear layer y = x W^T: forward against a naive product across the block sizes of the
// blocked loops, gradients against fp64 finite differences, dx written and dW accumulated.
#include <limits>

#include "models/ops/linear.h"
#include "support/op_test_support.h"

namespace {

namespace ops = models::ops;

struct LinearShape {
  std::int64_t rows, in, out;
};

TEST(Linear, MatchesNaiveProducts) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const LinearShape& s : {LinearShape{1, 7, 5}, LinearShape{37, 600, 70}, LinearShape{17, 64, 1030}}) {
    const auto x = test::random_normal(rng, s.rows * s.in), w = test::random_normal(rng, s.out * s.in);
    const auto dy = test::random_normal(rng, s.rows * s.out), dw_initial = test::random_normal(rng, s.out * s.in);
    std::vector<float> y(s.rows * s.out, std::numeric_limits<float>::quiet_NaN());
    std::vector<float> dx(s.rows * s.in, std::numeric_limits<float>::quiet_NaN());
    auto dw = dw_initial;
    ops::linear_forward_cpu<float>(x, w, s.rows, s.in, s.out, y);
    ops::linear_backward_cpu<float>(dy, x, w, s.rows, s.in, s.out, dx, dw);

    std::vector<double> expected_y(y.size(), 0.0), expected_dx(dx.size(), 0.0);
    std::vector<double> expected_dw(dw_initial.begin(), dw_initial.end());
    for (std::int64_t n = 0; n < s.rows; ++n) {
      for (std::int64_t o = 0; o < s.out; ++o) {
        for (std::int64_t i = 0; i < s.in; ++i) {
          expected_y[n * s.out + o] += double(x[n * s.in + i]) * w[o * s.in + i];
          expected_dx[n * s.in + i] += double(dy[n * s.out + o]) * w[o * s.in + i];
          expected_dw[o * s.in + i] += double(dy[n * s.out + o]) * x[n * s.in + i];
        }
      }
    }
    const std::string name = std::to_string(s.rows) + "x" + std::to_string(s.in) + "->" + std::to_string(s.out);
    EXPECT_TRUE(test::all_close(y, optest::narrow(expected_y), 1e-6, 1e-6)) << name;
    EXPECT_TRUE(test::all_close(dx, optest::narrow(expected_dx), 1e-6, 1e-6)) << name;
    EXPECT_TRUE(test::all_close(dw, optest::narrow(expected_dw), 1e-6, 1e-6)) << name;
  }
}

TEST(Linear, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const LinearShape& s : {LinearShape{5, 7, 3}, LinearShape{9, 64, 20}, LinearShape{1, 128, 9}}) {
    auto x = optest::random_doubles(rng, s.rows * s.in), w = optest::random_doubles(rng, s.out * s.in);
    const auto weights = optest::random_doubles(rng, s.rows * s.out);
    std::vector<double> y(s.rows * s.out);
    auto loss = [&] {
      ops::linear_forward_cpu<double>(x, w, s.rows, s.in, s.out, y);
      return optest::weighted_sum(y, weights);
    };
    std::vector<double> dx(x.size()), dw(w.size(), 0.0);
    ops::linear_backward_cpu<double>(weights, x, w, s.rows, s.in, s.out, dx, dw);
    EXPECT_TRUE(optest::matches_finite_differences("dx", x, dx, loss, rng));
    EXPECT_TRUE(optest::matches_finite_differences("dw", w, dw, loss, rng));
  }
}

TEST(Linear, RejectsWrongSizes) {
  std::vector<float> x(3 * 4), w(5 * 4), y(3 * 5), dx(3 * 4), dw(5 * 4);
  EXPECT_OP_ERROR(ops::linear_forward_cpu<float>(x, w, 3, 4, 6, y), "weight has 20 elements, expected 24");
  EXPECT_OP_ERROR(ops::linear_forward_cpu<float>(x, w, 4, 4, 5, y), "x has 12 elements, expected 16");
  EXPECT_OP_ERROR(ops::linear_backward_cpu<float>(y, x, w, 3, 4, 5, dx, std::span<float>(dw.data(), 19)),
                  "dweight has 19 elements");
  EXPECT_OP_ERROR(ops::linear_backward_cpu<float>(y, x, w, 3, 4, 5, std::span<float>(x), dw),
                  "dx overlaps the input x");
  EXPECT_OP_ERROR(ops::linear_forward_cpu<float>(x, w, 3, 0, 5, y), "in_features must be positive");
}

}  // namespace
