#include "models/qwen3/hf_export.h"

#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "models/qwen3/safetensors.h"

namespace models::qwen3 {

void write_hf_folder(const std::string& folder, const Qwen3Config& config, const optim::SlabLayout& layout,
                     const float* master, ExportDtype dtype) {
  std::filesystem::create_directories(folder);
  const auto map = hf_tensor_map(config);
  std::vector<std::vector<std::uint16_t>> halves;  // keeps bf16 copies alive until written
  std::vector<SafetensorsTensor> tensors;
  halves.reserve(map.size());
  for (const auto& [hf_name, loc] : map) {
    const int index = layout.find(loc.name);
    if (index < 0) throw core::Error("write_hf_folder: the layout has no tensor '" + loc.name + "'");
    const optim::SlabTensor& t = layout.tensors()[static_cast<std::size_t>(index)];
    const std::int64_t cols = t.spec.shape.size() == 2 ? t.spec.shape[1] : 1;
    const float* begin = master + t.offset + loc.row_offset * cols;
    const core::Shape shape = t.spec.shape.size() == 2 ? core::Shape{loc.rows, cols} : core::Shape{loc.rows};
    if (dtype == ExportDtype::fp32) {
      tensors.push_back({hf_name, "F32", shape, begin});
    } else {
      auto& h = halves.emplace_back(static_cast<std::size_t>(loc.rows * cols));
      for (std::size_t i = 0; i < h.size(); ++i) h[i] = core::float_to_bf16(begin[i]);
      tensors.push_back({hf_name, "BF16", shape, h.data()});
    }
  }
  write_safetensors((std::filesystem::path(folder) / "model.safetensors").string(), tensors);
  nlohmann::json hf = hf_config_object(config);
  hf["torch_dtype"] = dtype == ExportDtype::bf16 ? "bfloat16" : "float32";
  const std::string path = (std::filesystem::path(folder) / "config.json").string();
  std::ofstream out(path);
  out << hf.dump(2) << "\n";
  if (!out) throw core::Error("cannot write " + path);
}

}  // namespace models::qwen3
