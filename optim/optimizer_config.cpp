#include "optim/optimizer_config.h"

#include <cmath>
#include <map>
#include <set>

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

bool read_bool(const YAML::Node& node, const std::string& file, const std::string& key) {
  try {
    return node.as<bool>();
  } catch (const YAML::Exception&) {
    throw core::InputError(location(file, node, key) + ": expected true or false, got '" +
                           (node.IsScalar() ? node.Scalar() : std::string("a non-scalar value")) + "'");
  }
}

std::int64_t read_integer(const YAML::Node& node, const std::string& file, const std::string& key) {
  try {
    return node.as<std::int64_t>();
  } catch (const YAML::Exception&) {
    throw core::InputError(location(file, node, key) + ": expected an integer, got '" +
                           (node.IsScalar() ? node.Scalar() : std::string("a non-scalar value")) + "'");
  }
}

// A string key with a fixed set of values.
template <typename Enum>
Enum read_choice(const YAML::Node& node, const std::string& file, const std::string& key,
                 const std::map<std::string, Enum>& choices) {
  const std::string value = node.IsScalar() ? node.Scalar() : "";
  const auto it = choices.find(value);
  if (it != choices.end()) return it->second;
  std::string names;
  for (const auto& [name, _] : choices) names += (names.empty() ? "" : ", ") + name;
  throw core::InputError(location(file, node, key) + ": expected one of [" + names + "], got '" + value + "'");
}

void check(bool ok, const std::string& where, const std::string& key, const std::string& expected, double value) {
  if (!ok) {
    throw core::InputError(where + ": optimizer." + key + ": expected " + expected + ", got " + std::to_string(value));
  }
}

// Keys that only one optimizer type reads.
const std::map<std::string, std::string>& type_specific_keys() {
  static const std::map<std::string, std::string> keys = {
      {"betas", "adamw, adamw8bit"},     {"eps", "adamw, adamw8bit"},       {"min_8bit_size", "adamw8bit"},
      {"quantization", "adamw8bit"},     {"eps1", "adafactor"},             {"eps2", "adafactor"},
      {"clip_threshold", "adafactor"},   {"decay_rate", "adafactor"},       {"beta1", "adafactor"},
      {"relative_step", "adafactor"},    {"scale_parameter", "adafactor"},  {"warmup_init", "adafactor"},
      {"eps1_mode", "adafactor"},        {"decay_scale", "adafactor"},
  };
  return keys;
}

}  // namespace

const std::vector<std::string>& optimizer_config_keys() {
  static const std::vector<std::string> keys = {
      "type",          "lr",         "betas",     "eps",        "weight_decay",  "grad_clip",     "nonfinite",
      "min_8bit_size", "quantization", "eps1",    "eps2",       "clip_threshold", "decay_rate",   "beta1",
      "relative_step", "scale_parameter", "warmup_init", "eps1_mode", "decay_scale"};
  return keys;
}

const char* nonfinite_policy_name(NonFinitePolicy policy) {
  return policy == NonFinitePolicy::skip_step ? "skip_step" : "zero_element";
}

