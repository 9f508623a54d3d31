// The E29a layer's CPU reference: every gradient (H_0 and the input included) against fp64
// central finite differences over N in {1, 2, 8}, D in {1, 5, 24}, T in {1, 2, 7}; the zero-tape
// degeneracy (equal slots stay equal, both attentions exactly uniform, score gradients exactly
// zero); forward and gradients against a PyTorch-autograd fixture; state hand-over between
// calls; fp32 against fp64; accumulation; independence from the thread count.
#include <omp.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <functional>

#include <nlohmann/json.hpp>

#include "models/e29a/layer.h"
#include "support/op_test_support.h"

namespace {

namespace e29a = models::e29a;

// The parameters of one layer as owned vectors.
template <typename Scalar>
struct Params {
  std::vector<Scalar> w_xz, w_h, b_h, w_write, tape0;

  e29a::LayerWeights<Scalar> view() const { return {w_xz, w_h, b_h, w_write, tape0}; }
  e29a::LayerGradients<Scalar> grads() { return {w_xz, w_h, b_h, w_write, tape0}; }
  static Params zeros(std::int64_t d, std::int64_t n) {
    return {std::vector<Scalar>(2 * d * d), std::vector<Scalar>(d * d), std::vector<Scalar>(d),
            std::vector<Scalar>(d * d), std::vector<Scalar>(n * d)};
  }
};

// Random weights at the scales of a trained layer: recurrent products of order one, a tape whose
// rows differ enough for the attention to be far from uniform.
Params<double> random_params(std::mt19937_64& rng, std::int64_t d, std::int64_t n, float tape_scale = 1.5f) {
  const float s = 1.0f / std::sqrt(static_cast<float>(d));
  return {optest::random_doubles(rng, 2 * d * d, s), optest::random_doubles(rng, d * d, 0.9f * s),
          optest::random_doubles(rng, d, 0.2f), optest::random_doubles(rng, d * d, 1.5f * s),
          optest::random_doubles(rng, n * d, tape_scale)};
}

// Normwise comparison of a whole gradient with its full finite-difference estimate:
// ||fd - g|| <= rel * ||fd|| + ||fd - fd2||, or, where the true gradient is zero (fd == 0 up to
// rounding), every |g|, |fd| <= abs. fd2 is the same estimate at twice the step: their difference
// (15x the truncation error of fd, plus the rounding of both) is what fd itself is known to, so a
// draw whose recurrence makes the loss extremely sensitive (gradients of norm 1e4 over 33 steps)
// or a tiny gradient (norm 1e-5, where a few ulps of loss over the step are 1e-6 of it) does not
// fail on the estimate's own error; a wrong gradient is off by far more.
::testing::AssertionResult normwise_matches_fd(std::string_view name, std::vector<double>& x,
                                               const std::vector<double>& analytic, const std::function<double()>& loss,
                                               double rel, double abs_zero, double step = 1e-5) {
  // Fourth-order central differences: truncation O(step^4), so the estimate stays far below the
  // tolerance even where a long recurrence makes the higher derivatives large.
  std::vector<double> fd(x.size()), fd2(x.size());
  auto at = [&](std::size_t i, double value) {
    x[i] = value;
    return loss();
  };
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    const double p1 = at(i, saved + step), m1 = at(i, saved - step);
    const double p2 = at(i, saved + 2 * step), m2 = at(i, saved - 2 * step);
    const double p4 = at(i, saved + 4 * step), m4 = at(i, saved - 4 * step);
    x[i] = saved;
    fd[i] = (8 * (p1 - m1) - (p2 - m2)) / (12 * step);
    fd2[i] = (8 * (p2 - m2) - (p4 - m4)) / (24 * step);
  }
  double diff_sq = 0.0, fd_sq = 0.0, spread_sq = 0.0, max_fd = 0.0, max_g = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    diff_sq += (fd[i] - analytic[i]) * (fd[i] - analytic[i]);
    spread_sq += (fd[i] - fd2[i]) * (fd[i] - fd2[i]);
    fd_sq += fd[i] * fd[i];
    max_fd = std::max(max_fd, std::fabs(fd[i]));
    max_g = std::max(max_g, std::fabs(analytic[i]));
  }
  if (max_fd <= abs_zero) {
    if (max_g <= abs_zero) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << name << ": true gradient is zero (max |fd| " << max_fd
                                         << ") but max |analytic| is " << max_g;
  }
  const double error = std::sqrt(diff_sq / fd_sq);
  if (std::sqrt(diff_sq) <= rel * std::sqrt(fd_sq) + std::sqrt(spread_sq)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << name << ": normwise relative error " << error << " > " << rel << " (||fd|| "
                                       << std::sqrt(fd_sq) << ", ||fd - g|| " << std::sqrt(diff_sq)
                                       << ", the estimate's own spread ||fd - fd2|| " << std::sqrt(spread_sq) << ")";
}

