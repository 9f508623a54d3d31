// Tests: reading a Hugging Face Qwen3 folder (config.json + model.safetensors, or a sharded
// model.safetensors.index.json) into a slab's master weights, in the typed Qwen3 config (the
// programs go through models/hf_folder.h with the family's spec).
#pragma once

#include <string>

#include "models/qwen3/config.h"
#include "optim/slab.h"

namespace models::qwen3 {

// Reads `folder`/config.json (core::InputError naming the file and key).
Qwen3Config read_hf_config(const std::string& folder);

// Copies every weight of the folder into `slab`'s master (which must hold the whole model, and
// live on the cpu). Throws core::InputError naming the file and tensor on a missing tensor, an
// unexpected one or a shape mismatch.
void load_hf_weights(const std::string& folder, const Qwen3Config& config, optim::Slab& slab);

}  // namespace models::qwen3
