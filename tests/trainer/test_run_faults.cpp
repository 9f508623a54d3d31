// Runs that must not pass silently: a manifest whose step contradicts its directory is refused by
// name, and a run in which every step was skipped (non-finite gradients) fails instead of exiting 0.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <unistd.h>

#include "core/error.h"
#include "models/hf_folder.h"
#include "text/token_shard.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/train.h"

namespace {

namespace fs = std::filesystem;

class RunFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("llmtrain_run_faults_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::vector<std::uint32_t> tokens(4000);
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>((i * 7919) % 251);
    text::write_token_shard(dir_ / "train.bin", tokens, text::TokenDtype::u16);
  }
  void TearDown() override { fs::remove_all(dir_); }

  trainer::RunConfig config(const std::string& model) const {
    const std::string yaml = "run: {output_dir: " + (dir_ / "run").string() + "}\ndevice: cpu\nmodel: " + model +
                             "\ndata: {train: " + (dir_ / "train.bin").string() +
                             ", seq_len: 16}\n"
                             "training: {micro_batch_size: 2, max_steps: 4}\nschedule: {warmup_steps: 1}\n"
                             "checkpoint: {every: 2, keep_last: 0}\nlogging: {every: 1}\nsample: {tokens: 1}\n";
    return trainer::parse_run_config(yaml, "faults.yaml", {});
  }

  fs::path dir_;
};

TEST_F(RunFaults, ManifestStepMustMatchItsDirectory) {
  const trainer::RunConfig c = config(
      "{preset: qwen3-tiny, hidden_size: 32, intermediate_size: 64, num_layers: 1, "
      "num_heads: 2, num_kv_heads: 1, head_dim: 16}");
  trainer::train(c, {.stop_after_step = 2});
  const fs::path step = dir_ / "run" / "checkpoints" / "step_00000002";
  for (const long long bad : {99LL, -1LL, 4'000'000'000'000'000'000LL}) {
    nlohmann::json manifest = trainer::read_verified_manifest(step);
    manifest["step"] = bad;
    const std::string text = manifest.dump(2) + "\n";
    std::ofstream(step / "manifest.json", std::ios::trunc) << text;
    char done[32];
    std::snprintf(done, sizeof done, "crc32c %08x\n", trainer::crc32c(0, text.data(), text.size()));
    std::ofstream(step / "DONE", std::ios::trunc) << done;
    try {
      trainer::verify_checkpoint(step, optim::SlabLayout(trainer::model_spec(c)->parameters(), 1), "adamw");
      ADD_FAILURE() << "accepted step " << bad;
    } catch (const core::InputError& e) {
      EXPECT_NE(std::string(e.what()).find("manifest.json: step " + std::to_string(bad)), std::string::npos)
          << e.what();
    }
  }
}

TEST_F(RunFaults, EveryStepSkippedFailsTheRun) {
  // The tied fixture with one non-finite weight: every gradient is non-finite, every step skipped.
  const std::string fixture = std::string(LLMTRAIN_FIXTURES_DIR) + "/qwen3/tied";
  const models::HfConfig read = models::read_hf_config(fixture);
  const auto spec = read.family->spec(read.shape);
  const core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(optim::SlabLayout(spec->parameters(), 1), cpu);
  models::load_hf_weights(fixture, *spec, slab);
  slab.master().as<float>()[slab.layout().tensors()[1].offset] = std::numeric_limits<float>::quiet_NaN();
  models::write_hf_folder(dir_ / "nan_model", *spec, slab.layout(), slab.master().as<float>(),
                          models::ExportDtype::fp32, read.config);
  const trainer::RunConfig c = config("{init_from: " + (dir_ / "nan_model").string() + "}");
  try {
    trainer::train(c);
    FAIL() << "a run whose every step was skipped passed";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("every one of the 4 steps of this run was skipped"), std::string::npos)
        << e.what();
  }
}

}  // namespace