// The finite-difference tests evaluate thousands of tiny forwards: one thread avoids the
// fork/join cost of every small product.
class SingleThread {
 public:
  SingleThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SingleThread() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

TEST(E29aCpu, GradientsMatchFiniteDifferences) {
  const SingleThread single;
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t batch = 2;
  for (const std::int64_t slots : {1, 2, 8}) {
    for (const std::int64_t dim : {1, 5, 24}) {
      for (const std::int64_t steps : {1, 2, 7}) {
        SCOPED_TRACE("N " + std::to_string(slots) + " D " + std::to_string(dim) + " T " + std::to_string(steps));
        const e29a::LayerShape shape{batch, steps, dim, slots};
        auto p = random_params(rng, dim, slots);
        auto u = optest::random_doubles(rng, batch * steps * dim);
        const auto weights = optest::random_doubles(rng, batch * steps * dim);
        std::vector<double> y(u.size());
        auto loss = [&] {
          e29a::layer_forward_cpu<double>(shape, p.view(), u, y, nullptr);
          return optest::weighted_sum(y, weights);
        };
        e29a::LayerActivations<double> acts;
        e29a::layer_forward_cpu<double>(shape, p.view(), u, y, &acts);
        auto g = Params<double>::zeros(dim, slots);
        std::vector<double> du(u.size());
        e29a::layer_backward_cpu<double>(p.view(), acts, u, weights, du, g.grads());

        constexpr double kRel = 1e-6, kAbs = 1e-9;
        EXPECT_TRUE(normwise_matches_fd("W_xz", p.w_xz, g.w_xz, loss, kRel, kAbs));
        EXPECT_TRUE(normwise_matches_fd("W_h", p.w_h, g.w_h, loss, kRel, kAbs));
        EXPECT_TRUE(normwise_matches_fd("b_h", p.b_h, g.b_h, loss, kRel, kAbs));
        EXPECT_TRUE(normwise_matches_fd("W_write", p.w_write, g.w_write, loss, kRel, kAbs));
        EXPECT_TRUE(normwise_matches_fd("H_0", p.tape0, g.tape0, loss, kRel, kAbs));
        EXPECT_TRUE(normwise_matches_fd("u", u, du, loss, kRel, kAbs));
        // With one step the written tape is never read: W_write has no influence.
        if (steps == 1) {
          for (const double v : g.w_write) EXPECT_EQ(v, 0.0);
        }
      }
    }
  }
}

// One step of the write path exercised alone: a tape read only after it was written, through a
// long sequence, with peaked attention (large tape) and a nearly uniform one (small tape).
TEST(E29aCpu, GradientsMatchFiniteDifferencesOverLongSequences) {
  const SingleThread single;
  std::mt19937_64 rng(test::fresh_seed());
  for (const float tape_scale : {0.05f, 4.0f}) {
    const e29a::LayerShape shape{3, 33, 6, 4};
    auto p = random_params(rng, shape.dim, shape.slots, tape_scale);
    auto u = optest::random_doubles(rng, shape.batch * shape.steps * shape.dim);
    const auto weights = optest::random_doubles(rng, u.size());
    std::vector<double> y(u.size());
    auto loss = [&] {
      e29a::layer_forward_cpu<double>(shape, p.view(), u, y, nullptr);
      return optest::weighted_sum(y, weights);
    };
    e29a::LayerActivations<double> acts;
    e29a::layer_forward_cpu<double>(shape, p.view(), u, y, &acts);
    auto g = Params<double>::zeros(shape.dim, shape.slots);
    std::vector<double> du(u.size());
    e29a::layer_backward_cpu<double>(p.view(), acts, u, weights, du, g.grads());
    SCOPED_TRACE("tape scale " + std::to_string(tape_scale));
    EXPECT_TRUE(normwise_matches_fd("W_xz", p.w_xz, g.w_xz, loss, 1e-6, 1e-9));
    EXPECT_TRUE(normwise_matches_fd("W_h", p.w_h, g.w_h, loss, 1e-6, 1e-9));
    EXPECT_TRUE(normwise_matches_fd("b_h", p.b_h, g.b_h, loss, 1e-6, 1e-9));
    EXPECT_TRUE(normwise_matches_fd("W_write", p.w_write, g.w_write, loss, 1e-6, 1e-9));
    EXPECT_TRUE(normwise_matches_fd("H_0", p.tape0, g.tape0, loss, 1e-6, 1e-9));
    EXPECT_TRUE(normwise_matches_fd("u", u, du, loss, 1e-6, 1e-9));
  }
}

// Upstream starts from a zero tape. Any tape whose slots are equal stays so forever: the scores of
// every slot are equal, both attentions are exactly 1/N, the tape update treats every slot alike,
// and the score gradients are exactly zero; the gradient of H_0 is the same for every slot, so no
// optimizer can ever separate them. A learned (random) H_0 has none of this.
TEST(E29aCpu, ZeroTapeDegeneracy) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const std::int64_t slots : {2, 8, 5}) {
    for (const bool zero : {true, false}) {
      const e29a::LayerShape shape{3, 9, 7, slots};
      auto p = random_params(rng, shape.dim, slots);
      const auto row = optest::random_doubles(rng, shape.dim);
      for (std::int64_t n = 0; n < slots; ++n) {
        for (std::int64_t d = 0; d < shape.dim; ++d) p.tape0[n * shape.dim + d] = zero ? 0.0 : row[d];
      }
      const auto u = optest::random_doubles(rng, shape.batch * shape.steps * shape.dim);
      const auto dy = optest::random_doubles(rng, u.size());
      std::vector<double> y(u.size()), du(u.size());
      e29a::LayerActivations<double> acts;
      e29a::layer_forward_cpu<double>(shape, p.view(), u, y, &acts);
      auto g = Params<double>::zeros(shape.dim, slots);
      e29a::LayerBackwardTrace<double> scores;
      e29a::layer_backward_cpu<double>(p.view(), acts, u, dy, du, g.grads(), &scores);
      SCOPED_TRACE("N " + std::to_string(slots) + (zero ? " zero tape" : " equal slots"));

      const double uniform = acts.read_attn[0];
      EXPECT_NEAR(uniform, 1.0 / slots, 1e-15);
      for (const double a : acts.read_attn) ASSERT_EQ(a, uniform);
      for (const double a : acts.write_attn) ASSERT_EQ(a, uniform);
      for (const double s : scores.read) ASSERT_EQ(s, 0.0);
      for (const double s : scores.write) ASSERT_EQ(s, 0.0);
      const std::int64_t d_count = shape.dim;
      const std::size_t tape_size = static_cast<std::size_t>(slots * d_count);
      for (std::size_t i = 0; i < acts.tape.size(); ++i) {
        const std::size_t slot0 = i / tape_size * tape_size + i % static_cast<std::size_t>(d_count);
        ASSERT_EQ(acts.tape[i], acts.tape[slot0]) << "slots of a tape differ at " << i;
      }
      for (std::int64_t n = 1; n < slots; ++n) {
        for (std::int64_t d = 0; d < d_count; ++d) ASSERT_EQ(g.tape0[n * d_count + d], g.tape0[d]);
      }
    }
  }
  // A random tape: attention far from uniform, score gradients non-zero, slot gradients differ.
  const e29a::LayerShape shape{2, 5, 6, 4};
  auto p = random_params(rng, shape.dim, shape.slots);
  const auto u = optest::random_doubles(rng, shape.batch * shape.steps * shape.dim);
  std::vector<double> y(u.size()), du(u.size());
  e29a::LayerActivations<double> acts;
  e29a::layer_forward_cpu<double>(shape, p.view(), u, y, &acts);
  auto g = Params<double>::zeros(shape.dim, shape.slots);
  e29a::LayerBackwardTrace<double> scores;
  e29a::layer_backward_cpu<double>(p.view(), acts, u, u, du, g.grads(), &scores);
  double max_dev = 0.0, max_score = 0.0;
  for (const double a : acts.read_attn) max_dev = std::max(max_dev, std::fabs(a - 0.25));
  for (const double s : scores.write) max_score = std::max(max_score, std::fabs(s));
  EXPECT_GT(max_dev, 0.05);
  EXPECT_GT(max_score, 1e-3);
  EXPECT_NE(g.tape0[0], g.tape0[shape.dim]);
}

