#include "optim/optimizer_config.h"

#include <cmath>

#include "core/error.h"

namespace optim {

namespace {

std::string location(const std::string& file, const YAML::Node& node, const std::string& key) {
  std::string s = file;
  if (node.Mark().line >= 0) s += ":" + std::to_string(node.Mark().line + 1);
  return s + ": optimizer." + key;
}

double read_number(const YAML::Node& node, const std::string& file, const std::string& key) {
  try {
    return node.as<double>();
  } catch (const YAML::Exception&) {
    throw core::InputError(location(file, node, key) + ": expected a number, got '" +
                           (node.IsScalar() ? node.Scalar() : std::string("a non-scalar value")) + "'");
  }
}

void check(bool ok, const std::string& where, const std::string& key, const std::string& expected, double value) {
  if (!ok) {
    throw core::InputError(where + ": optimizer." + key + ": expected " + expected + ", got " + std::to_string(value));
  }
}

}  // namespace

const char* nonfinite_policy_name(NonFinitePolicy policy) {
  return policy == NonFinitePolicy::skip_step ? "skip_step" : "zero_element";
}

void validate(const OptimizerConfig& c, const std::string& where) {
  if (c.type != "adamw") {
    throw core::InputError(where + ": optimizer.type: expected one of [adamw], got '" + c.type + "'");
  }
  check(std::isfinite(c.lr) && c.lr >= 0, where, "lr", "a finite number >= 0", c.lr);
  check(c.beta1 >= 0 && c.beta1 < 1, where, "betas[0]", "a number in [0, 1)", c.beta1);
  check(c.beta2 >= 0 && c.beta2 < 1, where, "betas[1]", "a number in [0, 1)", c.beta2);
  check(std::isfinite(c.eps) && c.eps > 0, where, "eps", "a finite number > 0", c.eps);
  check(std::isfinite(c.weight_decay) && c.weight_decay >= 0, where, "weight_decay", "a finite number >= 0",
        c.weight_decay);
  check(std::isfinite(c.grad_clip) && c.grad_clip >= 0, where, "grad_clip", "a finite number >= 0 (0 disables)",
        c.grad_clip);
}

OptimizerConfig optimizer_config_from_yaml(const YAML::Node& node, const std::string& file) {
  OptimizerConfig c;
  if (!node.IsMap()) throw core::InputError(file + ": optimizer: expected a mapping of optimizer settings");
  for (const auto& item : node) {
    const std::string key = item.first.as<std::string>();
    const YAML::Node& value = item.second;
    if (key == "type") {
      c.type = value.as<std::string>();
    } else if (key == "lr") {
      c.lr = read_number(value, file, key);
    } else if (key == "betas") {
      if (!value.IsSequence() || value.size() != 2) {
        throw core::InputError(location(file, value, key) + ": expected a list of two numbers [beta1, beta2]");
      }
      c.beta1 = read_number(value[0], file, "betas[0]");
      c.beta2 = read_number(value[1], file, "betas[1]");
    } else if (key == "eps") {
      c.eps = read_number(value, file, key);
    } else if (key == "weight_decay") {
      c.weight_decay = read_number(value, file, key);
    } else if (key == "grad_clip") {
      c.grad_clip = read_number(value, file, key);
    } else if (key == "nonfinite") {
      const std::string policy = value.as<std::string>();
      if (policy == "skip_step") {
        c.nonfinite = NonFinitePolicy::skip_step;
      } else if (policy == "zero_element") {
        c.nonfinite = NonFinitePolicy::zero_element;
      } else {
        throw core::InputError(location(file, value, key) + ": expected skip_step or zero_element, got '" + policy + "'");
      }
    } else {
      throw core::InputError(location(file, item.first, key) +
                             ": unknown key (known: type, lr, betas, eps, weight_decay, grad_clip, nonfinite)");
    }
  }
  const int line = node.Mark().line;
  validate(c, line >= 0 ? file + ":" + std::to_string(line + 1) : file);
  return c;
}

}  // namespace optim
