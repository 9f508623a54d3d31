#include "support/qwen3/hf_import.h"

#include <filesystem>

#include "models/hf_folder.h"
#include "models/model_config.h"
#include "models/qwen3/family.h"

namespace models::qwen3 {

Qwen3Config read_hf_config(const std::string& folder) {
  const auto path = std::filesystem::path(folder) / "config.json";
  const Family& family = qwen3_family();
  return config_from_shape(shape_from_hf(family, read_json_file(path), path.string(), base_shape(family, "")));
}

void load_hf_weights(const std::string& folder, const Qwen3Config& config, optim::Slab& slab) {
  models::load_hf_weights(folder, *qwen3_family().spec(shape_from_config(config)), slab);
}

}  // namespace models::qwen3