// A second, independent forward of the layer's equations (one sequence at a time, plain loops)
// whose attentions can be frozen at given values and whose state can be restarted at every step
// from a given trajectory: the functions the backward's options differentiate. Returns
// sum_t <y_t, dy_t> over the batch.
struct FrozenForward {
  const e29a::LayerShape& shape;
  const std::vector<double>* read_attn = nullptr;           // [steps, batch, N]: frozen a_r, or computed
  const std::vector<double>* write_attn = nullptr;          // frozen a_w, or computed
  const e29a::LayerActivations<double>* restart = nullptr;  // every step starts from this h_{t-1}, H_{t-1}

  double loss(const Params<double>& p, const std::vector<double>& u, const std::vector<double>& dy) const {
    const std::int64_t B = shape.batch, T = shape.steps, D = shape.dim, N = shape.slots;
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    auto softmax = [&](const std::vector<double>& H, const std::vector<double>& v) {
      std::vector<double> a(static_cast<std::size_t>(N));
      double m = -1e300, sum = 0.0;
      for (std::int64_t n = 0; n < N; ++n) {
        double dot = 0.0;
        for (std::int64_t d = 0; d < D; ++d) dot += H[n * D + d] * v[d];
        a[n] = scale * dot;
        m = std::max(m, a[n]);
      }
      for (auto& x : a) sum += (x = std::exp(x - m));
      for (auto& x : a) x /= sum;
      return a;
    };
    double total = 0.0;
    for (std::int64_t b = 0; b < B; ++b) {
      std::vector<double> h(static_cast<std::size_t>(D), 0.0), H(p.tape0);
      for (std::int64_t t = 0; t < T; ++t) {
        if (restart != nullptr && t > 0) {
          for (std::int64_t d = 0; d < D; ++d) h[d] = restart->h[(t * B + b) * D + d];
          for (std::int64_t i = 0; i < N * D; ++i) H[i] = restart->tape[(t * B + b) * N * D + i];
        }
        const double* ut = u.data() + (b * T + t) * D;
        std::vector<double> x(static_cast<std::size_t>(D)), z(x.size()), r(x.size(), 0.0), w(x.size());
        for (std::int64_t o = 0; o < 2 * D; ++o) {
          double acc = 0.0;
          for (std::int64_t i = 0; i < D; ++i) acc += p.w_xz[o * D + i] * ut[i];
          (o < D ? x[o] : z[o - D]) = acc;
        }
        std::vector<double> ar = softmax(H, h);
        if (read_attn != nullptr)
          ar.assign(read_attn->begin() + (t * B + b) * N, read_attn->begin() + (t * B + b + 1) * N);
        for (std::int64_t n = 0; n < N; ++n) {
          for (std::int64_t d = 0; d < D; ++d) r[d] += ar[n] * H[n * D + d];
        }
        std::vector<double> hn(x.size());
        for (std::int64_t o = 0; o < D; ++o) {
          double acc = x[o] + r[o] + p.b_h[o];
          for (std::int64_t i = 0; i < D; ++i) acc += p.w_h[o * D + i] * h[i];
          hn[o] = std::tanh(acc);
        }
        h = hn;
        for (std::int64_t o = 0; o < D; ++o) {
          double acc = 0.0;
          for (std::int64_t i = 0; i < D; ++i) acc += p.w_write[o * D + i] * h[i];
          w[o] = acc;
        }
        std::vector<double> aw = softmax(H, w);
        if (write_attn != nullptr)
          aw.assign(write_attn->begin() + (t * B + b) * N, write_attn->begin() + (t * B + b + 1) * N);
        for (std::int64_t n = 0; n < N; ++n) {
          for (std::int64_t d = 0; d < D; ++d) H[n * D + d] = (1.0 - aw[n]) * H[n * D + d] + aw[n] * w[d];
        }
        for (std::int64_t d = 0; d < D; ++d) {
          const double g = z[d] + r[d] + h[d];
          total += h[d] * (g / (1.0 + std::exp(-g))) * dy[(b * T + t) * D + d];
        }
      }
    }
    return total;
  }
};

