#include "models/qwen3/hf_import.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "models/qwen3/safetensors.h"

namespace models::qwen3 {

namespace fs = std::filesystem;

Qwen3Config read_hf_config(const std::string& folder) { return config_from_hf_json((fs::path(folder) / "config.json").string()); }

namespace {

// Which file holds each tensor: the single model.safetensors, or the index's weight_map.
std::map<std::string, std::string> weight_files(const std::string& folder) {
  const fs::path single = fs::path(folder) / "model.safetensors";
  const fs::path index = fs::path(folder) / "model.safetensors.index.json";
  std::map<std::string, std::string> files;
  if (fs::exists(index)) {
    std::ifstream in(index);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw core::InputError(index.string() + ": not valid JSON: " + e.what());
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
      throw core::InputError(index.string() + ": missing weight_map");
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      files[it.key()] = (fs::path(folder) / it.value().get<std::string>()).string();
    }
    return files;
  }
  if (!fs::exists(single)) {
    throw core::InputError(folder + ": neither model.safetensors nor model.safetensors.index.json exists");
  }
  const SafetensorsFile file(single.string());
  for (const auto& e : file.entries()) files[e.name] = single.string();
  return files;
}

}  // namespace

void load_hf_weights(const std::string& folder, const Qwen3Config& config, optim::Slab& slab) {
  if (slab.device().is_cuda() || !(slab.owned() == slab.full())) {
    throw core::Error("load_hf_weights: the slab must be a whole-model cpu slab");
  }
  const auto files = weight_files(folder);
  const auto map = hf_tensor_map(config);
  std::set<std::string> expected;
  for (const auto& [hf_name, _] : map) expected.insert(hf_name);
  for (const auto& [name, file] : files) {
    const bool tied_head = name == "lm_head.weight" && config.tie_word_embeddings;
    if (!expected.count(name) && !tied_head) {
      throw core::InputError(file + ": unexpected tensor '" + name + "' for this Qwen3 configuration");
    }
  }
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open;
  const auto& layout = slab.layout();
  for (const auto& [hf_name, loc] : map) {
    const auto it = files.find(hf_name);
    if (it == files.end()) throw core::InputError(folder + ": missing tensor '" + hf_name + "'");
    auto& file = open[it->second];
    if (!file) file = std::make_unique<SafetensorsFile>(it->second);
    const SafetensorsEntry& e = file->entry(hf_name);
    const int index = layout.find(loc.name);
    const optim::SlabTensor& t = layout.tensors()[static_cast<std::size_t>(index)];
    const std::int64_t cols = t.spec.shape.size() == 2 ? t.spec.shape[1] : 1;
    const core::Shape want = t.spec.shape.size() == 2 ? core::Shape{loc.rows, cols} : core::Shape{loc.rows};
    if (e.shape != want) {
      throw core::InputError(it->second + ": tensor '" + hf_name + "' has shape " + core::shape_str(e.shape) +
                             ", expected " + core::shape_str(want));
    }
    const std::vector<float> values = file->read_f32(hf_name);
    float* dst = slab.master_view(index).as<float>() + loc.row_offset * cols;
    std::copy(values.begin(), values.end(), dst);
  }
}

}  // namespace models::qwen3
