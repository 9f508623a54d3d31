// The `optimizer` section of a run's config, validated. Hyper-parameters are kept in double,
// as PyTorch keeps them, and rounded to fp32 only where the element formulas use them.
#pragma once

#include <string>

#include <yaml-cpp/yaml.h>

#include "optim/step_scalars.h"

namespace optim {

struct OptimizerConfig {
  std::string type = "adamw";
  double lr = 3e-4;            // peak learning rate (a schedule scales it per step)
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;   // decoupled; applied only to tensors with decay
  double grad_clip = 1.0;      // max global L2 norm of the gradients; 0 disables clipping
  NonFinitePolicy nonfinite = NonFinitePolicy::skip_step;
};

// Throws core::InputError naming `where` and the key when a value is out of range.
void validate(const OptimizerConfig& config, const std::string& where);

// Reads an `optimizer:` mapping (keys: type, lr, betas, eps, weight_decay, grad_clip, nonfinite).
// Unknown keys, wrong types and out-of-range values throw core::InputError naming `file`,
// the line and the key.
OptimizerConfig optimizer_config_from_yaml(const YAML::Node& node, const std::string& file);

const char* nonfinite_policy_name(NonFinitePolicy policy);

}  // namespace optim