// Detached scores: the gradient of the same function with that attention frozen at the values of
// the forward (finite differences through the independent forward above, attentions held).
TEST(E29aCpu, DetachedScoresGiveTheGradientWithFrozenAttention) {
  SingleThread single;
  std::mt19937_64 rng(test::fresh_seed());
  const e29a::LayerShape shape{2, 5, 6, 3};
  for (int variant = 0; variant < 3; ++variant) {
    e29a::LayerBackwardOptions options;
    options.detach_read_scores = variant != 1;
    options.detach_write_scores = variant != 0;
    SCOPED_TRACE(variant == 0 ? "read" : variant == 1 ? "write" : "both");
    auto p = random_params(rng, shape.dim, shape.slots);
    const auto u = optest::random_doubles(rng, shape.batch * shape.steps * shape.dim);
    const auto dy = optest::random_doubles(rng, u.size());
    std::vector<double> y(u.size()), du(u.size());
    e29a::LayerActivations<double> acts;
    e29a::layer_forward_cpu<double>(shape, p.view(), u, y, &acts);
    auto g = Params<double>::zeros(shape.dim, shape.slots), exact = g;
    e29a::LayerBackwardTrace<double> trace;
    e29a::layer_backward_cpu<double>(p.view(), acts, u, dy, du, g.grads(), &trace, options);
    e29a::layer_backward_cpu<double>(p.view(), acts, u, dy, du, exact.grads());
    FrozenForward f{shape};
    if (options.detach_read_scores) f.read_attn = &acts.read_attn;
    if (options.detach_write_scores) f.write_attn = &acts.write_attn;
    const auto loss = [&] { return f.loss(p, u, dy); };
    EXPECT_NEAR(loss(), std::inner_product(y.begin(), y.end(), dy.begin(), 0.0), 1e-9);
    EXPECT_TRUE(normwise_matches_fd("dW_h", p.w_h, g.w_h, loss, 1e-7, 1e-12));
    EXPECT_TRUE(normwise_matches_fd("dW_write", p.w_write, g.w_write, loss, 1e-7, 1e-12));
    EXPECT_TRUE(normwise_matches_fd("dH_0", p.tape0, g.tape0, loss, 1e-7, 1e-12));
    EXPECT_TRUE(normwise_matches_fd("db_h", p.b_h, g.b_h, loss, 1e-7, 1e-12));
    // What was dropped was not nothing: the exact gradient differs, the detached scores are zero.
    double diff = 0.0;
    for (std::size_t i = 0; i < g.w_h.size(); ++i) diff = std::max(diff, std::fabs(g.w_h[i] - exact.w_h[i]));
    EXPECT_GT(diff, 1e-6);
    if (options.detach_read_scores) {
      for (const double v : trace.read) ASSERT_EQ(v, 0.0);
    }
    if (options.detach_write_scores) {
      for (const double v : trace.write) ASSERT_EQ(v, 0.0);
    }
  }
}

