#include "trainer/optimizer_yaml.h"

#include <algorithm>
#include <charconv>
#include <sstream>
#include <map>

#include "core/error.h"

namespace trainer {

namespace {

using optim::OptimizerConfig;

std::string location(const std::string& file, const YAML::Node& node, const std::string& key) {
  std::string s = file;
  if (node.Mark().line >= 0) s += ":" + std::to_string(node.Mark().line + 1);
  return s + ": optimizer." + key;
}

std::string got(const YAML::Node& node) { return node.IsScalar() ? node.Scalar() : std::string("a non-scalar value"); }

template <typename T>
T read_as(const YAML::Node& node, const std::string& file, const std::string& key, const char* expected) {
  try {
    return node.as<T>();
  } catch (const YAML::Exception&) {
    throw core::InputError(location(file, node, key) + ": expected " + expected + ", got '" + got(node) + "'");
  }
}

double number(const YAML::Node& n, const std::string& file, const std::string& key) {
  return read_as<double>(n, file, key, "a number");
}

// A string key with a fixed set of values; the same names are written back.
template <typename Enum>
struct Choices {
  std::map<std::string, Enum> names;

  Enum read(const YAML::Node& node, const std::string& file, const std::string& key) const {
    const std::string value = node.IsScalar() ? node.Scalar() : "";
    const auto it = names.find(value);
    if (it != names.end()) return it->second;
    std::string list;
    for (const auto& [name, _] : names) list += (list.empty() ? "" : ", ") + name;
    throw core::InputError(location(file, node, key) + ": expected one of [" + list + "], got '" + value + "'");
  }
  std::string name(Enum e) const {
    for (const auto& [name, value] : names) {
      if (value == e) return name;
    }
    return "";
  }
};

const Choices<optim::NonFinitePolicy> kNonFinite{
    {{"skip_step", optim::NonFinitePolicy::skip_step}, {"zero_element", optim::NonFinitePolicy::zero_element}}};
const Choices<optim::Quantization> kQuantization{
    {{"companded", optim::Quantization::companded}, {"linear", optim::Quantization::linear}}};
const Choices<optim::Eps1Mode> kEps1Mode{{{"add", optim::Eps1Mode::add}, {"clamp", optim::Eps1Mode::clamp}}};
const Choices<optim::DecayScale> kDecayScale{{{"lr", optim::DecayScale::lr}, {"alpha", optim::DecayScale::alpha}}};

using Read = void (*)(const YAML::Node&, const std::string&, OptimizerConfig&);
using Write = void (*)(YAML::Emitter&, const OptimizerConfig&);

// One key: the optimizer types that read it (empty: all), how it is read and written back
// (nullptr: not written here).
struct Key {
  std::string name;
  std::string types;
  Read read;
  Write write;
};

// A member of OptimizerConfig (or of one of its parts) of a plain type, read and written as itself.
#define LLMTRAIN_OPT_NUMBER(key, types, member)                                                                      \
  Key {                                                                                                              \
    key, types, [](const YAML::Node& n, const std::string& f, OptimizerConfig& c) { c.member = number(n, f, key); }, \
        [](YAML::Emitter& o, const OptimizerConfig& c) {                                                             \
          o << YAML::Key << key << YAML::Value << yaml_number(c.member);                                             \
        }                                                                                                            \
  }
#define LLMTRAIN_OPT_BOOL(key, member)                                                                       \
  Key {                                                                                                      \
    key, "adafactor",                                                                                        \
        [](const YAML::Node& n, const std::string& f, OptimizerConfig& c) {                                  \
          c.member = read_as<bool>(n, f, key, "true or false");                                              \
        },                                                                                                   \
        [](YAML::Emitter& o, const OptimizerConfig& c) { o << YAML::Key << key << YAML::Value << c.member; } \
  }
#define LLMTRAIN_OPT_CHOICE(key, types, member, choices)                                                           \
  Key {                                                                                                            \
    key, types,                                                                                                    \
        [](const YAML::Node& n, const std::string& f, OptimizerConfig& c) { c.member = choices.read(n, f, key); }, \
        [](YAML::Emitter& o, const OptimizerConfig& c) {                                                           \
          o << YAML::Key << key << YAML::Value << choices.name(c.member);                                          \
        }                                                                                                          \
  }

// The schema, in the order the keys are written.
const std::vector<Key>& keys() {
  static const std::vector<Key> table = {
      {"type", "", [](const YAML::Node&, const std::string&, OptimizerConfig&) {},  // read first, see below
       [](YAML::Emitter& o, const OptimizerConfig& c) { o << YAML::Key << "type" << YAML::Value << c.type; }},
      LLMTRAIN_OPT_NUMBER("lr", "", lr),
      LLMTRAIN_OPT_NUMBER("weight_decay", "", weight_decay),
      {"grad_clip", "",
       [](const YAML::Node& n, const std::string& f, OptimizerConfig& c) { c.grad_clip = number(n, f, "grad_clip"); },
       nullptr},
      LLMTRAIN_OPT_CHOICE("nonfinite", "", nonfinite, kNonFinite),
      {"betas", "adamw, adamw8bit",
       [](const YAML::Node& n, const std::string& f, OptimizerConfig& c) {
         if (!n.IsSequence() || n.size() != 2) {
           throw core::InputError(location(f, n, "betas") + ": expected a list of two numbers [beta1, beta2]");
         }
         c.beta1 = number(n[0], f, "betas[0]");
         c.beta2 = number(n[1], f, "betas[1]");
       },
       [](YAML::Emitter& o, const OptimizerConfig& c) {
         o << YAML::Key << "betas" << YAML::Value << YAML::Flow << YAML::BeginSeq << yaml_number(c.beta1)
           << yaml_number(c.beta2) << YAML::EndSeq;
       }},
      LLMTRAIN_OPT_NUMBER("eps", "adamw, adamw8bit", eps),
      {"min_8bit_size", "adamw8bit",
       [](const YAML::Node& n, const std::string& f, OptimizerConfig& c) {
         c.adamw8bit.min_8bit_size = read_as<std::int64_t>(n, f, "min_8bit_size", "an integer");
       },
       [](YAML::Emitter& o, const OptimizerConfig& c) {
         o << YAML::Key << "min_8bit_size" << YAML::Value << c.adamw8bit.min_8bit_size;
       }},
      LLMTRAIN_OPT_CHOICE("quantization", "adamw8bit", adamw8bit.quantization, kQuantization),
      LLMTRAIN_OPT_NUMBER("eps1", "adafactor", adafactor.eps1),
      LLMTRAIN_OPT_NUMBER("eps2", "adafactor", adafactor.eps2),
      LLMTRAIN_OPT_NUMBER("clip_threshold", "adafactor", adafactor.clip_threshold),
      LLMTRAIN_OPT_NUMBER("decay_rate", "adafactor", adafactor.decay_rate),
      {"beta1", "adafactor",
       [](const YAML::Node& n, const std::string& f, OptimizerConfig& c) {
         if (n.IsNull()) {
           c.adafactor.beta1.reset();
         } else {
           c.adafactor.beta1 = number(n, f, "beta1");
         }
       },
       [](YAML::Emitter& o, const OptimizerConfig& c) {
         o << YAML::Key << "beta1" << YAML::Value;
         if (c.adafactor.beta1) {
           o << yaml_number(*c.adafactor.beta1);
         } else {
           o << YAML::Null;
         }
       }},
      LLMTRAIN_OPT_BOOL("relative_step", adafactor.relative_step),
      LLMTRAIN_OPT_BOOL("scale_parameter", adafactor.scale_parameter),
      LLMTRAIN_OPT_BOOL("warmup_init", adafactor.warmup_init),
      LLMTRAIN_OPT_CHOICE("eps1_mode", "adafactor", adafactor.eps1_mode, kEps1Mode),
      LLMTRAIN_OPT_CHOICE("decay_scale", "adafactor", adafactor.decay_scale, kDecayScale),
  };
  return table;
}

#undef LLMTRAIN_OPT_NUMBER
#undef LLMTRAIN_OPT_BOOL
#undef LLMTRAIN_OPT_CHOICE

// Whether `type` is one of the key's types (a whole name: adamw is not adamw8bit).
bool applies(const Key& key, const std::string& type) {
  if (key.types.empty()) return true;
  std::istringstream names(key.types);
  std::string name;
  while (std::getline(names >> std::ws, name, ',')) {
    if (name == type) return true;
  }
  return false;
}

}  // namespace

std::string yaml_number(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

std::vector<std::string> optimizer_config_keys() {
  std::vector<std::string> names;
  for (const Key& k : keys()) names.push_back(k.name);
  return names;
}

OptimizerConfig optimizer_config_from_yaml(const YAML::Node& node, const std::string& file) {
  OptimizerConfig c;
  if (!node.IsMap()) throw core::InputError(file + ": optimizer: expected a mapping of optimizer settings");
  // The type first: it decides which other keys apply.
  if (node["type"]) c.type = node["type"].IsScalar() ? node["type"].Scalar() : "";
  for (const auto& item : node) {
    const std::string name = item.first.as<std::string>();
    const auto& table = keys();
    const auto key = std::find_if(table.begin(), table.end(), [&](const Key& k) { return k.name == name; });
    if (key == table.end()) {
      std::string known;
      for (const auto& n : optimizer_config_keys()) known += (known.empty() ? "" : ", ") + n;
      throw core::InputError(location(file, item.first, name) + ": unknown key (known: " + known + ")");
    }
    if (!applies(*key, c.type)) {
      throw core::InputError(location(file, item.first, name) + ": applies to " + key->types +
                             " only, but optimizer.type is '" + c.type + "'");
    }
    key->read(item.second, file, c);
  }
  const int line = node.Mark().line;
  optim::validate(c, line >= 0 ? file + ":" + std::to_string(line + 1) : file);
  return c;
}

void emit_optimizer_config(YAML::Emitter& out, const OptimizerConfig& config) {
  for (const Key& key : keys()) {
    if (key.write && applies(key, config.type)) key.write(out, config);
  }
}

}  // namespace trainer
