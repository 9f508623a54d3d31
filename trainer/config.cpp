// The run configuration: overrides applied to the YAML tree, then each section read with its key
// set, types and ranges checked; the resolved config written back as YAML.
#include "trainer/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string_view>

#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "models/model_config.h"
#include "models/registry.h"

namespace trainer {

namespace {

// The keys of each section, in the order resolved_yaml writes them.
const std::vector<std::string>& top_level_keys() {
  static const std::vector<std::string> keys = {"run",      "device",   "model",      "data", "training", "optimizer",
                                                "schedule", "parallel", "checkpoint", "eval", "logging",  "sample"};
  return keys;
}

// Bounds that keep every product of batch sizes far from overflow and a step finite in time.
constexpr std::int64_t kMaxMicroTokens = std::int64_t{1} << 31;  // int32 token indexing on the device
constexpr std::int64_t kMaxAccumulation = 1 << 16;               // micro-batches per rank per step

// Every family's field keys (a model section is checked against its own family after arch is read).
std::vector<std::string> model_shape_keys() {
  std::vector<std::string> keys;
  for (const models::Family* family : models::families()) {
    for (const models::ConfigField& f : family->fields()) {
      if (std::find(keys.begin(), keys.end(), f.key) == keys.end()) keys.push_back(f.key);
    }
  }
  return keys;
}

const std::map<std::string, std::vector<std::string>>& section_keys() {
  // Built at the first use: a program adds its own families (models::add_family) before that.
  static const std::map<std::string, std::vector<std::string>> sections = [] {
    std::map<std::string, std::vector<std::string>> s = {
        {"run", {"name", "output_dir", "seed"}},
        {"model", {"arch", "preset", "init_from"}},
        {"data", {"train", "val", "seq_len", "tokenizer"}},
        {"training", {"micro_batch_size", "global_batch_size", "max_steps", "precision", "grad_clip"}},
        {"optimizer", {}},
        {"schedule", {"type", "warmup_steps", "min_lr_ratio", "decay_ratio"}},
        {"parallel", {"zero_stage", "timeout_s"}},
        {"checkpoint", {"every", "keep_last", "resume", "at_end", "allow_data_change"}},
        {"eval", {"every", "batches", "tasks", "tasks_every", "tasks_limit", "decoder"}},
        {"logging", {"every", "tensorboard"}},
        {"sample", {"every", "tokens", "prompt"}},
    };
    for (const auto& key : model_shape_keys()) s["model"].push_back(key);
    for (const auto& key : optim::optimizer_config_keys()) {
      if (key != "grad_clip") s["optimizer"].push_back(key);
    }
    return s;
  }();
  return sections;
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// "unknown key (did you mean 'x'?)", falling back to the key in another section, then to the list.
std::string unknown_key_message(const std::string& section, const std::string& key) {
  const std::vector<std::string>& known = section.empty() ? top_level_keys() : section_keys().at(section);
  std::string best;
  std::size_t best_distance = std::max<std::size_t>(2, key.size() / 3) + 1;
  for (const auto& candidate : known) {
    const std::size_t d = edit_distance(key, candidate);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  if (section == "optimizer" && key == "grad_clip") {
    return "not set here: the clipping threshold is training.grad_clip (copied into the optimizer)";
  }
  if (!best.empty()) return "unknown key (did you mean '" + best + "'?)";
  for (const auto& [other, keys] : section_keys()) {
    if (other != section && std::find(keys.begin(), keys.end(), key) != keys.end()) {
      return "unknown key (did you mean '" + other + "." + key + "'?)";
    }
  }
  return "unknown key (known: " + joined(known) + ")";
}

// Offset of the first byte of `text` that is not part of well-formed UTF-8, or npos. YAML is
// Unicode text; the emitter would write other bytes as U+FFFD and the resolved config would
// read back different.
std::size_t invalid_utf8_offset(std::string_view text) {
  for (std::size_t i = 0; i < text.size();) {
    const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
    const unsigned char lead = byte(i);
    std::size_t length = lead < 0x80 ? 1 : lead >= 0xC2 && lead <= 0xDF ? 2 : lead >= 0xE0 && lead <= 0xEF ? 3
                                     : lead >= 0xF0 && lead <= 0xF4 ? 4 : 0;
    if (length == 0 || i + length > text.size()) return i;
    const unsigned char low = lead == 0xE0 ? 0xA0 : lead == 0xF0 ? 0x90 : 0x80;
    const unsigned char high = lead == 0xED ? 0x9F : lead == 0xF4 ? 0x8F : 0xBF;
    for (std::size_t k = 1; k < length; ++k) {
      const unsigned char b = byte(i + k);
      if (k == 1 ? (b < low || b > high) : (b < 0x80 || b > 0xBF)) return i;
    }
    i += length;
  }
  return std::string_view::npos;
}

std::string format_double(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

std::string describe(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return "nothing";
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  return node.IsSequence() ? "a list" : "a mapping";
}

// Reads the tree, naming each key by its path and its origin (file line or override).
class Reader {
 public:
  Reader(std::string file, std::map<std::string, std::string> override_sources)
      : file_(std::move(file)), override_sources_(std::move(override_sources)) {}

  const std::string& file() const { return file_; }

  std::string where(const std::string& path, const YAML::Node& node) const {
    const auto it = override_sources_.find(path);
    if (it != override_sources_.end()) return it->second;
    if (node.IsDefined() && node.Mark().line >= 0) return file_ + ":" + std::to_string(node.Mark().line + 1);
    return file_;
  }

  [[noreturn]] void fail(const std::string& path, const YAML::Node& node, const std::string& message) const {
    throw core::InputError(where(path, node) + ": " + path + ": " + message);
  }

  // An optimizer error about a key set on the command line names the override.
  [[noreturn]] void rethrow_optimizer_error(const std::string& message) const {
    const std::size_t at = message.find("optimizer.");
    if (at != std::string::npos) {
      const std::size_t end = message.find_first_of(":[ ", at);
      const auto it = override_sources_.find(message.substr(at, end - at));
      if (it != override_sources_.end()) throw core::InputError(it->second + ": " + message.substr(at));
    }
    throw core::InputError(message);
  }

 private:
  std::string file_;
  std::map<std::string, std::string> override_sources_;
};

// One section: its keys checked on construction, typed getters that leave the default when absent.
class Section {
 public:
  Section(const Reader& reader, const YAML::Node& root, const std::string& name, bool required)
      : reader_(reader), name_(name), node_(root[name]), present_(node_.IsDefined() && !node_.IsNull()) {
    if (!present_) {
      if (required) reader_.fail(name, YAML::Node(), "missing required section");
      return;
    }
    if (!node_.IsMap()) reader_.fail(name, node_, "expected a mapping, got " + describe(node_));
    std::set<std::string> seen;
    for (const auto& item : node_) {
      const std::string key = item.first.Scalar();
      const std::vector<std::string>& known = section_keys().at(name);
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        reader_.fail(name + "." + key, item.first, unknown_key_message(name, key));
      }
      if (!seen.insert(key).second) reader_.fail(name + "." + key, item.first, "duplicate key");
    }
  }

  bool present() const { return present_; }
  const YAML::Node& node() const { return node_; }
  std::string path(const std::string& key) const { return name_ + "." + key; }
  YAML::Node value(const std::string& key) const {
    if (!present_) return YAML::Node();
    return node_[key];
  }
  bool has(const std::string& key) const {
    const YAML::Node v = value(key);
    return v.IsDefined() && !v.IsNull();
  }

  [[noreturn]] void fail(const std::string& key, const std::string& message) const {
    const YAML::Node v = value(key);
    reader_.fail(path(key), v.IsDefined() ? v : node_, message);
  }

  void require(const std::string& key, const std::string& expected) const {
    if (!has(key)) {
      reader_.fail(path(key), present_ ? node_ : YAML::Node(), "missing required key (expected " + expected + ")");
    }
  }

  void integer(const std::string& key, std::int64_t& out) const {
    if (!has(key)) return;
    try {
      out = value(key).as<std::int64_t>();
    } catch (const YAML::Exception&) {
      fail(key, "expected an integer, got " + describe(value(key)));
    }
  }

  void number(const std::string& key, double& out) const {
    if (!has(key)) return;
    const YAML::Node v = value(key);
    try {
      if (!v.IsScalar()) throw YAML::TypedBadConversion<double>(v.Mark());
      out = v.as<double>();
    } catch (const YAML::Exception&) {
      fail(key, "expected a number, got " + describe(v));
    }
  }

  void boolean(const std::string& key, bool& out) const {
    if (!has(key)) return;
    try {
      out = value(key).as<bool>();
    } catch (const YAML::Exception&) {
      fail(key, "expected true or false, got " + describe(value(key)));
    }
  }

  void string(const std::string& key, std::string& out) const {
    if (!has(key)) return;
    const YAML::Node v = value(key);
    if (!v.IsScalar()) fail(key, "expected a string, got " + describe(v));
    out = v.Scalar();
  }

  template <typename Enum>
  void choice(const std::string& key, Enum& out, const std::vector<std::pair<std::string, Enum>>& choices) const {
    if (!has(key)) return;
    const YAML::Node v = value(key);
    std::vector<std::string> names;
    for (const auto& [name, e] : choices) {
      if (v.IsScalar() && v.Scalar() == name) {
        out = e;
        return;
      }
      names.push_back(name);
    }
    fail(key, "expected one of [" + joined(names) + "], got " + describe(v));
  }

  // Range checks on a value already read.
  void check(bool ok, const std::string& key, const std::string& expected, const std::string& got) const {
    if (!ok) fail(key, "expected " + expected + ", got " + got);
  }
  void at_least(std::int64_t value, std::int64_t minimum, const std::string& key) const {
    check(value >= minimum, key, "an integer >= " + std::to_string(minimum), std::to_string(value));
  }

 private:
  const Reader& reader_;
  std::string name_;
  YAML::Node node_;
  bool present_;
};

void require_existing_path(const Section& section, const std::string& key, const std::string& value,
                           const std::string& what) {
  if (!std::filesystem::exists(value)) section.fail(key, what + " '" + value + "' does not exist");
}

// Token shards are read by size and offset: a FIFO, device or directory would block or mislead.
void require_regular_file(const Section& section, const std::string& key, const std::string& value) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(value, ec)) section.fail(key, "'" + value + "' is not a regular file");
}

// Applies `a.b=value` overrides to `root`, recording where each key came from.
std::map<std::string, std::string> apply_overrides(YAML::Node& root, const std::vector<std::string>& overrides) {
  std::map<std::string, std::string> sources;
  for (const auto& text : overrides) {
    const std::string origin = "command line override '" + text + "'";
    const std::size_t eq = text.find('=');
    if (eq == std::string::npos) {
      throw core::InputError(origin + ": expected SECTION.KEY=VALUE (e.g. training.max_steps=100)");
    }
    const std::string path = text.substr(0, eq);
    const std::string value_text = text.substr(eq + 1);
    const std::size_t dot = path.find('.');
    const std::string section = path.substr(0, dot);
    const auto& top = top_level_keys();
    if (std::find(top.begin(), top.end(), section) == top.end()) {
      throw core::InputError(origin + ": " + section + ": " + unknown_key_message("", section));
    }
    YAML::Node value;
    try {
      value = YAML::Load(value_text);
    } catch (const YAML::Exception& e) {
      throw core::InputError(origin + ": " + path + ": the value is not valid YAML: " + e.msg);
    }
    if (section == "device") {
      if (dot != std::string::npos) throw core::InputError(origin + ": device: expected device=VALUE");
      root["device"] = value;
      sources["device"] = origin;
      continue;
    }
    if (dot == std::string::npos) {
      throw core::InputError(origin + ": " + section + ": expected " + section + ".KEY=VALUE (a key inside the section)");
    }
    const std::string key = path.substr(dot + 1);
    const auto& known = section_keys().at(section);
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      throw core::InputError(origin + ": " + path + ": " + unknown_key_message(section, key));
    }
    if (root[section].IsDefined() && !root[section].IsNull() && !root[section].IsMap()) {
      throw core::InputError(origin + ": " + section + " is not a mapping in the config file");
    }
    root[section][key] = value;
    sources[path] = origin;
  }
  return sources;
}

// One field's YAML value as JSON of the field's type; the type and range checked.
nlohmann::json read_field(const Section& s, const models::ConfigField& f) {
  const YAML::Node v = s.value(f.key);
  nlohmann::json value;
  try {
    if (!v.IsScalar()) throw YAML::BadConversion(v.Mark());
    switch (f.type) {
      case models::FieldType::integer: value = v.as<std::int64_t>(); break;
      case models::FieldType::number: value = v.as<double>(); break;
      case models::FieldType::boolean: value = v.as<bool>(); break;
      case models::FieldType::choice: value = v.Scalar(); break;
    }
  } catch (const YAML::Exception&) {
    const char* expected = f.type == models::FieldType::integer  ? "an integer"
                           : f.type == models::FieldType::number ? "a number"
                           : f.type == models::FieldType::boolean ? "true or false"
                                                                  : "a string";
    s.fail(f.key, std::string("expected ") + expected + ", got " + describe(v));
  }
  if (auto problem = models::field_problem(f, value)) s.fail(f.key, *problem);
  return value;
}

void read_model(const Section& s, ModelConfig& m) {
  std::vector<std::string> names;
  for (const models::Family* f : models::families()) names.push_back(f->name());
  s.string("arch", m.arch);
  s.check(std::find(names.begin(), names.end(), m.arch) != names.end(), "arch", "one of [" + joined(names) + "]",
          "'" + m.arch + "'");
  const models::Family& family = models::family(m.arch);
  s.string("init_from", m.init_from);
  if (!m.init_from.empty()) require_existing_path(s, "init_from", m.init_from, "model folder or checkpoint");
  const auto presets = family.presets();
  if (m.init_from.empty()) s.require("preset", "one of [" + joined(presets) + "]");
  s.string("preset", m.preset);
  if (!m.preset.empty()) {
    s.check(std::find(presets.begin(), presets.end(), m.preset) != presets.end(), "preset",
            "one of [" + joined(presets) + "]", "'" + m.preset + "'");
  }
  m.shape = models::base_shape(family, m.preset);
  m.given.clear();
  for (const models::ConfigField& f : family.fields()) {
    if (!s.has(f.key)) continue;
    m.shape[f.key] = read_field(s, f);
    m.given.push_back(f.key);
  }
  if (s.present()) {
    for (const auto& item : s.node()) {
      const std::string key = item.first.Scalar();
      if (key == "arch" || key == "preset" || key == "init_from") continue;
      const auto& fields = family.fields();
      if (std::none_of(fields.begin(), fields.end(), [&](const models::ConfigField& f) { return f.key == key; })) {
        s.fail(key, "not a field of the " + m.arch + " family");
      }
    }
  }
  if (auto error = family.check(m.shape)) s.fail(error->key, error->message);
}

RunConfig read_config(const YAML::Node& root, const Reader& reader) {
  if (!root.IsMap()) {
    throw core::InputError(reader.file() + ": expected a mapping with the sections " + joined(top_level_keys()) +
                           ", got " + describe(root));
  }
  std::set<std::string> seen;
  for (const auto& item : root) {
    const std::string key = item.first.Scalar();
    const auto& top = top_level_keys();
    if (std::find(top.begin(), top.end(), key) == top.end()) reader.fail(key, item.first, unknown_key_message("", key));
    if (!seen.insert(key).second) reader.fail(key, item.first, "duplicate key");
  }

  RunConfig c;
  {
    const Section s(reader, root, "run", true);
    s.require("output_dir", "the directory for checkpoints, logs and the resolved config");
    s.string("name", c.run.name);
    s.string("output_dir", c.run.output_dir);
    s.check(!c.run.output_dir.empty(), "output_dir", "a directory path", "''");
    std::int64_t seed = static_cast<std::int64_t>(c.run.seed);
    s.integer("seed", seed);
    s.at_least(seed, 0, "seed");
    c.run.seed = static_cast<std::uint64_t>(seed);
  }
  const YAML::Node device = root["device"];
  if (device.IsDefined() && !device.IsNull()) {
    if (device.IsScalar() && device.Scalar() == "cuda") {
      c.device = Device::cuda;
    } else if (device.IsScalar() && device.Scalar() == "cpu") {
      c.device = Device::cpu;
    } else {
      reader.fail("device", device, "expected one of [cuda, cpu], got " + describe(device));
    }
  }
  {
    const Section s(reader, root, "model", true);
    read_model(s, c.model);
  }
  {
    const Section s(reader, root, "data", true);
    s.require("train", "a token shard path");
    s.string("train", c.data.train);
    require_existing_path(s, "train", c.data.train, "training data");
    require_regular_file(s, "train", c.data.train);
    s.string("val", c.data.val);
    if (!c.data.val.empty()) {
      require_existing_path(s, "val", c.data.val, "validation data");
      require_regular_file(s, "val", c.data.val);
    }
    s.integer("seq_len", c.data.seq_len);
    const auto spec = model_spec(c);
    s.check(c.data.seq_len > 0 && c.data.seq_len <= spec->max_sequence_length(), "seq_len",
            "an integer in [1, " + std::to_string(spec->max_sequence_length()) + "] (model max_position_embeddings)",
            std::to_string(c.data.seq_len));
    s.string("tokenizer", c.data.tokenizer);
    if (c.data.tokenizer == "byte") {
      if (spec->vocab_size() < 256) {
        throw core::InputError(reader.where("model.vocab_size", root["model"]) +
                               ": model.vocab_size: the byte tokenizer needs vocab_size >= 256, got " +
                               std::to_string(spec->vocab_size()));
      }
    } else {
      require_existing_path(s, "tokenizer", c.data.tokenizer, "tokenizer (byte or a tokenizer.json path)");
    }
  }
  {
    const Section s(reader, root, "training", true);
    s.require("max_steps", "the number of optimizer steps, an integer >= 1");
    s.integer("micro_batch_size", c.training.micro_batch_size);
    s.at_least(c.training.micro_batch_size, 1, "micro_batch_size");
    s.check(c.training.micro_batch_size <= kMaxMicroTokens / c.data.seq_len, "micro_batch_size",
            "an integer in [1, " + std::to_string(kMaxMicroTokens / c.data.seq_len) + "] (at most " +
                std::to_string(kMaxMicroTokens) + " tokens per micro-batch at seq_len " + std::to_string(c.data.seq_len) + ")",
            std::to_string(c.training.micro_batch_size));
    if (s.has("global_batch_size") && !(s.value("global_batch_size").IsScalar() &&
                                        s.value("global_batch_size").Scalar() == "auto")) {
      std::int64_t global = 0;
      s.integer("global_batch_size", global);
      s.check(global >= c.training.micro_batch_size, "global_batch_size",
              "auto or a number of sequences >= micro_batch_size (" + std::to_string(c.training.micro_batch_size) + ")",
              std::to_string(global));
      s.check(global <= c.training.micro_batch_size * kMaxAccumulation, "global_batch_size",
              "auto or a number of sequences in [micro_batch_size, micro_batch_size x " + std::to_string(kMaxAccumulation) +
                  "] = [" + std::to_string(c.training.micro_batch_size) + ", " +
                  std::to_string(c.training.micro_batch_size * kMaxAccumulation) + "]",
              std::to_string(global));
      c.training.global_batch_size = global;
    }
    s.integer("max_steps", c.training.max_steps);
    s.at_least(c.training.max_steps, 1, "max_steps");
    c.training.precision = c.device == Device::cpu ? Precision::fp32 : Precision::bf16;
    s.choice<Precision>("precision", c.training.precision, {{"bf16", Precision::bf16}, {"fp32", Precision::fp32}});
    const Precision required = c.device == Device::cpu ? Precision::fp32 : Precision::bf16;
    s.check(c.training.precision == required, "precision",
            std::string(precision_name(required)) + " (device " + device_name(c.device) + ")",
            precision_name(c.training.precision));
    s.number("grad_clip", c.training.grad_clip);
    s.check(std::isfinite(c.training.grad_clip) && c.training.grad_clip >= 0, "grad_clip",
            "a finite number >= 0 (0 disables)", format_double(c.training.grad_clip));
  }
  {
    const Section s(reader, root, "optimizer", false);
    if (s.present()) {
      try {
        c.optimizer = optim::optimizer_config_from_yaml(s.node(), reader.file());
      } catch (const core::InputError& e) {
        reader.rethrow_optimizer_error(e.what());
      }
    }
    c.optimizer.grad_clip = c.training.grad_clip;
  }
  {
    const Section s(reader, root, "schedule", false);
    s.choice<ScheduleType>("type", c.schedule.type,
                           {{"constant", ScheduleType::constant}, {"linear", ScheduleType::linear},
                            {"cosine", ScheduleType::cosine}, {"wsd", ScheduleType::wsd}});
    s.integer("warmup_steps", c.schedule.warmup_steps);
    s.check(c.schedule.warmup_steps >= 0 && c.schedule.warmup_steps <= c.training.max_steps, "warmup_steps",
            "an integer in [0, training.max_steps = " + std::to_string(c.training.max_steps) + "]",
            std::to_string(c.schedule.warmup_steps));
    s.number("min_lr_ratio", c.schedule.min_lr_ratio);
    s.check(c.schedule.min_lr_ratio >= 0 && c.schedule.min_lr_ratio <= 1, "min_lr_ratio", "a number in [0, 1]",
            format_double(c.schedule.min_lr_ratio));
    s.number("decay_ratio", c.schedule.decay_ratio);
    s.check(c.schedule.decay_ratio >= 0 && c.schedule.decay_ratio <= 1, "decay_ratio", "a number in [0, 1]",
            format_double(c.schedule.decay_ratio));
    if (c.schedule.type == ScheduleType::wsd) {
      const std::int64_t decay = wsd_decay_steps(c.schedule, c.training.max_steps);
      s.check(c.schedule.warmup_steps + decay <= c.training.max_steps, "decay_ratio",
              "warmup_steps + decay steps <= training.max_steps (" + std::to_string(c.training.max_steps) + ")",
              std::to_string(c.schedule.warmup_steps) + " + " + std::to_string(decay));
    }
  }
  {
    const Section s(reader, root, "parallel", false);
    std::int64_t stage = c.parallel.zero_stage;
    s.integer("zero_stage", stage);
    s.check(stage >= 0 && stage <= 2, "zero_stage", "one of [0, 1, 2]", std::to_string(stage));
    c.parallel.zero_stage = static_cast<int>(stage);
    s.integer("timeout_s", c.parallel.timeout_s);
    s.at_least(c.parallel.timeout_s, 1, "timeout_s");
  }
  {
    const Section s(reader, root, "checkpoint", false);
    s.integer("every", c.checkpoint.every);
    s.at_least(c.checkpoint.every, 0, "every");
    s.integer("keep_last", c.checkpoint.keep_last);
    s.at_least(c.checkpoint.keep_last, 0, "keep_last");
    s.boolean("at_end", c.checkpoint.at_end);
    s.boolean("allow_data_change", c.checkpoint.allow_data_change);
    s.string("resume", c.checkpoint.resume);
    if (c.checkpoint.resume != "auto" && c.checkpoint.resume != "never") {
      require_existing_path(s, "resume", c.checkpoint.resume, "checkpoint (resume: auto, never or a path)");
    }
  }
  {
    const Section s(reader, root, "eval", false);
    if (!c.data.val.empty()) c.eval.every = 200;
    s.integer("every", c.eval.every);
    s.at_least(c.eval.every, 0, "every");
    if (c.eval.every > 0 && c.data.val.empty()) s.fail("every", "eval.every > 0 needs data.val (or set eval.every: 0)");
    s.integer("batches", c.eval.batches);
    s.at_least(c.eval.batches, 1, "batches");
    if (s.has("tasks")) {
      const YAML::Node list = s.value("tasks");
      if (!list.IsSequence()) s.fail("tasks", "expected a list of task files, got " + describe(list));
      for (const auto& item : list) {
        if (!item.IsScalar() || item.Scalar().empty()) s.fail("tasks", "expected task file paths, got " + describe(item));
        if (!std::filesystem::is_regular_file(item.Scalar())) s.fail("tasks", "task file '" + item.Scalar() + "' does not exist");
        c.eval.tasks.push_back(item.Scalar());
      }
    }
    s.integer("tasks_every", c.eval.tasks_every);
    s.at_least(c.eval.tasks_every, 0, "tasks_every");
    s.integer("tasks_limit", c.eval.tasks_limit);
    s.at_least(c.eval.tasks_limit, 0, "tasks_limit");
    s.string("decoder", c.eval.decoder);
    s.check(c.eval.decoder == "auto" || c.eval.decoder == "megakernel" || c.eval.decoder == "plain", "decoder",
            "auto, megakernel or plain", "'" + c.eval.decoder + "'");
  }
  {
    const Section s(reader, root, "logging", false);
    s.integer("every", c.logging.every);
    s.at_least(c.logging.every, 1, "every");
    s.boolean("tensorboard", c.logging.tensorboard);
  }
  {
    const Section s(reader, root, "sample", false);
    s.integer("every", c.sample.every);
    s.at_least(c.sample.every, 0, "every");
    s.integer("tokens", c.sample.tokens);
    s.at_least(c.sample.tokens, 1, "tokens");
    s.string("prompt", c.sample.prompt);
  }
  return c;
}

const char* quantization_name(optim::Quantization q) {
  return q == optim::Quantization::companded ? "companded" : "linear";
}

}  // namespace

