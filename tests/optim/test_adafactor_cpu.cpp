// Adafactor's CPU reference: torch.optim.Adafactor and Hugging Face Adafactor golden values
// (tests/fixtures/adafactor_golden.json), simulated ZeRO shards whose combined partial
// statistics reproduce the unsharded step, both non-finite policies, odd shapes, and ZeRO-2
// gradients over the owned shard only stepping exactly like gradients over the whole slab.
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "optim/adafactor.h"
#include "optim/adafactor_support.h"
#include "optim/sharded_grads_support.h"
#include "trainer/optimizer_yaml.h"
#include "support/test_support.h"

namespace {

using nlohmann::json;
using optim::OptimizerConfig;
using optim::ParamSpec;
using test::adafactor_config;
using test::factor_2d;

float max_abs(const std::vector<float>& x) {
  float m = 0;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}

TEST(AdafactorGolden, MatchesTorchAndHuggingFaceSemantics) {
  const std::string path = std::string(LLMTRAIN_FIXTURES_DIR) + "/adafactor_golden.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "missing fixture " << path << " (made by tests/fixtures/make_adafactor_golden.py)";
  const json golden = json::parse(in);
  ASSERT_GE(golden["cases"].size(), 4u);
  for (const auto& c : golden["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE("case " + name);
    // The optimizer settings are a JSON object, which is YAML: read them through the config parser.
    const OptimizerConfig config = trainer::optimizer_config_from_yaml(YAML::Load(c["optimizer"].dump()), name);
    std::vector<ParamSpec> specs;
    for (const auto& p : c["params"]) {
      specs.push_back({.name = p["name"], .shape = p["shape"].get<core::Shape>(), .decay = p["decay"].get<bool>()});
    }
    specs = factor_2d(specs);
    core::DeviceContext cpu(core::Device::cpu());
    optim::Slab slab(optim::SlabLayout(specs, 1), cpu);
    optim::Adafactor opt(config, slab, cpu);
    for (std::size_t t = 0; t < specs.size(); ++t) {
      const auto init = c["params"][t]["init"].get<std::vector<float>>();
      std::copy(init.begin(), init.end(), slab.master_view(static_cast<int>(t)).as<float>());
    }
    int step = 0;
    for (const auto& s : c["steps"]) {
      ++step;
      for (std::size_t t = 0; t < specs.size(); ++t) {
        const auto g = s["grads"][t].get<std::vector<float>>();
        std::copy(g.begin(), g.end(), slab.grad_view(static_cast<int>(t)).as<float>());
      }
      opt.step(config.lr);
      for (std::size_t t = 0; t < specs.size(); ++t) {
        const auto view = slab.master_view(static_cast<int>(t));
        const std::vector<float> ours(view.as<float>(), view.as<float>() + view.numel());
        const auto ref = s["params"][t].get<std::vector<float>>();
        // Different fp32 operation order (rsqrt products, addcdiv): a few roundings.
        EXPECT_TRUE(test::all_close(ours, ref, 2e-6, 1e-6 * max_abs(ref)))
            << "step " << step << ", tensor " << specs[t].name;
      }
    }
    EXPECT_EQ(step, 6);
  }
}

TEST(AdafactorCpu, ShardedPartialsReproduceTheUnshardedStep) {
  test::check_shards_match_unsharded(core::Device::cpu());
}

TEST(AdafactorCpu, SkipStepAndZeroElement) {
  const std::vector<ParamSpec> specs = {{.name = "m", .shape = {5, 6}, .factored = true}, {.name = "b", .shape = {6}}};
  for (auto policy : {optim::NonFinitePolicy::skip_step, optim::NonFinitePolicy::zero_element}) {
    core::DeviceContext cpu(core::Device::cpu());
    optim::Slab slab(optim::SlabLayout(specs, 1), cpu);
    optim::Adafactor opt(adafactor_config(policy), slab, cpu);
    std::mt19937_64 rng(test::fresh_seed());
    const auto w0 = test::random_normal(rng, 30);
    std::copy(w0.begin(), w0.end(), slab.master_view(0).as<float>());
    auto g = test::random_normal(rng, 30);
    g[7] = NAN;
    std::copy(g.begin(), g.end(), slab.grad_view(0).as<float>());
    opt.step(1e-2);
    const auto report = opt.report();
    EXPECT_EQ(report.nonfinite, 1u);
    const float* w = slab.master_view(0).as<float>();
    for (int i = 0; i < 30; ++i) EXPECT_EQ(slab.grad_view(0).as<float>()[i], 0.0f);
    if (policy == optim::NonFinitePolicy::skip_step) {
      EXPECT_TRUE(report.skipped);
      EXPECT_EQ(report.step, 0);
      for (int i = 0; i < 30; ++i) EXPECT_EQ(w[i], w0[static_cast<std::size_t>(i)]);
      for (float x : test::to_host<float>(opt.row_col_state())) EXPECT_EQ(x, 0.0f);
    } else {
      EXPECT_FALSE(report.skipped);
      EXPECT_EQ(report.step, 1);
      for (int i = 0; i < 30; ++i) EXPECT_TRUE(std::isfinite(w[i])) << i;
      EXPECT_NE(w[0], w0[0]);
    }
  }
}

TEST(AdafactorCpu, OddShapes) {
  const std::vector<ParamSpec> specs = {{.name = "empty", .shape = {0}},
                                        {.name = "one", .shape = {1}},
                                        {.name = "row", .shape = {1, 300}, .factored = true},
                                        {.name = "col", .shape = {300, 1}, .factored = true},
                                        {.name = "empty2d", .shape = {0, 4}, .factored = true},
                                        {.name = "tall", .shape = {130, 3}, .factored = true}};
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(optim::SlabLayout(specs, 1), cpu);
  optim::Adafactor opt(adafactor_config(), slab, cpu);
  std::mt19937_64 rng(test::fresh_seed());
  test::from_host(slab.master(), test::random_normal(rng, slab.master().bytes() / 4));
  for (int step = 0; step < 3; ++step) {
    test::from_host(slab.grad(), test::random_grads(rng, slab.layout(), 0.5f));
    opt.step(1e-2);
  }
  EXPECT_EQ(opt.report().step, 3);
  for (float x : test::to_host<float>(slab.master())) ASSERT_TRUE(std::isfinite(x));
  EXPECT_EQ(opt.plan().factored_tensors, 4);
}

TEST(AdafactorCpu, ShardedGradientsMatchFullGradients) {
  for (bool beta1 : {true, false}) {
    OptimizerConfig config = adafactor_config();  // clips at 1.0
    if (!beta1) config.adafactor.beta1.reset();
    for (int world : {3, 2}) test::check_sharded_gradients_match_full(core::Device::cpu(), config, world, 1);
  }
}

}  // namespace
