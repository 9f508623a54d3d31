#include "support/qwen3/hf_export.h"

#include "models/qwen3/family.h"

namespace models::qwen3 {

void write_hf_folder(const std::string& folder, const Qwen3Config& config, const optim::SlabLayout& layout,
                     const float* master, ExportDtype dtype) {
  models::write_hf_folder(folder, *qwen3_family().spec(shape_from_config(config)), layout, master, dtype);
}

}  // namespace models::qwen3