// The carried gradient's bound: above every carried norm it changes nothing (bit for bit); near
// zero nothing is carried, and the gradient is that of sum_t <y_t, dy_t> with every step started
// from the forward's own h_{t-1} and H_{t-1} held fixed; the trace shows the bound acting.
TEST(E29aCpu, CarryClipBoundsWhatCrossesSteps) {
  SingleThread single;
  std::mt19937_64 rng(test::fresh_seed());
  const e29a::LayerShape shape{2, 6, 5, 3};
  auto p = random_params(rng, shape.dim, shape.slots);
  const auto u = optest::random_doubles(rng, shape.batch * shape.steps * shape.dim);
  const auto dy = optest::random_doubles(rng, u.size());
  std::vector<double> y(u.size()), du(u.size()), du_loose(u.size());
  e29a::LayerActivations<double> acts;
  e29a::layer_forward_cpu<double>(shape, p.view(), u, y, &acts);
  auto exact = Params<double>::zeros(shape.dim, shape.slots), loose = exact, cut = exact;
  e29a::layer_backward_cpu<double>(p.view(), acts, u, dy, du, exact.grads());
  e29a::LayerBackwardOptions options;
  options.carry_clip = 1e30;
  e29a::layer_backward_cpu<double>(p.view(), acts, u, dy, du_loose, loose.grads(), nullptr, options);
  EXPECT_EQ(loose.w_h, exact.w_h);
  EXPECT_EQ(loose.tape0, exact.tape0);
  EXPECT_EQ(du_loose, du);

  options.carry_clip = 1e-200;
  e29a::LayerBackwardTrace<double> trace;
  e29a::layer_backward_cpu<double>(p.view(), acts, u, dy, du, cut.grads(), &trace, options);
  FrozenForward f{shape};
  f.restart = &acts;
  // h_{t-1} of step t is acts.h[t]; the tape step t reads is acts.tape[t]: FrozenForward reads both
  // at [t * B + b], which is how they are laid out.
  const auto loss = [&] { return f.loss(p, u, dy); };
  EXPECT_TRUE(normwise_matches_fd("dW_h", p.w_h, cut.w_h, loss, 1e-7, 1e-12));
  EXPECT_TRUE(normwise_matches_fd("dW_write", p.w_write, cut.w_write, loss, 1e-7, 1e-12));
  EXPECT_TRUE(normwise_matches_fd("dW_xz", p.w_xz, cut.w_xz, loss, 1e-7, 1e-12));
  // H_0 only reaches step 0 (every later step restarts from the saved tape, step 0 from H_0).
  EXPECT_TRUE(normwise_matches_fd("dH_0", p.tape0, cut.tape0, loss, 1e-7, 1e-12));
  double diff = 0.0;
  for (std::size_t i = 0; i < cut.w_h.size(); ++i) diff = std::max(diff, std::fabs(cut.w_h[i] - exact.w_h[i]));
  EXPECT_GT(diff, 1e-6);
}