const char* device_name(Device device) { return device == Device::cuda ? "cuda" : "cpu"; }
const char* precision_name(Precision precision) { return precision == Precision::bf16 ? "bf16" : "fp32"; }

RunConfig parse_run_config(const std::string& yaml, const std::string& source,
                           const std::vector<std::string>& overrides) {
  if (const std::size_t at = invalid_utf8_offset(yaml); at != std::string_view::npos) {
    throw core::InputError(source + ": byte " + std::to_string(at) + " is not valid UTF-8 (a config is Unicode text)");
  }
  for (const std::string& text : overrides) {
    if (invalid_utf8_offset(text) != std::string_view::npos) {
      throw core::InputError("command line override: '" + text.substr(0, text.find('=')) + "...' is not valid UTF-8");
    }
  }
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::ParserException& e) {
    throw core::InputError(source + ":" + std::to_string(e.mark.line + 1) + ":" + std::to_string(e.mark.column + 1) +
                           ": not valid YAML: " + e.msg);
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) {
    throw core::InputError(source + ": expected a mapping with the sections " + joined(top_level_keys()) +
                           ", got " + describe(root));
  }
  const Reader reader(source, apply_overrides(root, overrides));
  return read_config(root, reader);
}

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  constexpr std::uintmax_t kMaxConfigBytes = 1 << 20;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw core::InputError(path + ": " + (std::filesystem::exists(path, ec) ? "not a regular file" : "cannot open the config file"));
  }
  if (std::filesystem::file_size(path, ec) > kMaxConfigBytes) {
    throw core::InputError(path + ": larger than " + std::to_string(kMaxConfigBytes) + " bytes: not a config file");
  }
  std::ifstream in(path);
  if (!in) throw core::InputError(path + ": cannot open the config file");
  std::stringstream text;
  text << in.rdbuf();
  return parse_run_config(text.str(), path, overrides);
}

