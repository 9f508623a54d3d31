// The `optimizer` section of a run's config in YAML: one table of keys, read (types, ranges, keys
// of another optimizer type refused) and written back from the same rows. YAML stays in trainer/;
// optim/ holds the config struct and its validation (optim/optimizer_config.h).
#pragma once

#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "optim/optimizer_config.h"

namespace trainer {

// Reads an `optimizer:` mapping. Keys: type, lr, weight_decay, grad_clip, nonfinite; adamw,
// adamw8bit and muon: betas, eps; adamw8bit: min_8bit_size, quantization; adafactor: eps1, eps2,
// clip_threshold, decay_rate, beta1, relative_step, scale_parameter, warmup_init, eps1_mode,
// decay_scale; muon: the subsection muon {lr, momentum, nesterov, ns_steps, eps, weight_decay,
// adjust_lr} (the other keys then set the AdamW of the tensors that are not hidden matrices). Unknown keys, keys of
// another optimizer type, wrong types and out-of-range values throw core::InputError naming `file`, the line and the
// key.
optim::OptimizerConfig optimizer_config_from_yaml(const YAML::Node& node, const std::string& file);

// Writes the keys of `config`'s type into the open map of `out` (grad_clip is written by the
// training section).
void emit_optimizer_config(YAML::Emitter& out, const optim::OptimizerConfig& config);

// Every key optimizer_config_from_yaml reads, in table order.
std::vector<std::string> optimizer_config_keys();

// A double as the shortest text that reads back to the same value.
std::string yaml_number(double value);

}  // namespace trainer