// Running a sequence in two calls, the second starting from the first's end state, gives the
// outputs of one call (the recurrent decoder relies on it).
TEST(E29aCpu, StateCarriesAcrossCalls) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t batch = 2, dim = 9, slots = 3, first = 4, second = 5;
  const auto p32 = random_params(rng, dim, slots);
  const auto u = optest::random_doubles(rng, batch * (first + second) * dim);
  std::vector<double> y_all(u.size());
  e29a::layer_forward_cpu<double>({batch, first + second, dim, slots}, p32.view(), u, y_all, nullptr);

  auto slice = [&](const std::vector<double>& v, std::int64_t t0, std::int64_t steps) {
    std::vector<double> out;
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto begin = v.begin() + (b * (first + second) + t0) * dim;
      out.insert(out.end(), begin, begin + steps * dim);
    }
    return out;
  };
  const auto u1 = slice(u, 0, first), u2 = slice(u, first, second);
  std::vector<double> y1(u1.size()), y2(u2.size());
  e29a::LayerState<double> state;
  e29a::layer_forward_cpu<double>({batch, first, dim, slots}, p32.view(), u1, y1, nullptr, nullptr, &state);
  e29a::LayerState<double> after;
  e29a::layer_forward_cpu<double>({batch, second, dim, slots}, p32.view(), u2, y2, nullptr, &state, &after);
  EXPECT_EQ(y1, slice(y_all, 0, first));
  EXPECT_EQ(y2, slice(y_all, first, second));
  EXPECT_EQ(after.h.size(), static_cast<std::size_t>(batch * dim));
  EXPECT_EQ(after.tape.size(), static_cast<std::size_t>(batch * slots * dim));
}

