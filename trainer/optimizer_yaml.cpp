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
const Choices<optim::MuonAdjustLr> kMuonAdjustLr{
    {{"original", optim::MuonAdjustLr::original}, {"match_rms_adamw", optim::MuonAdjustLr::match_rms_adamw}}};

// The keys of the `muon` subsection, in the order they are written.
const std::vector<std::string> kMuonKeys = {"lr",  "momentum",     "nesterov", "ns_steps",
                                            "eps", "weight_decay", "adjust_lr"};

std::string muon_keys() {
  std::string known;
  for (const auto& k : kMuonKeys) known += (known.empty() ? "" : ", ") + k;
  return known;
}

void read_muon(const YAML::Node& node, const std::string& file, OptimizerConfig& c) {
  if (!node.IsMap()) {
    throw core::InputError(location(file, node, "muon") + ": expected a mapping of Muon settings (keys: " +
                           muon_keys() + "), got '" + got(node) + "'");
  }
  optim::MuonConfig& m = c.muon;
  for (const auto& item : node) {
    const std::string name = item.first.IsScalar() ? item.first.Scalar() : got(item.first);
    const std::string key = "muon." + name;
    const YAML::Node& v = item.second;
    if (name == "lr") {
      m.lr = number(v, file, key);
    } else if (name == "momentum") {
      m.momentum = number(v, file, key);
    } else if (name == "nesterov") {
      m.nesterov = read_as<bool>(v, file, key, "true or false");
    } else if (name == "ns_steps") {
      m.ns_steps = read_as<std::int64_t>(v, file, key, "an integer");
    } else if (name == "eps") {
      m.eps = number(v, file, key);
    } else if (name == "weight_decay") {
      if (v.IsNull()) {
        m.weight_decay.reset();
      } else {
        m.weight_decay = number(v, file, key);
      }
    } else if (name == "adjust_lr") {
      m.adjust_lr = kMuonAdjustLr.read(v, file, key);
    } else {
      throw core::InputError(location(file, item.first, key) + ": unknown key (known: " + muon_keys() + ")");
    }
  }
}

void write_muon(YAML::Emitter& o, const OptimizerConfig& c) {
  const optim::MuonConfig& m = c.muon;
  o << YAML::Key << "muon" << YAML::Value << YAML::BeginMap;
  o << YAML::Key << "lr" << YAML::Value << yaml_number(m.lr);
  o << YAML::Key << "momentum" << YAML::Value << yaml_number(m.momentum);
  o << YAML::Key << "nesterov" << YAML::Value << m.nesterov;
  o << YAML::Key << "ns_steps" << YAML::Value << m.ns_steps;
  o << YAML::Key << "eps" << YAML::Value << yaml_number(m.eps);
  o << YAML::Key << "weight_decay" << YAML::Value;
  if (m.weight_decay) {
    o << yaml_number(*m.weight_decay);
  } else {
    o << YAML::Null;
  }
  o << YAML::Key << "adjust_lr" << YAML::Value << kMuonAdjustLr.name(m.adjust_lr);
  o << YAML::EndMap;
}

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
      {"betas", "adamw, adamw8bit, muon",
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
      LLMTRAIN_OPT_NUMBER("eps", "adamw, adamw8bit, muon", eps),
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
      {"muon", "muon", read_muon, write_muon},
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
