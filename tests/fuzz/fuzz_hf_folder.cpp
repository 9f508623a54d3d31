// Fuzz target: a Hugging Face folder as init_from and the import read it: config.json, then
// safetensors files (header, every tensor's data) and an optional sharded index. Input:
// config.json's text, then files as "=== model.safetensors", "=== model.safetensors.index.json",
// "=== NAME.safetensors" (names reduced to one safe path component).
//
// With LLMTRAIN_FUZZ_MAKE_SEED=FILE set, writes a seed input to FILE: the folder write_hf_folder
// makes of a tiny Qwen3 (vocab 16, one layer) in bf16.
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "fuzz_support.h"
#include "models/hf_folder.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "models/registry.h"
#include "trainer/pretrained.h"

namespace {

std::unique_ptr<fuzz::Scratch> scratch;

std::string file_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void make_seed(const std::string& out) {
  const models::Family& family = models::family("qwen3");
  models::Shape shape = models::base_shape(family, "");
  for (const auto& [key, value] : {std::pair<const char*, int>{"vocab_size", 16},
                                   {"hidden_size", 8},
                                   {"intermediate_size", 8},
                                   {"num_layers", 1},
                                   {"num_heads", 2},
                                   {"num_kv_heads", 1},
                                   {"head_dim", 4},
                                   {"max_position_embeddings", 64}}) {
    shape[key] = value;
  }
  const auto spec = family.spec(shape);
  const optim::SlabLayout layout(spec->parameters(), 1);
  std::vector<float> master(static_cast<std::size_t>(layout.total_elements()));
  for (std::size_t i = 0; i < master.size(); ++i)
    master[i] = 0.01f * static_cast<float>(static_cast<int>(i * 37 % 41) - 20);
  const auto folder = scratch->fresh() / "seed";
  models::write_hf_folder(folder, *spec, layout, master.data(), models::ExportDtype::bf16);
  fuzz::write_file(
      out, file_text(folder / "config.json") + "\n=== model.safetensors\n" + file_text(folder / "model.safetensors"));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  scratch = std::make_unique<fuzz::Scratch>();
  if (const char* seed = std::getenv("LLMTRAIN_FUZZ_MAKE_SEED")) {
    make_seed(seed);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fuzz::Files files = fuzz::split_files(data, size, "config.json");
  const auto folder = scratch->fresh() / "model";
  for (const auto& [name, bytes] : files) {
    const std::string safe = fuzz::safe_name(name);
    if (!safe.empty()) fuzz::write_file(folder / safe, bytes);
  }
  // Each safetensors file on its own: header, then every tensor as the import reads it.
  for (const auto& [name, bytes] : files) {
    const std::string safe = fuzz::safe_name(name);
    if (safe.size() < 12 || safe.compare(safe.size() - 12, 12, ".safetensors") != 0) continue;
    try {
      const models::SafetensorsFile file((folder / safe).string());
      for (const models::SafetensorsEntry& e : file.entries()) {
        try {
          (void)file.read_f32(e.name);
        } catch (const core::Error& e) {
          fuzz::refused(e);
        }
        try {
          (void)file.read_i64(e.name);
        } catch (const core::Error& e) {
          fuzz::refused(e);
        }
      }
    } catch (const core::Error& e) {
      fuzz::refused(e);
    }
  }
  try {
    (void)models::read_hf_config(folder);
  } catch (const core::Error& e) {
    fuzz::refused(e);
  }
  try {
    const trainer::PretrainedWeights weights = trainer::load_pretrained(folder.string());
    if (weights.master.size() != static_cast<std::size_t>(weights.layout.total_elements())) std::abort();
  } catch (const core::Error& e) {
    fuzz::refused(e);
  }
  return 0;
}