// fp32 storage against the fp64 run on the same inputs, and gradients added to what is there.
// A soft tape (scale 0.5): with sharp attention (tape scale 1.5) one draw in four amplified fp32
// rounding past these element-wise bounds (normwise errors up to 3e-4 in 1,800 draws, against
// 8e-7 at most in 800 draws of the soft tape). Sharp attention is covered in fp64 by the
// finite-difference tests, and against fp32 rounding by the GPU tests' per-draw bound.
TEST(E29aCpu, FloatMatchesDoubleAndAccumulates) {
  std::mt19937_64 rng(test::fresh_seed());
  const e29a::LayerShape shape{3, 40, 32, 8};
  const auto pd = random_params(rng, shape.dim, shape.slots, 0.5f);
  Params<float> pf{optest::narrow(pd.w_xz), optest::narrow(pd.w_h), optest::narrow(pd.b_h), optest::narrow(pd.w_write),
                   optest::narrow(pd.tape0)};
  const Params<double> pw{optest::widen(pf.w_xz), optest::widen(pf.w_h), optest::widen(pf.b_h),
                          optest::widen(pf.w_write), optest::widen(pf.tape0)};
  const auto uf = test::random_normal(rng, shape.batch * shape.steps * shape.dim);
  const auto dyf = test::random_normal(rng, uf.size());
  const auto ud = optest::widen(uf), dyd = optest::widen(dyf);

  std::vector<float> yf(uf.size()), duf(uf.size());
  e29a::LayerActivations<float> af;
  e29a::layer_forward_cpu<float>(shape, pf.view(), uf, yf, &af);
  auto gf = Params<float>::zeros(shape.dim, shape.slots);
  const auto initial = test::random_normal(rng, gf.w_h.size());
  gf.w_h = initial;
  e29a::layer_backward_cpu<float>(pf.view(), af, uf, dyf, duf, gf.grads());

  std::vector<double> yd(ud.size()), dud(ud.size());
  e29a::LayerActivations<double> ad;
  e29a::layer_forward_cpu<double>(shape, pw.view(), ud, yd, &ad);
  auto gd = Params<double>::zeros(shape.dim, shape.slots);
  e29a::layer_backward_cpu<double>(pw.view(), ad, ud, dyd, dud, gd.grads());
  for (std::size_t i = 0; i < initial.size(); ++i) gd.w_h[i] += initial[i];

  EXPECT_TRUE(test::all_close(yf, optest::narrow(yd), 1e-5, 1e-6));
  EXPECT_TRUE(test::all_close(duf, optest::narrow(dud), 1e-4, 1e-5));
  EXPECT_TRUE(test::all_close(gf.w_xz, optest::narrow(gd.w_xz), 1e-4, 1e-4));
  EXPECT_TRUE(test::all_close(gf.w_h, optest::narrow(gd.w_h), 1e-4, 1e-4));
  EXPECT_TRUE(test::all_close(gf.b_h, optest::narrow(gd.b_h), 1e-4, 1e-4));
  EXPECT_TRUE(test::all_close(gf.w_write, optest::narrow(gd.w_write), 1e-4, 1e-4));
  EXPECT_TRUE(test::all_close(gf.tape0, optest::narrow(gd.tape0), 1e-4, 1e-4));
}

TEST(E29aCpu, ResultsDoNotDependOnThreadCount) {
  std::mt19937_64 rng(test::fresh_seed());
  const e29a::LayerShape shape{5, 17, 20, 8};
  const auto pd = random_params(rng, shape.dim, shape.slots);
  const Params<float> p{optest::narrow(pd.w_xz), optest::narrow(pd.w_h), optest::narrow(pd.b_h),
                        optest::narrow(pd.w_write), optest::narrow(pd.tape0)};
  const auto u = test::random_normal(rng, shape.batch * shape.steps * shape.dim);
  const auto dy = test::random_normal(rng, u.size());
  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> y(u.size()), du(u.size());
    e29a::LayerActivations<float> acts;
    e29a::layer_forward_cpu<float>(shape, p.view(), u, y, &acts);
    auto g = Params<float>::zeros(shape.dim, shape.slots);
    e29a::layer_backward_cpu<float>(p.view(), acts, u, dy, du, g.grads());
    omp_set_num_threads(saved);
    return std::vector<std::vector<float>>{y, du, g.w_xz, g.w_h, g.b_h, g.w_write, g.tape0};
  };
  EXPECT_EQ(run(1), run(3));
}

