#include "tools/model_source.h"

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/buffer.h"
#include "core/error.h"

namespace tools {

namespace {

namespace fs = std::filesystem;

// End-of-sequence ids of a config.json / generation_config.json (an integer or a list).
void add_eos(const nlohmann::json& config, std::vector<std::int32_t>& out) {
  if (!config.is_object() || !config.contains("eos_token_id")) return;
  const auto& eos = config["eos_token_id"];
  const auto add = [&](const nlohmann::json& v) {
    if (v.is_number_integer() && v.get<std::int64_t>() >= 0 && v.get<std::int64_t>() <= INT32_MAX) {
      out.push_back(v.get<std::int32_t>());
    }
  };
  if (eos.is_array()) {
    for (const auto& v : eos) add(v);
  } else {
    add(eos);
  }
}

// The tokenizer to use: the one asked for, else what the source recorded, else bytes.
std::unique_ptr<text::Tokenizer> pick_tokenizer(const std::string& requested, const std::string& recorded,
                                                const std::string& path) {
  if (!requested.empty()) return text::make_tokenizer(requested);
  if (recorded.empty() || recorded == "byte") return std::make_unique<text::ByteTokenizer>();
  std::error_code ec;
  if (!fs::is_regular_file(recorded, ec)) {
    throw core::InputError(path + ": its tokenizer " + recorded +
                           " is not there (paths are relative to the directory "
                           "the run started in); give one with --tokenizer PATH/tokenizer.json or --tokenizer byte");
  }
  return text::make_tokenizer(recorded);
}

}  // namespace

ModelSource load_model_source(const std::string& path, const std::string& device, const std::string& tokenizer) {
  if (!fs::exists(path)) throw core::InputError(path + ": no such file or directory");
  const std::string chosen = device.empty() ? (core::cuda_device_count() > 0 ? "cuda" : "cpu") : device;
  if (chosen != "cpu" && chosen != "cuda") throw core::InputError("--device: expected cpu or cuda, got " + chosen);
  if (chosen == "cuda" && core::cuda_device_count() == 0) {
    throw core::InputError("--device cuda: no CUDA device is available (use --device cpu)");
  }
  ModelSource m{.weights = trainer::load_pretrained(path)};
  m.device = chosen;
  m.tokenizer = pick_tokenizer(tokenizer, m.weights.tokenizer, path);
  add_eos(m.weights.carried_hf_config, m.eos_ids);
  if (!trainer::is_checkpoint_path(path)) {
    std::ifstream generation(fs::path(path) / "generation_config.json");
    if (generation) add_eos(nlohmann::json::parse(generation, nullptr, false), m.eos_ids);
  }
  m.context = std::make_unique<core::DeviceContext>(m.device == "cuda" ? core::Device::cuda(0) : core::Device::cpu());
  m.slab = std::make_unique<optim::Slab>(m.weights.layout, *m.context);
  core::copy_bytes(m.slab->master().data(), m.weights.master.data(), m.weights.master.size() * sizeof(float),
                   m.context->stream());
  m.context->synchronize();
  if (m.context->is_cuda()) m.slab->write_mirror(*m.context);
  return m;
}

}  // namespace tools
