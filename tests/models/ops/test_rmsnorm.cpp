// RMSNorm and the per-head RMSNorm of q/k: forward against the formula, gradients against fp64
// finite differences over odd and model-sized dims, fp32 against fp64, accumulation of dw.
#include <limits>

#include "models/ops/rmsnorm.h"
#include "support/op_test_support.h"

namespace {

namespace ops = models::ops;

constexpr double kEps = 1e-6;

TEST(RmsNorm, ForwardMatchesFormula) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const std::int64_t dim : {7, 64, 128, 1000}) {
    for (const std::int64_t rows : {1, 13}) {
      const auto x = test::random_normal(rng, rows * dim, 3.0f);
      const auto w = test::random_normal(rng, dim);
      std::vector<float> y(rows * dim), rstd(rows);
      ops::rmsnorm_forward_cpu<float>(x, w, rows, dim, kEps, y, rstd);
      std::vector<double> expected_y(y.size()), expected_rstd(rows);
      for (std::int64_t n = 0; n < rows; ++n) {
        double sum_sq = 0.0;
        for (std::int64_t d = 0; d < dim; ++d) sum_sq += double(x[n * dim + d]) * x[n * dim + d];
        expected_rstd[n] = 1.0 / std::sqrt(sum_sq / dim + kEps);
        for (std::int64_t d = 0; d < dim; ++d) expected_y[n * dim + d] = x[n * dim + d] * expected_rstd[n] * w[d];
      }
      EXPECT_TRUE(test::all_close(y, optest::narrow(expected_y), 1e-6, 1e-7)) << "dim " << dim << " rows " << rows;
      EXPECT_TRUE(test::all_close(rstd, optest::narrow(expected_rstd), 1e-6, 0.0));
    }
  }
}

TEST(RmsNorm, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const std::int64_t dim : {7, 64, 128}) {
    for (const std::int64_t rows : {1, 5}) {
      auto x = optest::random_doubles(rng, rows * dim);
      auto w = optest::random_doubles(rng, dim);
      const auto weights = optest::random_doubles(rng, rows * dim);
      std::vector<double> y(x.size()), rstd(rows);
      auto loss = [&] {
        ops::rmsnorm_forward_cpu<double>(x, w, rows, dim, kEps, y, rstd);
        return optest::weighted_sum(y, weights);
      };
      loss();
      std::vector<double> dx(x.size()), dw(dim, 0.0);
      ops::rmsnorm_backward_cpu<double>(weights, x, w, rstd, rows, dim, dx, dw);
      SCOPED_TRACE("dim " + std::to_string(dim) + " rows " + std::to_string(rows));
      EXPECT_TRUE(optest::matches_finite_differences("dx", x, dx, loss, rng));
      EXPECT_TRUE(optest::matches_finite_differences("dw", w, dw, loss, rng));
    }
  }
}

TEST(RmsNorm, FloatMatchesDoubleAndAccumulatesWeightGradient) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t rows = 37, dim = 130;
  const auto x = test::random_normal(rng, rows * dim);
  const auto w = test::random_normal(rng, dim);
  const auto dy = test::random_normal(rng, rows * dim);
  const auto dw_initial = test::random_normal(rng, dim);
  std::vector<float> y(x.size()), rstd(rows), dx(x.size(), std::numeric_limits<float>::quiet_NaN());
  auto dw = dw_initial;
  ops::rmsnorm_forward_cpu<float>(x, w, rows, dim, kEps, y, rstd);
  ops::rmsnorm_backward_cpu<float>(dy, x, w, rstd, rows, dim, dx, dw);

  const auto xd = optest::widen(x), wd = optest::widen(w), dyd = optest::widen(dy);
  std::vector<double> yd(x.size()), rstdd(rows), dxd(x.size()), dwd(optest::widen(dw_initial));
  ops::rmsnorm_forward_cpu<double>(xd, wd, rows, dim, kEps, yd, rstdd);
  ops::rmsnorm_backward_cpu<double>(dyd, xd, wd, rstdd, rows, dim, dxd, dwd);
  EXPECT_TRUE(test::all_close(y, optest::narrow(yd), 1e-6, 1e-7));
  EXPECT_TRUE(test::all_close(dx, optest::narrow(dxd), 1e-5, 1e-6));
  EXPECT_TRUE(test::all_close(dw, optest::narrow(dwd), 1e-5, 1e-5));
}

TEST(HeadRmsNorm, NormalisesEveryHeadWithTheSharedWeight) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t tokens = 11, heads = 3, head_dim = 64;
  const auto x = test::random_normal(rng, tokens * heads * head_dim, 2.0f);
  const auto w = test::random_normal(rng, head_dim);
  std::vector<float> y(x.size()), rstd(tokens * heads);
  ops::head_rmsnorm_forward_cpu<float>(x, w, tokens, heads, head_dim, kEps, y, rstd);
  std::vector<double> expected(x.size());
  for (std::int64_t row = 0; row < tokens * heads; ++row) {
    double sum_sq = 0.0;
    for (std::int64_t d = 0; d < head_dim; ++d) sum_sq += double(x[row * head_dim + d]) * x[row * head_dim + d];
    const double r = 1.0 / std::sqrt(sum_sq / head_dim + kEps);
    for (std::int64_t d = 0; d < head_dim; ++d) expected[row * head_dim + d] = x[row * head_dim + d] * r * w[d];
  }
  EXPECT_TRUE(test::all_close(y, optest::narrow(expected), 1e-6, 1e-7));

  auto xd = optest::widen(x), wd = optest::widen(w);
  const auto weights = optest::random_doubles(rng, x.size());
  std::vector<double> yd(x.size()), rstdd(tokens * heads);
  auto loss = [&] {
    ops::head_rmsnorm_forward_cpu<double>(xd, wd, tokens, heads, head_dim, kEps, yd, rstdd);
    return optest::weighted_sum(yd, weights);
  };
  loss();
  std::vector<double> dx(x.size()), dw(head_dim, 0.0);
  ops::head_rmsnorm_backward_cpu<double>(weights, xd, wd, rstdd, tokens, heads, head_dim, dx, dw);
  EXPECT_TRUE(optest::matches_finite_differences("dx", xd, dx, loss, rng));
  EXPECT_TRUE(optest::matches_finite_differences("dw", wd, dw, loss, rng));
}

TEST(RmsNorm, RejectsWrongSizes) {
  std::vector<float> x(12), w(4), y(12), rstd(3), dx(12), dw(4);
  EXPECT_OP_ERROR(ops::rmsnorm_forward_cpu<float>(x, std::span<const float>(w.data(), 3), 3, 4, kEps, y, rstd),
                  "rmsnorm_forward: weight has 3 elements, expected 4");
  EXPECT_OP_ERROR(ops::rmsnorm_forward_cpu<float>(x, w, 3, 0, kEps, y, rstd), "dim must be positive");
  EXPECT_OP_ERROR(ops::rmsnorm_forward_cpu<float>(x, w, 3, 4, kEps, y, std::span<float>(rstd.data(), 2)),
                  "rstd has 2 elements");
  EXPECT_OP_ERROR(ops::rmsnorm_backward_cpu<float>(y, x, w, rstd, 4, 4, dx, dw), "dy has 12 elements, expected 16");
  EXPECT_OP_ERROR(ops::head_rmsnorm_forward_cpu<float>(x, w, 3, 0, 4, kEps, y, rstd), "heads must be positive");
  EXPECT_OP_ERROR(ops::rmsnorm_backward_cpu<float>(y, x, w, rstd, 3, 4, std::span<float>(y), dw), "dx overlaps");
}

}  // namespace
