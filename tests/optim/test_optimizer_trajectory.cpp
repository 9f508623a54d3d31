// Ten steps of training a Hugging Face Qwen3 fixture on one fixed window, our cpu model and
// optimizers against torch.optim.AdamW and torch.optim.Adafactor on the transformers model
// (tests/fixtures/make_optimizer_trajectory.py, an fp64 oracle), and against torch.optim.Muon for
// the hidden matrices with AdamW for the rest (tests/fixtures/make_muon_trajectory.py, the same
// oracle with Newton-Schulz in fp64; skipped while that fixture is absent): the weights after the
// last step agree within 1e-5 normwise for every logical tensor (q, k, v, gate and up each on its
// own: Adafactor's statistics and Muon's orthogonalisation are per tensor, so a fused q/k/v would
// differ by about 1e-3).
#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "models/hf_folder.h"
#include "models/model_config.h"
#include "optim/optimizer.h"
#include "optim/optimizer_config.h"
#include "trainer/optimizer_yaml.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kFixtures = LLMTRAIN_FIXTURES_DIR;

// The expected weights as a folder load_hf_weights reads: the fixture's config.json and the
// trajectory's safetensors.
fs::path expected_folder(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("llmtrain_trajectory_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(kFixtures / "qwen3/untied/config.json", dir / "config.json");
  fs::copy_file(kFixtures / "qwen3/trajectory" / (name + ".safetensors"), dir / "model.safetensors");
  return dir;
}

void check_case(const std::string& name, const std::string& record_file = "trajectory.json") {
  std::ifstream in(kFixtures / "qwen3/trajectory" / record_file);
  ASSERT_TRUE(in) << "missing fixture (made by tests/fixtures/make_optimizer_trajectory.py)";
  const json record = json::parse(in);
  const json& c = record.at("cases").at(name);
  const optim::OptimizerConfig config = trainer::optimizer_config_from_yaml(YAML::Load(c.at("optimizer").dump()), name);

  const models::HfConfig read = models::read_hf_config(kFixtures / "qwen3/untied");
  const auto spec = read.family->spec(read.shape);
  const optim::SlabLayout layout(spec->parameters(), 1);
  ASSERT_TRUE(layout.unsplit().empty());
  ASSERT_GT(layout.parameters().size(), layout.tensors().size());
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(layout, cpu);
  models::load_hf_weights(kFixtures / "qwen3/untied", *spec, slab);
  auto optimizer = optim::make_optimizer(config, slab, cpu);

  const std::int64_t batch = record.at("batch"), seq = record.at("seq");
  std::vector<std::int32_t> ids, targets;
  for (const json& row : record.at("window")) {
    const auto tokens = row.get<std::vector<std::int32_t>>();
    ASSERT_EQ(static_cast<std::int64_t>(tokens.size()), seq + 1);
    ids.insert(ids.end(), tokens.begin(), tokens.end() - 1);
    targets.insert(targets.end(), tokens.begin() + 1, tokens.end());
  }
  auto model = spec->trainable(slab, cpu, {.max_tokens = batch * seq});
  const auto losses = c.at("losses").get<std::vector<double>>();
  for (int step = 0; step < record.at("steps").get<int>(); ++step) {
    model->forward_backward(ids.data(), targets.data(), batch, seq, 1.0f);
    EXPECT_NEAR(*model->loss(), losses[static_cast<std::size_t>(step)], 1e-4 * losses[0]) << "step " << step;
    optimizer->step(config.lr);
  }

  optim::Slab expected(layout, cpu);
  const fs::path folder = expected_folder(name);
  models::load_hf_weights(folder, *spec, expected);
  fs::remove_all(folder);
  const float* ours = static_cast<const float*>(slab.master().data());
  const float* torch = static_cast<const float*>(expected.master().data());
  for (const optim::SlabTensor& t : layout.parameters()) {
    double diff = 0, norm = 0;
    for (std::int64_t i = t.offset; i < t.offset + t.numel; ++i) {
      diff += (static_cast<double>(ours[i]) - torch[i]) * (static_cast<double>(ours[i]) - torch[i]);
      norm += static_cast<double>(torch[i]) * torch[i];
    }
    EXPECT_LE(std::sqrt(diff / norm), 1e-5) << name << ": " << t.spec.name;
  }
}

TEST(OptimizerTrajectory, AdamWMatchesTorchOnTheTransformersModel) { check_case("adamw"); }
TEST(OptimizerTrajectory, AdafactorMatchesTorchOnTheTransformersModel) { check_case("adafactor"); }

// The Muon fixture is generated where torch is installed (make_muon_trajectory.py).
void check_muon_case(const std::string& name) {
  const std::string record = "muon_trajectory.json";
  if (!fs::exists(kFixtures / "qwen3/trajectory" / record)) {
    GTEST_SKIP() << "tests/fixtures/qwen3/trajectory/" << record
                 << " is absent: make it with python3 tests/fixtures/make_muon_trajectory.py (torch, transformers)";
  }
  check_case(name, record);
}

TEST(OptimizerTrajectory, MuonMatchesTorchOnTheTransformersModel) { check_muon_case("muon"); }
TEST(OptimizerTrajectory, MuonMoonlightAdjustmentMatchesTorch) { check_muon_case("muon_moonlight"); }

}  // namespace