void validate(const OptimizerConfig& c, const std::string& where) {
  if (c.type != "adamw" && c.type != "adamw8bit" && c.type != "adafactor") {
    throw core::InputError(where + ": optimizer.type: expected one of [adamw, adamw8bit, adafactor], got '" + c.type + "'");
  }
  check(std::isfinite(c.lr) && c.lr >= 0, where, "lr", "a finite number >= 0", c.lr);
  check(c.beta1 >= 0 && c.beta1 < 1, where, "betas[0]", "a number in [0, 1)", c.beta1);
  check(c.beta2 >= 0 && c.beta2 < 1, where, "betas[1]", "a number in [0, 1)", c.beta2);
  check(std::isfinite(c.eps) && c.eps > 0, where, "eps", "a finite number > 0", c.eps);
  check(std::isfinite(c.weight_decay) && c.weight_decay >= 0, where, "weight_decay", "a finite number >= 0",
        c.weight_decay);
  check(std::isfinite(c.grad_clip) && c.grad_clip >= 0, where, "grad_clip", "a finite number >= 0 (0 disables)",
        c.grad_clip);
  check(c.adamw8bit.min_8bit_size >= 0, where, "min_8bit_size", "an integer >= 0",
        static_cast<double>(c.adamw8bit.min_8bit_size));
  const AdafactorConfig& a = c.adafactor;
  check(std::isfinite(a.eps1) && a.eps1 >= 0, where, "eps1", "a finite number >= 0", a.eps1);
  check(std::isfinite(a.eps2) && a.eps2 >= 0, where, "eps2", "a finite number >= 0", a.eps2);
  check(std::isfinite(a.clip_threshold) && a.clip_threshold > 0, where, "clip_threshold", "a finite number > 0",
        a.clip_threshold);
  check(a.decay_rate < 0 && a.decay_rate >= -1, where, "decay_rate", "a number in [-1, 0)", a.decay_rate);
  if (a.beta1) check(*a.beta1 >= 0 && *a.beta1 < 1, where, "beta1", "a number in [0, 1) or null", *a.beta1);
}

OptimizerConfig optimizer_config_from_yaml(const YAML::Node& node, const std::string& file) {
  OptimizerConfig c;
  if (!node.IsMap()) throw core::InputError(file + ": optimizer: expected a mapping of optimizer settings");
  if (node["type"]) c.type = node["type"].IsScalar() ? node["type"].Scalar() : "";
  for (const auto& item : node) {
    const std::string key = item.first.as<std::string>();
    const YAML::Node& value = item.second;
    const auto specific = type_specific_keys().find(key);
    if (specific != type_specific_keys().end() && specific->second.find(c.type) == std::string::npos) {
      throw core::InputError(location(file, item.first, key) + ": applies to " + specific->second +
                             " only, but optimizer.type is '" + c.type + "'");
    }
    AdafactorConfig& a = c.adafactor;
    if (key == "type") {
      // read above
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
      c.nonfinite = read_choice<NonFinitePolicy>(
          value, file, key, {{"skip_step", NonFinitePolicy::skip_step}, {"zero_element", NonFinitePolicy::zero_element}});
    } else if (key == "min_8bit_size") {
      c.adamw8bit.min_8bit_size = read_integer(value, file, key);
    } else if (key == "quantization") {
      c.adamw8bit.quantization = read_choice<Quantization>(
          value, file, key, {{"companded", Quantization::companded}, {"linear", Quantization::linear}});
    } else if (key == "eps1") {
      a.eps1 = read_number(value, file, key);
    } else if (key == "eps2") {
      a.eps2 = read_number(value, file, key);
    } else if (key == "clip_threshold") {
      a.clip_threshold = read_number(value, file, key);
    } else if (key == "decay_rate") {
      a.decay_rate = read_number(value, file, key);
    } else if (key == "beta1") {
      if (value.IsNull()) {
        a.beta1.reset();
      } else {
        a.beta1 = read_number(value, file, key);
      }
    } else if (key == "relative_step") {
      a.relative_step = read_bool(value, file, key);
    } else if (key == "scale_parameter") {
      a.scale_parameter = read_bool(value, file, key);
    } else if (key == "warmup_init") {
      a.warmup_init = read_bool(value, file, key);
    } else if (key == "eps1_mode") {
      a.eps1_mode = read_choice<Eps1Mode>(value, file, key, {{"add", Eps1Mode::add}, {"clamp", Eps1Mode::clamp}});
    } else if (key == "decay_scale") {
      a.decay_scale = read_choice<DecayScale>(value, file, key, {{"lr", DecayScale::lr}, {"alpha", DecayScale::alpha}});
    } else {
      std::string known;
      for (const auto& name : optimizer_config_keys()) known += (known.empty() ? "" : ", ") + name;
      throw core::InputError(location(file, item.first, key) + ": unknown key (known: " + known + ")");
    }
  }
  const int line = node.Mark().line;
  validate(c, line >= 0 ? file + ":" + std::to_string(line + 1) : file);
  return c;
}

}  // namespace optim
