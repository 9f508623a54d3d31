// Fuzz target: a training checkpoint as resume, export_hf and init_from read it. Input:
// manifest.json's text, then "=== NAME" files of the step directory (the buffer files the
// manifest lists), optionally "=== DONE" (default: the manifest's true checksum line, so inputs
// get past the checksum and exercise what comes after it) and "=== dir" (the step directory's
// name, default step_00000003). The run it resumes into is a fixed tiny model (vocab 16, one
// layer, adamw) on the cpu.
//
// With LLMTRAIN_FUZZ_MAKE_SEED=FILE set, writes a seed input to FILE: a real checkpoint of that
// model saved by save_checkpoint, in the layout above.
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "core/crc32c.h"
#include "core/device.h"
#include "core/error.h"
#include "fuzz_support.h"
#include "optim/optimizer.h"
#include "optim/slab.h"
#include "text/token_shard.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/pretrained.h"

namespace fs = std::filesystem;

namespace {

constexpr char kConfig[] =
    "run:\n  name: fuzz\n  output_dir: run\n  seed: 3\n"
    "device: cpu\n"
    "model:\n  preset: qwen3-tiny\n  vocab_size: 16\n  hidden_size: 8\n  intermediate_size: 8\n  num_layers: 1\n"
    "  num_heads: 2\n  num_kv_heads: 1\n  head_dim: 4\n  tie_word_embeddings: true\n"
    "data:\n  train: train.bin\n  seq_len: 4\n  tokenizer: tokenizer.json\n"
    "training:\n  micro_batch_size: 1\n  max_steps: 8\n"
    "optimizer:\n  type: adamw\n  lr: 1.0e-2\n"
    "checkpoint:\n  every: 0\n  resume: auto\n";

struct Run {
  fuzz::Scratch scratch;
  trainer::RunConfig config;
  core::DeviceContext cpu{core::Device::cpu()};
  std::unique_ptr<optim::Slab> slab;
  std::unique_ptr<optim::Optimizer> optimizer;
};
std::unique_ptr<Run> run;

std::string hex32(std::uint32_t value) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", value);
  return buf;
}

std::string file_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Saves a checkpoint of the fixed run at step 3 and writes it as one fuzz input to `out`.
void make_seed(const std::string& out) {
  const fs::path root = run->scratch.path() / "seed";
  for (int step = 0; step < 3; ++step) {
    float* grad = run->slab->grad().as<float>();
    for (std::int64_t i = 0; i < run->slab->full().size(); ++i)
      grad[i] = 0.01f * static_cast<float>((i * 7 + step) % 5) - 0.02f;
    run->optimizer->step(1e-3);
  }
  trainer::TrainingProgress progress;
  progress.step = 3;
  progress.tokens_seen = 12;
  progress.sampler_seed = 5;
  progress.seq_len = 4;
  progress.global_batch = 1;
  const fs::path dir = trainer::save_checkpoint(root, run->config, progress, *run->optimizer, run->cpu);
  std::string input = file_text(dir / "manifest.json");
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name == "manifest.json" || name == "DONE") continue;
    input += "\n=== " + name + "\n" + file_text(entry.path());
  }
  fuzz::write_file(out, input);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  run = std::make_unique<Run>();
  if (::chdir(run->scratch.path().c_str()) != 0) std::abort();
  const std::vector<std::uint32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1};
  text::write_token_shard("train.bin", tokens, text::TokenDtype::u16);
  fuzz::write_file("tokenizer.json", "{}");
  run->config = trainer::parse_run_config(kConfig, "fuzz.yaml", {});
  run->slab =
      std::make_unique<optim::Slab>(optim::SlabLayout(trainer::model_spec(run->config)->parameters(), 1), run->cpu);
  run->optimizer = optim::make_optimizer(run->config.optimizer, *run->slab, run->cpu);
  if (const char* seed = std::getenv("LLMTRAIN_FUZZ_MAKE_SEED")) {
    make_seed(seed);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fuzz::Files files = fuzz::split_files(data, size, "manifest.json");
  const fs::path base = fs::absolute(run->scratch.path());
  for (const auto& entry : fs::directory_iterator(base)) {
    if (entry.path().filename() == "run") fs::remove_all(entry.path());
  }
  std::string dir_name = "step_00000003";
  if (const std::string* name = fuzz::find_file(files, "dir")) dir_name = fuzz::safe_name(*name);
  if (dir_name.empty()) dir_name = "step_00000003";
  const fs::path dir = base / "run" / "checkpoints" / dir_name;
  fs::create_directories(dir);
  const std::string& manifest = files.front().second;
  for (const auto& [name, bytes] : files) {
    const std::string safe = fuzz::safe_name(name);
    if (safe.empty() || safe == "dir" || safe == "DONE") continue;
    fuzz::write_file(dir / safe, bytes);
  }
  const std::string* done = fuzz::find_file(files, "DONE");
  fuzz::write_file(dir / "DONE",
                   done ? *done : "crc32c " + hex32(core::crc32c(0, manifest.data(), manifest.size())) + "\n");

  // export_hf and init_from: the step directory and the run directory.
  for (const fs::path& path : {dir, base / "run"}) {
    try {
      const trainer::PretrainedWeights weights = trainer::load_pretrained(path.string());
      if (weights.master.size() != static_cast<std::size_t>(weights.layout.total_elements())) std::abort();
    } catch (const core::Error& e) {
      fuzz::refused(e);
    }
  }
  // Resume into the fixed run: the newest checkpoint that verifies, loaded into its optimizer.
  try {
    trainer::RunConfig config = run->config;
    config.run.output_dir = (base / "run").string();
    const auto verified = trainer::select_checkpoint(config, run->slab->layout());
    if (verified) (void)trainer::load_checkpoint(*verified, *run->optimizer, run->cpu);
  } catch (const core::Error& e) {
    fuzz::refused(e);
  }
  return 0;
}
