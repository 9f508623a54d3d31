#include "models/hf_folder.h"

#include <fstream>
#include <map>
#include <memory>
#include <set>

#include "core/error.h"
#include "core/half.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "models/safetensors.h"

namespace models {

namespace fs = std::filesystem;

namespace {

// Which file holds each tensor: the single model.safetensors, or the index's weight_map.
std::map<std::string, std::string> weight_files(const fs::path& folder) {
  const fs::path single = folder / "model.safetensors";
  const fs::path index = folder / "model.safetensors.index.json";
  std::map<std::string, std::string> files;
  if (fs::exists(index)) {
    const nlohmann::json j = read_json_file(index);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      throw core::InputError(index.string() + ": weight_map: missing or not a mapping");
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        throw core::InputError(index.string() + ": weight_map." + it.key() + ": expected a file name");
      const fs::path file = it.value().get<std::string>();
      if (file.has_parent_path() || file.is_absolute()) {
        throw core::InputError(index.string() + ": weight_map." + it.key() +
                               ": expected a file name in the folder, got '" + file.string() + "'");
      }
      files[it.key()] = (folder / file).string();
    }
    return files;
  }
  if (!fs::exists(single)) {
    throw core::InputError(folder.string() + ": neither model.safetensors nor model.safetensors.index.json exists");
  }
  const SafetensorsFile file(single.string());
  for (const auto& e : file.entries()) files[e.name] = single.string();
  return files;
}

}  // namespace

HfConfig read_hf_config(const fs::path& folder, const Shape& base) {
  const fs::path path = folder / "config.json";
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw core::InputError(path.string() + ": missing (a Hugging Face folder needs its config.json)");
  HfConfig out;
  out.config = read_json_file(path);
  out.family = &family_of_hf_config(out.config, path.string());
  const Shape start = base.is_null() ? base_shape(*out.family, "") : base;
  out.shape = shape_from_hf(*out.family, out.config, path.string(), start);
  return out;
}

void load_hf_weights(const fs::path& folder, const ModelSpec& spec, optim::Slab& slab) {
  if (slab.device().is_cuda() || !(slab.owned() == slab.full())) {
    throw core::Error("load_hf_weights: the slab must be a whole-model cpu slab");
  }
  const auto files = weight_files(folder);
  const std::vector<HfTensor> tensors = spec.hf_tensors();
  std::set<std::string> expected;
  for (const HfTensor& t : tensors) expected.insert(t.name);
  for (const auto& [name, file] : files) {
    if (!expected.count(name))
      throw core::InputError(file + ": unexpected tensor '" + name + "' for this " + spec.family() + " configuration");
  }
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open;
  const auto& layout = slab.layout();
  // Tied copies are compared after every owning tensor is in place.
  for (int pass = 0; pass < 2; ++pass) {
    for (const HfTensor& t : tensors) {
      if (t.tied_copy != (pass == 1)) continue;
      const auto it = files.find(t.name);
      if (it == files.end()) {
        if (t.optional) continue;
        throw core::InputError(folder.string() + ": missing tensor '" + t.name + "'");
      }
      auto& file = open[it->second];
      if (!file) file = std::make_unique<SafetensorsFile>(it->second);
      const SafetensorsEntry& e = file->entry(t.name);
      if (e.shape != core::Shape(t.shape.begin(), t.shape.end())) {
        throw core::InputError(it->second + ": tensor '" + t.name + "' has shape " + core::shape_str(e.shape) +
                               ", expected " + core::shape_str(core::Shape(t.shape.begin(), t.shape.end())));
      }
      const optim::SlabTensor& slot = layout.tensors()[static_cast<std::size_t>(t.param)];
      const std::int64_t cols = slot.spec.shape.size() == 2 ? slot.spec.shape[1] : 1;
      const std::vector<float> values = file->read_f32(t.name);
      float* dst = slab.master_view(t.param).as<float>() + t.row_offset * cols;
      if (!t.tied_copy) {
        std::copy(values.begin(), values.end(), dst);
        continue;
      }
      for (std::size_t i = 0; i < values.size(); ++i) {
        if (values[i] != dst[i]) {
          throw core::InputError(it->second + ": tensor '" + t.name +
                                 "' differs from the tensor it is tied to (element " + std::to_string(i) + ": " +
                                 std::to_string(values[i]) + " vs " + std::to_string(dst[i]) +
                                 "); the config sets tie_word_embeddings");
        }
      }
    }
  }
}

void write_hf_folder(const fs::path& folder, const ModelSpec& spec, const optim::SlabLayout& layout,
                     const float* master, ExportDtype dtype, const nlohmann::json& carried,
                     const fs::path& tokenizer_file) {
  fs::create_directories(folder);
  std::vector<std::vector<std::uint16_t>> halves;  // keeps bf16 copies alive until written
  std::vector<SafetensorsTensor> tensors;
  const auto hf = spec.hf_tensors();
  halves.reserve(hf.size());
  for (const HfTensor& t : hf) {
    if (t.tied_copy) continue;  // transformers ties it itself
    const optim::SlabTensor& slot = layout.tensors()[static_cast<std::size_t>(t.param)];
    const std::int64_t cols = slot.spec.shape.size() == 2 ? slot.spec.shape[1] : 1;
    const float* begin = master + slot.offset + t.row_offset * cols;
    const core::Shape shape(t.shape.begin(), t.shape.end());
    if (dtype == ExportDtype::fp32) {
      tensors.push_back({t.name, "F32", shape, begin});
    } else {
      auto& h = halves.emplace_back(static_cast<std::size_t>(t.rows * cols));
      for (std::size_t i = 0; i < h.size(); ++i) h[i] = core::float_to_bf16(begin[i]);
      tensors.push_back({t.name, "BF16", shape, h.data()});
    }
  }
  write_safetensors((folder / "model.safetensors").string(), tensors);
  auto write = [](const fs::path& path, const std::string& text) {
    std::ofstream out(path);
    out << text;
    out.close();
    if (!out) throw core::Error("cannot write " + path.string());
  };
  nlohmann::ordered_json config = spec.hf_config(carried);
  config["dtype"] = dtype == ExportDtype::bf16 ? "bfloat16" : "float32";
  write(folder / "config.json", config.dump(2) + "\n");
  nlohmann::ordered_json generation = {{"_from_model_config", true}};
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    if (config.contains(key) && !config[key].is_null()) generation[key] = config[key];
  }
  write(folder / "generation_config.json", generation.dump(2) + "\n");
  if (!tokenizer_file.empty())
    fs::copy_file(tokenizer_file, folder / "tokenizer.json", fs::copy_options::overwrite_existing);
}

}  // namespace models
