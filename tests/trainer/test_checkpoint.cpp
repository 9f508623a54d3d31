// Training checkpoints: CRC32C, save/load round trip of the slab, optimizer state and step
// counters, bit-exact resume (2K steps in one go == K steps, stop, resume to 2K: same per-step
// losses, byte-identical final master weights and optimizer state), keep_last pruning, refused
// checkpoints (truncated file, flipped byte, missing file, another model, corrupt manifest, no
// DONE) each with its message, an explicit corrupt PATH refused before anything is written, and
// `resume: auto` falling back to the previous checkpoint with a warning.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include "core/error.h"
#include "models/model_config.h"
#include "models/qwen3/model.h"
#include "models/registry.h"
#include "models/qwen3/family.h"
#include "optim/optimizer.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "text/token_shard.h"
#include "trainer/train.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
namespace q3 = models::qwen3;

std::string read_bytes(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream content;
  content << file.rdbuf();
  return std::move(content).str();
}

// The bytes of a host buffer.
std::string read_bytes_of(const core::Buffer& buffer) {
  return std::string(static_cast<const char*>(buffer.data()), buffer.bytes());
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Step -> loss of every "loss" record of a run's metrics.jsonl.
std::map<std::int64_t, double> logged_losses(const fs::path& run_dir) {
  std::map<std::int64_t, double> out;
  std::ifstream file(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(file, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) out[j.at("step").get<std::int64_t>()] = j.at("loss").get<double>();
  }
  return out;
}

// Captures spdlog's output while alive.
class CapturedLog {
 public:
  CapturedLog() : previous_(spdlog::default_logger()) {
    spdlog::set_default_logger(
        std::make_shared<spdlog::logger>("captured", std::make_shared<spdlog::sinks::ostream_sink_mt>(text_)));
  }
  ~CapturedLog() { spdlog::set_default_logger(previous_); }
  std::string text() const { return text_.str(); }

 private:
  std::shared_ptr<spdlog::logger> previous_;
  std::ostringstream text_;
};

// A fresh folder per test with a small training shard; runs a tiny byte-level model on the cpu.
class Checkpoints : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("llmtrain_test_checkpoint_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::vector<std::uint32_t> tokens(6000);
    std::uint64_t state = 12345;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      tokens[i] = i % 7 == 0 ? static_cast<std::uint32_t>(state >> 58) : 'a' + static_cast<std::uint32_t>(i % 13);
    }
    text::write_token_shard(dir_ / "train.bin", tokens, text::TokenDtype::u16);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The test config with output_dir `run` (under the test folder) and `overrides`.
  trainer::RunConfig config(const std::string& run, std::vector<std::string> overrides = {}, int num_layers = 1) const {
    const std::string yaml = "run:\n  name: checkpoint-test\n  output_dir: " + (dir_ / run).string() +
                             "\n  seed: 11\n"
                             "device: cpu\n"
                             "model:\n  preset: qwen3-tiny\n  vocab_size: 256\n  hidden_size: 32\n"
                             "  intermediate_size: 64\n  num_layers: " +
                             std::to_string(num_layers) +
                             "\n  num_heads: 2\n  num_kv_heads: 1\n  head_dim: 16\n  tie_word_embeddings: true\n"
                             "data:\n  train: " +
                             (dir_ / "train.bin").string() +
                             "\n  seq_len: 16\n"
                             "training:\n  micro_batch_size: 2\n  global_batch_size: 4\n  max_steps: 8\n"
                             "optimizer:\n  type: adamw\n  lr: 1.0e-2\n"
                             "schedule:\n  type: cosine\n  warmup_steps: 2\n"
                             "checkpoint:\n  every: 0\n  keep_last: 0\n  resume: auto\n"
                             "logging:\n  every: 1\n"
                             "sample:\n  tokens: 4\n";
    return trainer::parse_run_config(yaml, "test.yaml", overrides);
  }

  fs::path checkpoint(const std::string& run, std::int64_t step) const {
    return trainer::checkpoint_directory(dir_ / run / "checkpoints", step);
  }

  static optim::SlabLayout layout_of(const trainer::RunConfig& c) {
    return optim::SlabLayout(trainer::model_spec(c)->parameters(), 1);
  }

  // A copy of checkpoint `source` as `name` under the test folder.
  fs::path copy_of(const fs::path& source, const std::string& name) const {
    const fs::path target = dir_ / name;
    fs::copy(source, target, fs::copy_options::recursive);
    return target;
  }

  // The message of the core::InputError verify_checkpoint throws for `directory` ("" when it verifies).
  static std::string refusal(const fs::path& directory, const trainer::RunConfig& c) {
    try {
      trainer::verify_checkpoint(directory, layout_of(c), c.optimizer.type);
    } catch (const core::InputError& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

TEST(Crc32c, KnownValues) {
  EXPECT_EQ(trainer::crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(trainer::crc32c(0, "", 0), 0u);
  // Continuing over pieces equals one pass, also across the 8-byte words of the hardware path.
  const std::string text = "The quick brown fox jumps over the lazy dog, twice over.";
  EXPECT_EQ(trainer::crc32c(trainer::crc32c(0, text.data(), 13), text.data() + 13, text.size() - 13),
            trainer::crc32c(0, text.data(), text.size()));
}

// A manifest written before a shape field existed (E29a's residual) reads the field as config.json
// reads an absent key; a field config.json requires stays required.
TEST(ManifestModel, FieldAddedLaterTakesItsConfigJsonDefault) {
  const models::Family& family = models::family("e29a");
  nlohmann::json shape = models::weights_shape(family, models::base_shape(family, "e29a-tiny"));
  shape["residual"] = "normed_sum";
  const nlohmann::json manifest = {{"model", {{"family", "e29a"}, {"shape", shape}}}};
  EXPECT_EQ(trainer::manifest_model_of(manifest, "m").shape["residual"], "normed_sum");
  nlohmann::json older = manifest;
  older["model"]["shape"].erase("residual");
  EXPECT_EQ(trainer::manifest_model_of(older, "m").shape["residual"], "pre_norm");
  nlohmann::json broken = manifest;
  broken["model"]["shape"].erase("hidden_size");
  try {
    trainer::manifest_model_of(broken, "m");
    ADD_FAILURE() << "a manifest without hidden_size was accepted";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("m: model.shape.hidden_size: missing"), std::string::npos) << e.what();
  }
}

TEST_F(Checkpoints, SaveAndLoadRoundTrip) {
  const trainer::RunConfig c = config("run");
  const core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(layout_of(c), cpu);
  q3::Qwen3Model(q3::config_from_shape(c.model.shape), slab).initialize(3);
  slab.write_mirror(cpu);
  auto optimizer = optim::make_optimizer(c.optimizer, slab, cpu);
  for (int step = 0; step < 3; ++step) {
    float* grad = slab.grad().as<float>();
    for (std::int64_t i = 0; i < slab.full().size(); ++i)
      grad[i] = 0.001f * static_cast<float>((i * 7 + step) % 11) - 0.005f;
    optimizer->step(1e-3);
  }
  trainer::TrainingProgress progress;
  progress.step = 3;
  progress.tokens_seen = 192;
  progress.sampler_seed = 11;
  progress.sampler = {.epoch = 1, .position = 5};
  const fs::path saved = trainer::save_checkpoint(dir_ / "run" / "checkpoints", c, progress, *optimizer, cpu);
  EXPECT_EQ(saved, checkpoint("run", 3));
  EXPECT_TRUE(fs::is_regular_file(saved / "DONE"));
  EXPECT_FALSE(fs::exists(saved.string() + ".tmp"));

  optim::Slab restored_slab(layout_of(c), cpu);
  auto restored = optim::make_optimizer(c.optimizer, restored_slab, cpu);
  restored_slab.grad().fill_bytes(0x7f);
  const trainer::VerifiedCheckpoint verified = trainer::verify_checkpoint(saved, layout_of(c), "adamw");
  EXPECT_EQ(trainer::load_checkpoint(verified, *restored, cpu), progress);
  EXPECT_EQ(read_bytes_of(slab.master()), read_bytes_of(restored_slab.master()));
  EXPECT_EQ(read_bytes_of(slab.mirror()), read_bytes_of(restored_slab.mirror()));
  const auto original_state = optimizer->state_buffers(), restored_state = restored->state_buffers();
  ASSERT_EQ(original_state.size(), restored_state.size());
  for (std::size_t i = 0; i < original_state.size(); ++i) {
    EXPECT_EQ(read_bytes_of(*original_state[i].buffer), read_bytes_of(*restored_state[i].buffer))
        << original_state[i].name;
  }
  EXPECT_EQ(restored->step_scalars().step, 3);
  EXPECT_EQ(restored->step_scalars().skipped, 0);
  const float* grad = restored_slab.grad().as<float>();
  for (std::int64_t i = 0; i < restored_slab.full().size(); ++i) ASSERT_EQ(grad[i], 0.0f);
  const nlohmann::json manifest = nlohmann::json::parse(read_bytes(saved / "manifest.json"));
  EXPECT_EQ(manifest.at("files").size(), 3u);
  EXPECT_EQ(manifest.at("layout").at("total_elements").get<std::int64_t>(), slab.layout().total_elements());
  EXPECT_EQ(trainer::parse_run_config(manifest.at("config_yaml").get<std::string>(), "manifest", {}), c);
}

// For every optimizer (8-bit AdamW: quantised and small-tensor state; Adafactor: row/column
// statistics and packed v; Muon: the matrices' momentum buffers): 8 steps in one go and 4 + 4 with a resume give
// identical losses and byte-identical final checkpoints.
TEST_F(Checkpoints, ResumeIsBitExact) {
  const std::int64_t steps = 8, half = 4;
  for (const std::string type : {"adamw", "adamw8bit", "adafactor", "muon"}) {
    SCOPED_TRACE(type);
    const std::vector<std::string> optimizer = {"optimizer.type=" + type};
    const std::string whole_run = "whole-" + type, split_run = "split-" + type;
    const trainer::TrainSummary whole = trainer::train(config(whole_run, optimizer));
    EXPECT_EQ(whole.steps, steps);

    const trainer::TrainSummary first = trainer::train(config(split_run, optimizer), {.stop_after_step = half});
    EXPECT_TRUE(first.stopped_early);
    EXPECT_EQ(first.steps, half);
    ASSERT_TRUE(fs::is_regular_file(checkpoint(split_run, half) / "DONE"));
    const trainer::TrainSummary second = trainer::train(config(split_run, optimizer));
    EXPECT_EQ(second.resumed_from, half);
    EXPECT_EQ(second.steps, steps);

    const auto expected = logged_losses(dir_ / whole_run), resumed = logged_losses(dir_ / split_run);
    ASSERT_EQ(expected.size(), static_cast<std::size_t>(steps));
    EXPECT_EQ(resumed, expected);
    for (const auto& entry : fs::directory_iterator(checkpoint(whole_run, steps))) {
      const std::string name = entry.path().filename().string();
      if (name == "manifest.json" || name == "DONE") continue;
      EXPECT_EQ(read_bytes(entry.path()), read_bytes(checkpoint(split_run, steps) / name)) << name;
    }
    const auto m1 = nlohmann::json::parse(read_bytes(checkpoint(whole_run, steps) / "manifest.json"));
    const auto m2 = nlohmann::json::parse(read_bytes(checkpoint(split_run, steps) / "manifest.json"));
    EXPECT_EQ(m1.at("files"), m2.at("files"));
    EXPECT_EQ(m1.at("sampler"), m2.at("sampler"));
    EXPECT_EQ(m1.at("step_scalars"), m2.at("step_scalars"));
    EXPECT_EQ(m1.at("tokens_seen"), m2.at("tokens_seen"));
  }
}

// The same on the GPU (bf16 model, head_dim 64 for the GPU attention): losses and the final
// master weights and optimizer state are byte-identical.
TEST_F(Checkpoints, ResumeIsBitExactOnGpu) {
  REQUIRE_GPU();
  const std::vector<std::string> gpu = {"device=cuda", "training.precision=bf16", "model.head_dim=64"};
  const trainer::TrainSummary whole = trainer::train(config("whole", gpu));
  EXPECT_EQ(whole.steps, 8);
  trainer::train(config("split", gpu), {.stop_after_step = 4});
  const trainer::TrainSummary second = trainer::train(config("split", gpu));
  EXPECT_EQ(second.resumed_from, 4);
  EXPECT_EQ(logged_losses(dir_ / "split"), logged_losses(dir_ / "whole"));
  for (const auto& entry : fs::directory_iterator(checkpoint("whole", 8))) {
    const std::string name = entry.path().filename().string();
    if (name == "manifest.json" || name == "DONE") continue;
    EXPECT_EQ(read_bytes(entry.path()), read_bytes(checkpoint("split", 8) / name)) << name;
  }
}

TEST_F(Checkpoints, KeepLastPrunesOnlyCompleteOlderCheckpoints) {
  fs::create_directories(checkpoint("run", 0));  // an incomplete directory: no DONE
  trainer::train(config(
      "run", {"checkpoint.every=1", "checkpoint.keep_last=2", "checkpoint.resume=never", "training.max_steps=5"}));
  for (std::int64_t step : {1, 3}) EXPECT_FALSE(fs::exists(checkpoint("run", step))) << step;
  EXPECT_TRUE(fs::exists(checkpoint("run", 0)));
  EXPECT_FALSE(fs::exists(checkpoint("run", 2)));
  for (std::int64_t step : {4, 5}) EXPECT_TRUE(fs::is_regular_file(checkpoint("run", step) / "DONE")) << step;
}

TEST_F(Checkpoints, DamagedCheckpointsAreRefusedByName) {
  const trainer::RunConfig c = config("run", {"training.max_steps=2"});
  trainer::train(c);
  const fs::path good = checkpoint("run", 2);
  EXPECT_EQ(refusal(good, c), "");

  const fs::path truncated = copy_of(good, "truncated");
  fs::resize_file(truncated / "master.rank0.bin", fs::file_size(truncated / "master.rank0.bin") - 100);
  EXPECT_NE(refusal(truncated, c).find((truncated / "master.rank0.bin").string() + ": truncated"), std::string::npos)
      << refusal(truncated, c);

  const fs::path flipped = copy_of(good, "flipped");
  std::string bytes = read_bytes(flipped / "state.exp_avg.rank0.bin");
  bytes[bytes.size() / 2] ^= 0x01;
  write_bytes(flipped / "state.exp_avg.rank0.bin", bytes);
  EXPECT_NE(refusal(flipped, c).find((flipped / "state.exp_avg.rank0.bin").string() + ": checksum mismatch"),
            std::string::npos)
      << refusal(flipped, c);

  const fs::path missing = copy_of(good, "missing");
  fs::remove(missing / "state.exp_avg_sq.rank0.bin");
  EXPECT_NE(refusal(missing, c).find((missing / "state.exp_avg_sq.rank0.bin").string() + ": missing"),
            std::string::npos)
      << refusal(missing, c);

  const trainer::RunConfig deeper = config("deeper", {}, /*num_layers=*/2);
  EXPECT_NE(refusal(good, deeper).find((good / "manifest.json").string() + ": the checkpoint is of another model"),
            std::string::npos)
      << refusal(good, deeper);

  const fs::path manifest = copy_of(good, "manifest");
  std::string text = read_bytes(manifest / "manifest.json");
  text[text.find("\"step\": 2") + 8] = '3';
  write_bytes(manifest / "manifest.json", text);
  EXPECT_NE(refusal(manifest, c).find((manifest / "manifest.json").string() + ": checksum mismatch"), std::string::npos)
      << refusal(manifest, c);

  const fs::path unfinished = copy_of(good, "unfinished");
  fs::remove(unfinished / "DONE");
  EXPECT_NE(refusal(unfinished, c).find("the checkpoint is incomplete"), std::string::npos) << refusal(unfinished, c);

  // An explicit PATH that does not verify stops the run before anything is written.
  try {
    trainer::train(config("elsewhere", {"checkpoint.resume=" + flipped.string()}));
    FAIL() << "a corrupt checkpoint was accepted";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("state.exp_avg.rank0.bin"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir_ / "elsewhere"));
}

TEST_F(Checkpoints, AutoFallsBackToThePreviousCheckpoint) {
  trainer::train(config("run", {"checkpoint.every=1", "training.max_steps=3"}));
  const fs::path newest = checkpoint("run", 3);
  std::string bytes = read_bytes(newest / "master.rank0.bin");
  bytes[100] ^= 0x40;
  write_bytes(newest / "master.rank0.bin", bytes);

  trainer::TrainSummary summary;
  std::string log;
  {
    const CapturedLog captured;
    // Training one step longer than the first run: the schedule change is allowed.
    summary = trainer::train(config("run", {"training.max_steps=4", "checkpoint.allow_schedule_change=true"}));
    log = captured.text();
  }
  EXPECT_EQ(summary.resumed_from, 2);
  EXPECT_EQ(summary.steps, 4);
  EXPECT_NE(log.find(newest.string() + " is unusable"), std::string::npos) << log;
  EXPECT_NE(log.find("falling back to the previous checkpoint"), std::string::npos) << log;

  // With every checkpoint damaged, auto refuses instead of starting afresh over them.
  for (std::int64_t step : {1, 2, 3, 4}) fs::remove(checkpoint("run", step) / "DONE");
  EXPECT_THROW(trainer::train(config("run", {"training.max_steps=5"})), core::InputError);
}

}  // namespace
