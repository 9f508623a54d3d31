// The fused q/k norm + RoPE reference: its backward against fp64 finite differences of its forward
// (x, both weights; q and k heads packed per token), and its forward against the two references it
// composes applied to the q and k heads separately.
#include "models/ops/qk_norm_rope.h"
#include "models/ops/rmsnorm.h"
#include "models/ops/rope.h"
#include "support/op_test_support.h"

namespace {

namespace ops = models::ops;

TEST(QkNormRope, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_int_distribution<std::int32_t> any_position(0, 40000);
  for (const ops::QkNormRopeShape shape : {ops::QkNormRopeShape{3, 2, 1, 8, 1e-6, 1e6}, {2, 3, 2, 6, 1e-6, 1e4}}) {
    SCOPED_TRACE("heads " + std::to_string(shape.q_heads) + "/" + std::to_string(shape.kv_heads) + " head_dim " +
                 std::to_string(shape.head_dim));
    const std::int64_t width = (shape.q_heads + shape.kv_heads) * shape.head_dim;
    std::vector<std::int32_t> positions(static_cast<std::size_t>(shape.tokens));
    for (auto& p : positions) p = any_position(rng);
    auto x = optest::random_doubles(rng, shape.tokens * width);
    auto wq = optest::random_doubles(rng, shape.head_dim), wk = optest::random_doubles(rng, shape.head_dim);
    const auto weights = optest::random_doubles(rng, x.size());
    std::vector<double> y(x.size()), rq(shape.tokens * shape.q_heads), rk(shape.tokens * shape.kv_heads);
    auto loss = [&] {
      ops::qk_norm_rope_forward_cpu<double>(x, wq, wk, positions, shape, y, rq, rk);
      return optest::weighted_sum(y, weights);
    };
    loss();
    std::vector<double> dx(x.size()), dwq(shape.head_dim, 0.0), dwk(shape.head_dim, 0.0);
    ops::qk_norm_rope_backward_cpu<double>(weights, x, wq, wk, rq, rk, positions, shape, dx, dwq, dwk);
    EXPECT_TRUE(optest::matches_finite_differences("dx", x, dx, loss, rng));
    EXPECT_TRUE(optest::matches_finite_differences("dwq", wq, dwq, loss, rng));
    EXPECT_TRUE(optest::matches_finite_differences("dwk", wk, dwk, loss, rng));
  }
}

TEST(QkNormRope, ForwardIsTheNormThenTheRotationOfEachHeadGroup) {
  std::mt19937_64 rng(test::fresh_seed());
  const ops::QkNormRopeShape shape{5, 4, 2, 16, 1e-6, 1e6};
  const std::int64_t q_cols = shape.q_heads * shape.head_dim, k_cols = shape.kv_heads * shape.head_dim;
  std::vector<std::int32_t> positions = {0, 1, 17, 4095, 40000};
  const auto x = test::random_normal(rng, shape.tokens * (q_cols + k_cols));
  const auto wq = test::random_normal(rng, shape.head_dim), wk = test::random_normal(rng, shape.head_dim);
  std::vector<float> y(x.size()), rq(shape.tokens * shape.q_heads), rk(shape.tokens * shape.kv_heads);
  ops::qk_norm_rope_forward_cpu<float>(x, wq, wk, positions, shape, y, rq, rk);
  for (const bool is_q : {true, false}) {
    const std::int64_t heads = is_q ? shape.q_heads : shape.kv_heads, cols = is_q ? q_cols : k_cols;
    const std::int64_t offset = is_q ? 0 : q_cols;
    std::vector<float> part(shape.tokens * cols), expected(part.size()), rstd(shape.tokens * heads);
    for (std::int64_t n = 0; n < shape.tokens; ++n) {
      for (std::int64_t c = 0; c < cols; ++c) part[n * cols + c] = x[n * (q_cols + k_cols) + offset + c];
    }
    ops::head_rmsnorm_forward_cpu<float>(part, is_q ? wq : wk, shape.tokens, heads, shape.head_dim, shape.eps, expected,
                                         rstd);
    ops::rope_forward_cpu<float>(expected, positions, heads, shape.head_dim, shape.theta, expected);
    for (std::int64_t n = 0; n < shape.tokens; ++n) {
      for (std::int64_t c = 0; c < cols; ++c) {
        ASSERT_EQ(y[n * (q_cols + k_cols) + offset + c], expected[n * cols + c]) << "token " << n << " column " << c;
      }
    }
    EXPECT_EQ(is_q ? rq : rk, rstd);
  }
}

TEST(QkNormRope, RejectsMismatchedSizes) {
  const ops::QkNormRopeShape shape{2, 2, 1, 8, 1e-6, 1e6};
  std::vector<float> x(2 * 3 * 8), w(8), y(x.size() - 1), rq(4), rk(2);
  const std::vector<std::int32_t> positions = {0, 1};
  EXPECT_OP_ERROR(ops::qk_norm_rope_forward_cpu<float>(x, w, w, positions, shape, y, rq, rk), "y");
}

}  // namespace
