// What build/generate and build/evaluate share: a model read from a Hugging Face folder or a
// checkpoint (trainer::load_pretrained) onto a device, with its tokenizer and end-of-sequence ids.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/device.h"
#include "optim/slab.h"
#include "text/tokenizer.h"
#include "trainer/pretrained.h"

namespace tools {

struct ModelSource {
  trainer::PretrainedWeights weights;
  std::unique_ptr<text::Tokenizer> tokenizer;
  // config.json's and generation_config.json's eos_token_id (a checkpoint: its carried config.json).
  std::vector<std::int32_t> eos_ids;
  std::string device;  // "cpu" or "cuda"
  std::unique_ptr<core::DeviceContext> context;
  std::unique_ptr<optim::Slab> slab;  // the weights: fp32 master, and the bf16 mirror on cuda
};

// `device`: "cpu", "cuda" or "" (cuda when a GPU is present); `tokenizer`: "byte", a
// tokenizer.json, or "" (the folder's tokenizer.json, the run's data.tokenizer, else bytes).
// core::InputError for a missing path, an absent GPU or tokenizer, and whatever load_pretrained refuses.
ModelSource load_model_source(const std::string& path, const std::string& device, const std::string& tokenizer);

}  // namespace tools
