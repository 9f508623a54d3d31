// Hugging Face folders through the model interface: config.json + model.safetensors (or a
// sharded model.safetensors.index.json) read into a whole-model cpu slab, and written from fp32
// master weights with config.json, generation_config.json and, when given, the tokenizer file.
// Which tensors a folder holds, and where they live in the slab, is the spec's hf_tensors().
#pragma once

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "models/model.h"
#include "optim/slab.h"

namespace models {

enum class ExportDtype { bf16, fp32 };

// Reads `folder`/config.json: its family (architectures) and the shape it gives; fields without
// a config.json key take `base` (a shape of that family; null: the fallbacks).
struct HfConfig {
  const Family* family = nullptr;
  Shape shape;
  nlohmann::json config;  // the whole config.json
};
HfConfig read_hf_config(const std::filesystem::path& folder, const Shape& base = nullptr);

// Copies every tensor of the folder into `slab`'s master (a whole-model cpu slab laid out from
// spec.parameters()). core::InputError naming the file and tensor on a missing, unexpected or
// misshapen tensor, and on a tied copy (lm_head.weight of a tied model) that differs from the
// tensor it duplicates.
void load_hf_weights(const std::filesystem::path& folder, const ModelSpec& spec, optim::Slab& slab);

// Writes `folder`: model.safetensors from `master` (fp32 over the whole slab of `layout`),
// config.json (spec.hf_config(carried) with dtype), generation_config.json (bos/eos/pad ids
// from the config when present), and `tokenizer_file` copied as tokenizer.json when not empty.
void write_hf_folder(const std::filesystem::path& folder, const ModelSpec& spec, const optim::SlabLayout& layout,
                     const float* master, ExportDtype dtype, const nlohmann::json& carried = nullptr,
                     const std::filesystem::path& tokenizer_file = {});

}  // namespace models
