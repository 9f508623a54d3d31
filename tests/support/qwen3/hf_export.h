// Tests: writing a Hugging Face Qwen3 folder from the master weights of a whole model, in the
// typed Qwen3 config, through models/hf_folder.h (q/k/v and gate/up split, a tied model
// without lm_head.weight).
#pragma once

#include <string>

#include "models/hf_folder.h"
#include "models/qwen3/config.h"
#include "optim/slab_layout.h"

namespace models::qwen3 {

using models::ExportDtype;

// `master`: fp32 weights of the whole slab, global element order of `layout`.
void write_hf_folder(const std::string& folder, const Qwen3Config& config, const optim::SlabLayout& layout,
                     const float* master, ExportDtype dtype);

}  // namespace models::qwen3
