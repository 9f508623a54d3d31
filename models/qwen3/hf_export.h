// Writing a Hugging Face Qwen3 folder (config.json + model.safetensors, bf16 or fp32) from the
// master weights of a whole model, splitting our fused q/k/v and gate/up tensors into the
// q_proj/k_proj/v_proj and gate_proj/up_proj that transformers expects. A tied model writes no
// lm_head.weight (transformers ties it to the embedding).
#pragma once

#include <string>

#include "models/qwen3/config.h"
#include "optim/slab_layout.h"

namespace models::qwen3 {

enum class ExportDtype { bf16, fp32 };

// `master`: fp32 weights of the whole slab, global element order of `layout`.
void write_hf_folder(const std::string& folder, const Qwen3Config& config, const optim::SlabLayout& layout,
                     const float* master, ExportDtype dtype);

}  // namespace models::qwen3