std::unique_ptr<models::ModelSpec> model_spec(const RunConfig& config) {
  return models::family(config.model.arch).spec(config.model.shape);
}

std::int64_t global_batch_sequences(const RunConfig& config, int world) {
  return config.training.global_batch_size.value_or(config.training.micro_batch_size * world);
}

std::int64_t accumulation_steps(const RunConfig& config, int world) {
  return global_batch_sequences(config, world) / (config.training.micro_batch_size * world);
}

void validate_for_world(const RunConfig& config, int world) {
  if (world < 1) throw core::InputError("world size must be >= 1, got " + std::to_string(world));
  const std::int64_t per_step = config.training.micro_batch_size * world;
  const std::int64_t global = global_batch_sequences(config, world);
  if (global % per_step != 0) {
    throw core::InputError("training.global_batch_size: expected a multiple of micro_batch_size x world size (" +
                           std::to_string(config.training.micro_batch_size) + " x " + std::to_string(world) + " = " +
                           std::to_string(per_step) + " sequences), got " + std::to_string(global));
  }
}

std::string resolved_yaml(const RunConfig& c) {
  YAML::Emitter out;
  const auto number = [&](const char* key, double value) { out << YAML::Key << key << YAML::Value << format_double(value); };
  const auto integer = [&](const char* key, std::int64_t value) { out << YAML::Key << key << YAML::Value << value; };
  const auto text = [&](const char* key, const std::string& value) { out << YAML::Key << key << YAML::Value << value; };
  const auto optional_text = [&](const char* key, const std::string& value) {
    out << YAML::Key << key << YAML::Value;
    if (value.empty()) {
      out << YAML::Null;
    } else {
      out << value;
    }
  };
  const auto boolean = [&](const char* key, bool value) { out << YAML::Key << key << YAML::Value << value; };

  out << YAML::BeginMap;
  out << YAML::Key << "run" << YAML::Value << YAML::BeginMap;
  text("name", c.run.name);
  text("output_dir", c.run.output_dir);
  out << YAML::Key << "seed" << YAML::Value << c.run.seed;
  out << YAML::EndMap;
  text("device", device_name(c.device));

  out << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  text("arch", c.model.arch);
  optional_text("preset", c.model.preset);
  optional_text("init_from", c.model.init_from);
  for (const models::ConfigField& f : models::family(c.model.arch).fields()) {
    const nlohmann::json& v = c.model.shape.at(f.key);
    switch (f.type) {
      case models::FieldType::integer: integer(f.key.c_str(), v.get<std::int64_t>()); break;
      case models::FieldType::number: number(f.key.c_str(), v.get<double>()); break;
      case models::FieldType::boolean: boolean(f.key.c_str(), v.get<bool>()); break;
      case models::FieldType::choice: text(f.key.c_str(), v.get<std::string>()); break;
    }
  }
  out << YAML::EndMap;

  out << YAML::Key << "data" << YAML::Value << YAML::BeginMap;
  text("train", c.data.train);
  optional_text("val", c.data.val);
  integer("seq_len", c.data.seq_len);
  text("tokenizer", c.data.tokenizer);
  out << YAML::EndMap;

  out << YAML::Key << "training" << YAML::Value << YAML::BeginMap;
  integer("micro_batch_size", c.training.micro_batch_size);
  if (c.training.global_batch_size) {
    integer("global_batch_size", *c.training.global_batch_size);
  } else {
    text("global_batch_size", "auto");
  }
  integer("max_steps", c.training.max_steps);
  text("precision", precision_name(c.training.precision));
  number("grad_clip", c.training.grad_clip);
  out << YAML::EndMap;

  const optim::OptimizerConfig& o = c.optimizer;
  out << YAML::Key << "optimizer" << YAML::Value << YAML::BeginMap;
  text("type", o.type);
  number("lr", o.lr);
  number("weight_decay", o.weight_decay);
  text("nonfinite", optim::nonfinite_policy_name(o.nonfinite));
  if (o.type == "adamw" || o.type == "adamw8bit") {
    out << YAML::Key << "betas" << YAML::Value << YAML::Flow << YAML::BeginSeq << format_double(o.beta1)
        << format_double(o.beta2) << YAML::EndSeq;
    number("eps", o.eps);
  }
  if (o.type == "adamw8bit") {
    integer("min_8bit_size", o.adamw8bit.min_8bit_size);
    text("quantization", quantization_name(o.adamw8bit.quantization));
  }
  if (o.type == "adafactor") {
    const optim::AdafactorConfig& a = o.adafactor;
    number("eps1", a.eps1);
    number("eps2", a.eps2);
    number("clip_threshold", a.clip_threshold);
    number("decay_rate", a.decay_rate);
    out << YAML::Key << "beta1" << YAML::Value;
    if (a.beta1) {
      out << format_double(*a.beta1);
    } else {
      out << YAML::Null;
    }
    boolean("relative_step", a.relative_step);
    boolean("scale_parameter", a.scale_parameter);
    boolean("warmup_init", a.warmup_init);
    text("eps1_mode", a.eps1_mode == optim::Eps1Mode::add ? "add" : "clamp");
    text("decay_scale", a.decay_scale == optim::DecayScale::lr ? "lr" : "alpha");
  }
  out << YAML::EndMap;

  out << YAML::Key << "schedule" << YAML::Value << YAML::BeginMap;
  text("type", schedule_type_name(c.schedule.type));
  integer("warmup_steps", c.schedule.warmup_steps);
  number("min_lr_ratio", c.schedule.min_lr_ratio);
  number("decay_ratio", c.schedule.decay_ratio);
  out << YAML::EndMap;

  out << YAML::Key << "parallel" << YAML::Value << YAML::BeginMap;
  integer("zero_stage", c.parallel.zero_stage);
  integer("timeout_s", c.parallel.timeout_s);
  out << YAML::EndMap;

  out << YAML::Key << "checkpoint" << YAML::Value << YAML::BeginMap;
  integer("every", c.checkpoint.every);
  integer("keep_last", c.checkpoint.keep_last);
  boolean("at_end", c.checkpoint.at_end);
  boolean("allow_data_change", c.checkpoint.allow_data_change);
  text("resume", c.checkpoint.resume);
  out << YAML::EndMap;

  out << YAML::Key << "eval" << YAML::Value << YAML::BeginMap;
  integer("every", c.eval.every);
  integer("batches", c.eval.batches);
  out << YAML::Key << "tasks" << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (const std::string& task : c.eval.tasks) out << task;
  out << YAML::EndSeq;
  integer("tasks_every", c.eval.tasks_every);
  integer("tasks_limit", c.eval.tasks_limit);
  text("decoder", c.eval.decoder);
  out << YAML::EndMap;

  out << YAML::Key << "logging" << YAML::Value << YAML::BeginMap;
  integer("every", c.logging.every);
  boolean("tensorboard", c.logging.tensorboard);
  out << YAML::EndMap;

  out << YAML::Key << "sample" << YAML::Value << YAML::BeginMap;
  integer("every", c.sample.every);
  integer("tokens", c.sample.tokens);
  text("prompt", c.sample.prompt);
  out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace trainer
