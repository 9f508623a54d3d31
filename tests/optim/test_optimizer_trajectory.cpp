// Ten steps of training a Hugging Face Qwen3 fixture on one fixed window, our cpu model and
// optimizers against torch.optim.AdamW and torch.optim.Adafactor on the transformers model
// (tests/fixtures/make_optimizer_trajectory.py, an fp64 oracle), and against torch.optim.Muon for
// the hidden matrices with AdamW for the rest (tests/fixtures/make_muon_trajectory.py, the same
// oracle with Newton-Schulz in fp64; skipped while that fixture is absent): the weights after the
// last step agree within 1e-5 normwise for every logical tensor (q, k, v, gate and up each on its
// own: Adafactor's statistics and Muon's orthogonalisation are per tensor, so a fused q/k/v would
// differ by about 1e-3).
//
// The *OnGpu tests (label gpu) run the Muon cases on the bf16 GPU path: the bf16 cuda model and
// the GPU optimizer (Newton-Schulz in bf16 with fp32 accumulation), against the same fp64 oracle,
// within the bf16 bounds stated at check_muon_case_on_gpu.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "core/error.h"
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

// One case of a trajectory record: the optimizer, the model, the window and torch's results.
struct TrajectoryCase {
  optim::OptimizerConfig config;
  std::unique_ptr<models::ModelSpec> spec;
  std::unique_ptr<optim::SlabLayout> layout;
  std::int64_t batch = 0, seq = 0;
  int steps = 0;
  std::vector<std::int32_t> ids, targets;
  std::vector<double> losses;  // torch's, before each step
  std::vector<float> initial;  // the fixture's weights, over the slab
  std::vector<float> torch;    // torch's weights after the last step, over the slab

  TrajectoryCase(const std::string& name, const std::string& record_file) {
    std::ifstream in(kFixtures / "qwen3/trajectory" / record_file);
    if (!in) throw std::runtime_error("missing fixture " + record_file + " (made by tests/fixtures/make_*.py)");
    const json record = json::parse(in);
    const json& c = record.at("cases").at(name);
    config = trainer::optimizer_config_from_yaml(YAML::Load(c.at("optimizer").dump()), name);
    const models::HfConfig read = models::read_hf_config(kFixtures / "qwen3/untied");
    spec = read.family->spec(read.shape);
    layout = std::make_unique<optim::SlabLayout>(spec->parameters(), 1);
    batch = record.at("batch");
    seq = record.at("seq");
    steps = record.at("steps");
    for (const json& row : record.at("window")) {
      const auto tokens = row.get<std::vector<std::int32_t>>();
      if (static_cast<std::int64_t>(tokens.size()) != seq + 1) throw std::runtime_error("window row of wrong length");
      ids.insert(ids.end(), tokens.begin(), tokens.end() - 1);
      targets.insert(targets.end(), tokens.begin() + 1, tokens.end());
    }
    losses = c.at("losses").get<std::vector<double>>();
    initial = weights(kFixtures / "qwen3/untied");
    const fs::path folder = expected_folder(name);
    torch = weights(folder);
    fs::remove_all(folder);
  }

  std::vector<float> weights(const fs::path& folder) const {
    const core::DeviceContext cpu(core::Device::cpu());
    optim::Slab slab(*layout, cpu);
    models::load_hf_weights(folder, *spec, slab);
    return test::to_host<float>(slab.master());
  }
};

