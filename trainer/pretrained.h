// Weights to start from or to read: a Hugging Face folder (config.json + safetensors) or a
// checkpoint (a step directory, or a run directory meaning its newest complete step), through
// the model interface. The shape comes from the folder's config.json or the checkpoint's
// manifest; the weights are fp32 over the whole slab of that shape (world size 1 layout).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/model.h"
#include "optim/slab_layout.h"
#include "trainer/config.h"

namespace trainer {

struct PretrainedWeights {
  std::unique_ptr<models::ModelSpec> spec;
  optim::SlabLayout layout;   // parameters of spec, world size 1
  std::vector<float> master;  // fp32, global element order of layout
  // Keys of the source's config.json to carry into an export (token ids, metadata); empty for
  // checkpoints that recorded none.
  nlohmann::json carried_hf_config;
  std::string tokenizer;   // data.tokenizer of the run that wrote a checkpoint ("byte", a path, or "")
  std::string checkpoint;  // the step directory read; empty for a Hugging Face folder
};

// Whether `path` looks like a checkpoint (step or run directory, a run's before its first
// checkpoint too: it has the trainer's config.yaml) rather than a Hugging Face folder.
bool is_checkpoint_path(const std::string& path);

// With model.init_from: the shape of the folder's config.json or the checkpoint's manifest, which
// the keys the config gave (and its preset's) must equal: core::InputError naming the key and both
// values; also for what the family cannot represent or a file that is not valid JSON. Returns
// `config` with that shape and the source's config.json keys to carry; unchanged without init_from.
RunConfig resolve_init_from(const RunConfig& config);

// Reads `path` (Hugging Face folder or checkpoint). Throws core::InputError naming the file and
// key on anything malformed or unsupported.
PretrainedWeights load_pretrained(const std::string& path);

}  // namespace trainer