// The fixture (tests/fixtures/e29a/layer.json, made by tests/fixtures/make_e29a_fixture.py with
// PyTorch autograd of the same equations, in fp64): the fp32 reference matches within 1e-5
// normwise for the output and every gradient.
TEST(E29aCpu, MatchesPyTorchAutogradFixture) {
  const std::string path = std::string(LLMTRAIN_FIXTURES_DIR) + "/e29a/layer.json";
  std::ifstream file(path);
  ASSERT_TRUE(file) << "missing fixture " << path << " (run tests/fixtures/make_e29a_fixture.py)";
  const auto fixture = nlohmann::json::parse(file);
  ASSERT_FALSE(fixture["cases"].empty());
  auto norm_error = [](const std::vector<float>& actual, const std::vector<double>& expected) {
    double diff = 0.0, ref = 0.0;
    for (std::size_t i = 0; i < expected.size(); ++i) {
      diff += (actual[i] - expected[i]) * (actual[i] - expected[i]);
      ref += expected[i] * expected[i];
    }
    return ref == 0.0 ? std::sqrt(diff) : std::sqrt(diff / ref);
  };
  for (const auto& c : fixture["cases"]) {
    const e29a::LayerShape shape{c["batch"], c["steps"], c["dim"], c["slots"]};
    SCOPED_TRACE(c["name"].get<std::string>());
    auto floats = [&](const char* key) { return c[key].get<std::vector<float>>(); };
    auto doubles = [&](const char* key) { return c[key].get<std::vector<double>>(); };
    const Params<float> p{floats("W_xz"), floats("W_h"), floats("b_h"), floats("W_write"), floats("H_0")};
    const auto u = floats("u"), dy = floats("dy");
    ASSERT_EQ(u.size(), static_cast<std::size_t>(shape.batch * shape.steps * shape.dim));
    std::vector<float> y(u.size()), du(u.size());
    e29a::LayerActivations<float> acts;
    e29a::layer_forward_cpu<float>(shape, p.view(), u, y, &acts);
    auto g = Params<float>::zeros(shape.dim, shape.slots);
    e29a::layer_backward_cpu<float>(p.view(), acts, u, dy, du, g.grads());
    constexpr double kTolerance = 1e-5;
    EXPECT_LE(norm_error(y, doubles("y")), kTolerance) << "y";
    EXPECT_LE(norm_error(du, doubles("grad_u")), kTolerance) << "du";
    EXPECT_LE(norm_error(g.w_xz, doubles("grad_W_xz")), kTolerance) << "W_xz";
    EXPECT_LE(norm_error(g.w_h, doubles("grad_W_h")), kTolerance) << "W_h";
    EXPECT_LE(norm_error(g.b_h, doubles("grad_b_h")), kTolerance) << "b_h";
    EXPECT_LE(norm_error(g.w_write, doubles("grad_W_write")), kTolerance) << "W_write";
    EXPECT_LE(norm_error(g.tape0, doubles("grad_H_0")), kTolerance) << "H_0";
  }
}

TEST(E29aCpu, RejectsWrongSizes) {
  const e29a::LayerShape shape{2, 3, 4, 2};
  auto p = Params<float>::zeros(4, 2);
  std::vector<float> u(24), y(24), du(24);
  EXPECT_OP_ERROR(e29a::layer_forward_cpu<float>(shape, p.view(), std::span<const float>(u.data(), 20), y, nullptr),
                  "e29a_layer_forward: u has 20 elements, expected 24");
  auto bad = p;
  bad.tape0.resize(7);
  EXPECT_OP_ERROR(e29a::layer_forward_cpu<float>(shape, bad.view(), u, y, nullptr), "tape0 has 7 elements");
  EXPECT_OP_ERROR(e29a::layer_forward_cpu<float>({2, 3, 4, 0}, p.view(), u, y, nullptr), "slots must be positive");
  e29a::LayerActivations<float> acts;
  e29a::layer_forward_cpu<float>(shape, p.view(), u, y, nullptr);
  acts.shape = shape;
  auto g = Params<float>::zeros(4, 2);
  EXPECT_OP_ERROR(e29a::layer_backward_cpu<float>(p.view(), acts, u, y, du, g.grads()), "were not saved");
}

}  // namespace
