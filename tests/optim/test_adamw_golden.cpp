// Our CPU AdamW (with clipping) against torch.optim.AdamW + clip_grad_norm_ golden values
// (tests/fixtures/adamw_golden.json, made by tests/fixtures/make_adamw_golden.py).
// Tolerance: torch orders a few fp32 operations differently (lerp for m, addcdiv), so we allow
// rtol 1e-6 plus an absolute 1e-7 of the tensor's largest value, i.e. a few fp32 roundings.
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "optim/adamw.h"
#include "support/test_support.h"

namespace {

using nlohmann::json;

std::vector<float> floats(const json& j) { return j.get<std::vector<float>>(); }

float max_abs(const std::vector<float>& x) {
  float m = 0;
  for (float v : x) m = std::max(m, std::fabs(v));
  return m;
}

TEST(AdamWGolden, MatchesTorchAdamWWithClipping) {
  const std::string path = std::string(LLMTRAIN_FIXTURES_DIR) + "/adamw_golden.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "missing fixture " << path << " (made by tests/fixtures/make_adamw_golden.py)";
  const json golden = json::parse(in);

  std::vector<optim::ParamSpec> specs;
  for (const auto& p : golden["params"]) {
    specs.push_back({.name = p["name"].get<std::string>(),
                     .shape = p["shape"].get<core::Shape>(),
                     .decay = p["decay"].get<bool>(),
                     .lr_scale = p["lr_scale"].get<float>()});
  }
  optim::OptimizerConfig config;
  config.beta1 = golden["config"]["betas"][0].get<double>();
  config.beta2 = golden["config"]["betas"][1].get<double>();
  config.eps = golden["config"]["eps"].get<double>();
  config.weight_decay = golden["config"]["weight_decay"].get<double>();
  config.grad_clip = golden["config"]["grad_clip"].get<double>();

  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(optim::SlabLayout(specs, 1), cpu);
  optim::AdamW adamw(config, slab, cpu);
  const auto& tensors = slab.layout().tensors();
  for (std::size_t t = 0; t < specs.size(); ++t) {
    const auto init = floats(golden["params"][t]["init"]);
    std::copy(init.begin(), init.end(), slab.master_view(static_cast<int>(t)).as<float>());
  }

  int step = 0;
  for (const auto& s : golden["steps"]) {
    ++step;
    for (std::size_t t = 0; t < specs.size(); ++t) {
      const auto g = floats(s["grads"][t]);
      std::copy(g.begin(), g.end(), slab.grad_view(static_cast<int>(t)).as<float>());
    }
    adamw.step(s["lr"].get<double>());
    const auto report = adamw.report();
    EXPECT_NEAR(report.grad_norm, s["grad_norm"].get<double>(), 1e-6 * s["grad_norm"].get<double>()) << "step " << step;
    for (std::size_t t = 0; t < specs.size(); ++t) {
      const auto n = static_cast<std::size_t>(tensors[t].numel);
      const auto off = static_cast<std::size_t>(tensors[t].offset);
      const float* w = slab.master_view(static_cast<int>(t)).as<float>();
      const std::vector<float> ours_w(w, w + n);
      const std::vector<float> ours_m(adamw.exp_avg().as<float>() + off, adamw.exp_avg().as<float>() + off + n);
      const std::vector<float> ours_v(adamw.exp_avg_sq().as<float>() + off, adamw.exp_avg_sq().as<float>() + off + n);
      const auto ref_w = floats(s["params"][t]);
      const auto ref_m = floats(s["exp_avg"][t]);
      const auto ref_v = floats(s["exp_avg_sq"][t]);
      const std::string where = "step " + std::to_string(step) + ", tensor " + specs[t].name;
      EXPECT_TRUE(test::all_close(ours_w, ref_w, 1e-6, 1e-7 * max_abs(ref_w))) << where << " weights";
      EXPECT_TRUE(test::all_close(ours_m, ref_m, 1e-6, 1e-7 * max_abs(ref_m))) << where << " exp_avg";
      EXPECT_TRUE(test::all_close(ours_v, ref_v, 1e-6, 1e-7 * max_abs(ref_v))) << where << " exp_avg_sq";
    }
  }
  EXPECT_GE(step, 5);
}

}  // namespace
