// AdamW on the cpu backend against formulas worked out independently in double precision:
// bias correction at step 1, clipping, per-segment decay and lr scale, both non-finite
// policies, empty and one-element tensors, grad zeroing and the mirror; ZeRO-2 gradients over
// the owned shard only step exactly like gradients over the whole slab.
#include <cmath>

#include <gtest/gtest.h>

#include "core/half.h"
#include "optim/adamw.h"
#include "optim/sharded_grads_support.h"
#include "support/test_support.h"

namespace {

using optim::NonFinitePolicy;
using optim::OptimizerConfig;
using optim::ParamSpec;

struct CpuRun {
  core::DeviceContext context{core::Device::cpu()};
  optim::Slab slab;
  optim::AdamW adamw;

  CpuRun(const std::vector<ParamSpec>& specs, const OptimizerConfig& config)
      : slab(optim::SlabLayout(specs, 1), context), adamw(config, slab, context) {}

  float* master(int t) { return slab.master_view(t).as<float>(); }
  float* grad(int t) { return slab.grad_view(t).as<float>(); }
  float* m(int t) { return adamw.exp_avg().as<float>() + slab.layout().tensors()[static_cast<std::size_t>(t)].offset; }
  float* v(int t) {
    return adamw.exp_avg_sq().as<float>() + slab.layout().tensors()[static_cast<std::size_t>(t)].offset;
  }
};

OptimizerConfig config(double wd = 0.1, double clip = 0.0, NonFinitePolicy policy = NonFinitePolicy::skip_step) {
  OptimizerConfig c;
  c.lr = 1e-2;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.eps = 1e-8;
  c.weight_decay = wd;
  c.grad_clip = clip;
  c.nonfinite = policy;
  return c;
}

// One AdamW step from m = v = 0 at step t = 1, in double: m_hat = g, v_hat = g^2.
double first_step(double w, double g, double lr, double wd, double eps) {
  return w * (1 - lr * wd) - lr * g / (std::fabs(g) + eps);
}

TEST(AdamWCpu, BiasCorrectionAtStepOne) {
  const auto c = config();
  CpuRun run({{.name = "w", .shape = {5, 7}}}, c);
  std::mt19937_64 rng(test::fresh_seed());
  const auto w0 = test::random_normal(rng, 35);
  const auto g = test::random_normal(rng, 35, 1e-3f);
  std::copy(w0.begin(), w0.end(), run.master(0));
  std::copy(g.begin(), g.end(), run.grad(0));
  run.adamw.step(c.lr);
  for (int i = 0; i < 35; ++i) {
    const double expected =
        first_step(w0[static_cast<std::size_t>(i)], g[static_cast<std::size_t>(i)], c.lr, c.weight_decay, c.eps);
    EXPECT_NEAR(run.master(0)[i], expected, 1e-6 * std::fabs(expected) + 1e-9) << i;
    EXPECT_NEAR(run.m(0)[i], (1 - c.beta1) * g[static_cast<std::size_t>(i)],
                1e-6 * std::fabs(g[static_cast<std::size_t>(i)]));
    EXPECT_EQ(run.grad(0)[i], 0.0f) << "gradient not zeroed";
  }
  const auto report = run.adamw.report();
  EXPECT_EQ(report.step, 1);
  EXPECT_FALSE(report.skipped);
}

TEST(AdamWCpu, MultiStepMatchesDoublePrecisionFormula) {
  std::mt19937_64 rng(test::fresh_seed());
  const auto c = config(0.05, 0.0);
  const std::vector<ParamSpec> specs = {{.name = "a", .shape = {13, 11}},
                                        {.name = "b", .shape = {1}, .decay = false},
                                        {.name = "c", .shape = {70}, .lr_scale = 0.5f}};
  CpuRun run(specs, c);
  std::vector<std::vector<double>> w(3), m(3), v(3);
  for (int t = 0; t < 3; ++t) {
    const auto n = static_cast<std::size_t>(run.slab.layout().tensors()[static_cast<std::size_t>(t)].numel);
    const auto init = test::random_normal(rng, n);
    std::copy(init.begin(), init.end(), run.master(t));
    w[static_cast<std::size_t>(t)].assign(init.begin(), init.end());
    m[static_cast<std::size_t>(t)].assign(n, 0.0);
    v[static_cast<std::size_t>(t)].assign(n, 0.0);
  }
  for (int step = 1; step <= 6; ++step) {
    for (int t = 0; t < 3; ++t) {
      const auto& spec = specs[static_cast<std::size_t>(t)];
      const auto n = w[static_cast<std::size_t>(t)].size();
      const auto g = test::random_normal(rng, n, 0.1f);
      std::copy(g.begin(), g.end(), run.grad(t));
      const double lr = c.lr * spec.lr_scale;
      const double wd = spec.decay ? c.weight_decay : 0.0;
      for (std::size_t i = 0; i < n; ++i) {
        auto& mi = m[static_cast<std::size_t>(t)][i];
        auto& vi = v[static_cast<std::size_t>(t)][i];
        auto& wi = w[static_cast<std::size_t>(t)][i];
        mi = c.beta1 * mi + (1 - c.beta1) * g[i];
        vi = c.beta2 * vi + (1 - c.beta2) * g[i] * g[i];
        const double mhat = mi / (1 - std::pow(c.beta1, step));
        const double vhat = vi / (1 - std::pow(c.beta2, step));
        wi -= lr * (mhat / (std::sqrt(vhat) + c.eps) + wd * wi);
      }
    }
    run.adamw.step(c.lr);
  }
  for (int t = 0; t < 3; ++t) {
    const auto& ref = w[static_cast<std::size_t>(t)];
    const std::vector<float> actual(run.master(t), run.master(t) + ref.size());
    EXPECT_TRUE(test::all_close(actual, std::vector<float>(ref.begin(), ref.end()), 1e-5, 1e-6)) << "tensor " << t;
  }
}

TEST(AdamWCpu, DecayAndLrScalePerSegment) {
  // Zero gradients: the Adam term is 0 / (0 + eps) = 0, so only decoupled decay moves w.
  const auto c = config(0.5);
  CpuRun run({{.name = "decayed", .shape = {9}},
              {.name = "norm", .shape = {9}, .decay = false},
              {.name = "half_lr", .shape = {9}, .lr_scale = 0.5f}},
             c);
  for (int t = 0; t < 3; ++t) std::fill(run.master(t), run.master(t) + 9, 2.0f);
  run.adamw.step(c.lr);
  EXPECT_FLOAT_EQ(run.master(0)[4], 2.0f * static_cast<float>(1 - c.lr * 0.5));
  EXPECT_FLOAT_EQ(run.master(1)[4], 2.0f);
  EXPECT_FLOAT_EQ(run.master(2)[4], 2.0f * static_cast<float>(1 - 0.5 * c.lr * 0.5));
}

TEST(AdamWCpu, ClipsToMaxNorm) {
  const auto c = config(0.0, 1.0);
  CpuRun run({{.name = "a", .shape = {2}}, {.name = "b", .shape = {1}}}, c);
  run.grad(0)[0] = 6.0f;  // global norm sqrt(36 + 64) = 10
  run.grad(0)[1] = 0.0f;
  run.grad(1)[0] = -8.0f;
  run.adamw.step(c.lr);
  const auto report = run.adamw.report();
  EXPECT_DOUBLE_EQ(report.grad_norm, 10.0);
  const double clip = 1.0 / (10.0 + 1e-6);
  EXPECT_NEAR(run.m(0)[0], 0.1 * 6.0 * clip, 1e-7);
  EXPECT_NEAR(run.m(1)[0], 0.1 * -8.0 * clip, 1e-7);
  EXPECT_NEAR(run.v(1)[0], 0.05 * 64.0 * clip * clip, 1e-7);

  // Under the threshold nothing is scaled.
  CpuRun small({{.name = "a", .shape = {1}}}, c);
  small.grad(0)[0] = 0.5f;
  small.adamw.step(c.lr);
  EXPECT_FLOAT_EQ(small.m(0)[0], static_cast<float>(0.1 * 0.5));
}

TEST(AdamWCpu, SkipStepPolicyLeavesWeightsAndStateAndZeroesGrads) {
  const auto c = config(0.1, 1.0, NonFinitePolicy::skip_step);
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<ParamSpec> specs = {{.name = "a", .shape = {33}}, {.name = "b", .shape = {65}}};
  CpuRun run(specs, c);
  CpuRun clean(specs, c);
  const auto w0 = test::random_normal(rng, 33);
  std::copy(w0.begin(), w0.end(), run.master(0));
  std::copy(w0.begin(), w0.end(), clean.master(0));
  auto g = test::random_normal(rng, 33);
  std::copy(g.begin(), g.end(), run.grad(0));
  run.grad(1)[17] = INFINITY;
  run.adamw.step(c.lr);
  auto report = run.adamw.report();
  EXPECT_TRUE(report.skipped);
  EXPECT_EQ(report.nonfinite, 1u);
  EXPECT_EQ(report.step, 0);
  EXPECT_EQ(report.skipped_steps, 1);
  for (int i = 0; i < 33; ++i) {
    EXPECT_EQ(run.master(0)[i], w0[static_cast<std::size_t>(i)]);
    EXPECT_EQ(run.m(0)[i], 0.0f);
    EXPECT_EQ(run.v(0)[i], 0.0f);
    EXPECT_EQ(run.grad(0)[i], 0.0f);
  }
  EXPECT_EQ(run.grad(1)[17], 0.0f);

  // The next finite step is step 1 (bias correction not advanced by the skip): it equals a
  // fresh optimizer's first step.
  std::copy(g.begin(), g.end(), run.grad(0));
  std::copy(g.begin(), g.end(), clean.grad(0));
  run.adamw.step(c.lr);
  clean.adamw.step(c.lr);
  report = run.adamw.report();
  EXPECT_FALSE(report.skipped);
  EXPECT_EQ(report.step, 1);
  for (int i = 0; i < 33; ++i) EXPECT_EQ(run.master(0)[i], clean.master(0)[i]);
}

TEST(AdamWCpu, ZeroElementPolicyCountsNonFiniteAsZero) {
  const auto c = config(0.1, 1.0, NonFinitePolicy::zero_element);
  CpuRun run({{.name = "a", .shape = {4}}}, c);
  const float g[4] = {3.0f, NAN, -4.0f, INFINITY};
  std::copy(g, g + 4, run.grad(0));
  std::fill(run.master(0), run.master(0) + 4, 1.0f);
  run.adamw.step(c.lr);
  const auto report = run.adamw.report();
  EXPECT_FALSE(report.skipped);
  EXPECT_EQ(report.step, 1);
  EXPECT_EQ(report.nonfinite, 2u);
  EXPECT_DOUBLE_EQ(report.grad_norm, 5.0);  // finite elements only
  const double clip = 1.0 / (5.0 + 1e-6);
  EXPECT_NEAR(run.m(0)[0], 0.1 * 3.0 * clip, 1e-7);
  EXPECT_EQ(run.m(0)[1], 0.0f);
  EXPECT_EQ(run.v(0)[3], 0.0f);
  EXPECT_FLOAT_EQ(run.master(0)[1], static_cast<float>(1 - c.lr * c.weight_decay));  // decay only
  for (int i = 0; i < 4; ++i) EXPECT_EQ(run.grad(0)[i], 0.0f);
}

TEST(AdamWCpu, EmptyAndOneElementTensors) {
  const auto c = config(0.1, 0.0);
  CpuRun run({{.name = "empty", .shape = {0}},
              {.name = "one", .shape = {1}},
              {.name = "empty2", .shape = {3, 0}},
              {.name = "scalar", .shape = {}}},
             c);
  run.master(1)[0] = 0.5f;
  run.grad(1)[0] = -0.25f;
  run.master(3)[0] = -1.5f;
  run.grad(3)[0] = 2.0f;
  run.adamw.step(c.lr);
  EXPECT_NEAR(run.master(1)[0], first_step(0.5, -0.25, c.lr, c.weight_decay, c.eps), 1e-7);
  EXPECT_NEAR(run.master(3)[0], first_step(-1.5, 2.0, c.lr, c.weight_decay, c.eps), 1e-7);
  EXPECT_EQ(run.adamw.report().step, 1);

  // A slab with no parameters at all still counts steps.
  CpuRun none({}, c);
  none.adamw.step(c.lr);
  EXPECT_EQ(none.adamw.report().step, 1);
}

TEST(AdamWCpu, MirrorIsRoundedMaster) {
  std::mt19937_64 rng(test::fresh_seed());
  for (core::DType dtype : {core::DType::bf16, core::DType::f16}) {
    core::DeviceContext cpu(core::Device::cpu());
    optim::Slab slab(optim::SlabLayout(test::random_specs(rng, 12), 1), cpu, {.mirror_dtype = dtype});
    optim::AdamW adamw(config(), slab, cpu);
    test::from_host(slab.master(), test::random_normal(rng, slab.master().bytes() / 4));
    test::from_host(slab.grad(), test::random_normal(rng, slab.grad().bytes() / 4));
    adamw.step(1e-3);
    const auto master = test::to_host<float>(slab.master());
    const auto mirror = test::to_host<std::uint16_t>(slab.mirror());
    for (const auto& seg : slab.segments()) {
      for (std::int64_t i = seg.offset; i < seg.offset + seg.length; ++i) {
        const auto k = static_cast<std::size_t>(i);
        ASSERT_EQ(mirror[k],
                  dtype == core::DType::bf16 ? core::float_to_bf16(master[k]) : core::float_to_fp16(master[k]));
      }
    }
  }
}

TEST(AdamWCpu, ShardedGradientsMatchFullGradients) {
  for (int world : {3, 2}) test::check_sharded_gradients_match_full(core::Device::cpu(), config(0.1, 1.0), world, 1);
}

}  // namespace