// Normwise distance of `ours` from `reference` over tensor t, relative to `scale`'s norm there.
double tensor_error(const std::vector<float>& ours, const std::vector<float>& reference,
                    const std::vector<float>& scale, const optim::SlabTensor& t) {
  double diff = 0, norm = 0;
  for (std::int64_t i = t.offset; i < t.offset + t.numel; ++i) {
    const auto k = static_cast<std::size_t>(i);
    diff += (static_cast<double>(ours[k]) - reference[k]) * (static_cast<double>(ours[k]) - reference[k]);
    norm += static_cast<double>(scale[k]) * scale[k];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

void check_case(const std::string& name, const std::string& record_file = "trajectory.json") {
  const TrajectoryCase c(name, record_file);
  ASSERT_TRUE(c.layout->unsplit().empty());
  ASSERT_GT(c.layout->parameters().size(), c.layout->tensors().size());
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(*c.layout, cpu);
  test::from_host(slab.master(), c.initial);
  auto optimizer = optim::make_optimizer(c.config, slab, cpu);
  auto model = c.spec->trainable(slab, cpu, {.max_tokens = c.batch * c.seq});
  for (int step = 0; step < c.steps; ++step) {
    model->forward_backward(c.ids.data(), c.targets.data(), c.batch, c.seq, 1.0f);
    EXPECT_NEAR(*model->loss(), c.losses[static_cast<std::size_t>(step)], 1e-4 * c.losses[0]) << "step " << step;
    optimizer->step(c.config.lr);
  }
  const auto ours = test::to_host<float>(slab.master());
  for (const optim::SlabTensor& t : c.layout->parameters()) {
    EXPECT_LE(tensor_error(ours, c.torch, c.torch, t), 1e-5) << name << ": " << t.spec.name;
  }
}

TEST(OptimizerTrajectory, AdamWMatchesTorchOnTheTransformersModel) { check_case("adamw"); }
TEST(OptimizerTrajectory, AdafactorMatchesTorchOnTheTransformersModel) { check_case("adafactor"); }

// The Muon fixture is generated where torch is installed (make_muon_trajectory.py).
constexpr const char* kMuonRecord = "muon_trajectory.json";

bool muon_fixture_present() { return fs::exists(kFixtures / "qwen3/trajectory" / kMuonRecord); }

#define REQUIRE_MUON_FIXTURE()                                                                           \
  do {                                                                                                   \
    if (!muon_fixture_present()) {                                                                       \
      GTEST_SKIP() << "tests/fixtures/qwen3/trajectory/" << kMuonRecord                                  \
                   << " is absent: make it with python3 tests/fixtures/make_muon_trajectory.py (torch, " \
                      "transformers)";                                                                   \
    }                                                                                                    \
  } while (0)

TEST(OptimizerTrajectory, MuonMatchesTorchOnTheTransformersModel) {
  REQUIRE_MUON_FIXTURE();
  check_case("muon", kMuonRecord);
}
TEST(OptimizerTrajectory, MuonMoonlightAdjustmentMatchesTorch) {
  REQUIRE_MUON_FIXTURE();
  check_case("muon_moonlight", kMuonRecord);
}

// The bf16 GPU path against the fp64 oracle. Bounds:
// - each tensor's update (weights after ten steps minus before) within 0.15 normwise of torch's
//   (measured on an H100: worst 0.055 with torch's rate, 0.063 with Moonlight's, both a k_norm).
//   bf16 Newton-Schulz is the larger part: the gradient of a [n, 64] matrix over this window's 32
//   tokens has rank <= 32, so half of U's singular values are (near) zero, and bf16's rounding of
//   X puts noise there that five iterations amplify up to 3.4445^5 = 485 times; a host emulation
//   of the bf16 iteration (bf16 operands and results, exact accumulation) on rank-32 [256, 64] to
//   [64, 160] inputs with decaying spectra differs from fp64 by 0.13 to 0.14 normwise per step
//   (0.05 with a 1% full-rank component, 0.09 at full rank). Ten steps' errors partly cancel; the
//   bf16 model's gradients (within 5e-2 normwise, Qwen3Gpu's parity bound) add to them, and
//   AdamW's sign-like first steps turn a near-zero gradient element's bf16 error into a full step.
// - each step's loss within 1e-2 relative (the bf16 forward: Qwen3Gpu's parity bound) plus 0.25 of
//   torch's decrease so far (to first order an update error e moves the decrease by at most e of it).
// The errors are printed, so a change that moves them shows before it crosses a bound.
void check_muon_case_on_gpu(const std::string& name) {
  const TrajectoryCase c(name, kMuonRecord);
  const core::DeviceContext gpu(core::Device::cuda(0));
  optim::Slab slab(*c.layout, gpu);
  test::from_host(slab.master(), c.initial);
  slab.write_mirror(gpu);
  auto optimizer = optim::make_optimizer(c.config, slab, gpu);
  auto model = c.spec->trainable(slab, gpu, {.max_tokens = c.batch * c.seq});
  core::Buffer ids(gpu.device(), c.ids.size() * sizeof(std::int32_t));
  core::Buffer targets(gpu.device(), c.targets.size() * sizeof(std::int32_t));
  test::from_host(ids, c.ids);
  test::from_host(targets, c.targets);
  double worst_loss = 0;
  for (int step = 0; step < c.steps; ++step) {
    model->forward_backward(ids.as<std::int32_t>(), targets.as<std::int32_t>(), c.batch, c.seq, 1.0f);
    gpu.synchronize();
    float loss = 0;
    CUDA_CHECK(cudaMemcpy(&loss, model->loss(), sizeof(float), cudaMemcpyDeviceToHost));
    const double torch_loss = c.losses[static_cast<std::size_t>(step)];
    worst_loss = std::max(worst_loss, std::fabs(loss - torch_loss) / torch_loss);
    EXPECT_NEAR(loss, torch_loss, 1e-2 * torch_loss + 0.25 * (c.losses[0] - torch_loss)) << name << ", step " << step;
    optimizer->step(c.config.lr);
  }
  EXPECT_EQ(optimizer->report().step, c.steps);
  const auto ours = test::to_host<float>(slab.master());
  std::vector<float> torch_update(c.torch.size());
  for (std::size_t i = 0; i < c.torch.size(); ++i) torch_update[i] = c.torch[i] - c.initial[i];
  double worst = 0;
  std::string worst_name;
  for (const optim::SlabTensor& t : c.layout->parameters()) {
    const double e = tensor_error(ours, c.torch, torch_update, t);  // ours - torch = our update - torch's
    EXPECT_LE(e, 0.15) << name << ": update of " << t.spec.name;
    if (e > worst) {
      worst = e;
      worst_name = t.spec.name;
    }
  }
  std::printf("[ bf16 gpu ] %s: worst update error %.3g (%s), worst loss error %.3g relative\n", name.c_str(), worst,
              worst_name.c_str(), worst_loss);
}

TEST(OptimizerTrajectory, MuonBf16OnGpu) {
  REQUIRE_GPU();
  REQUIRE_MUON_FIXTURE();
  check_muon_case_on_gpu("muon");
}
TEST(OptimizerTrajectory, MuonMoonlightBf16OnGpu) {
  REQUIRE_GPU();
  REQUIRE_MUON_FIXTURE();
  check_muon_case_on_gpu("muon_moonlight");
}

}  // namespace
