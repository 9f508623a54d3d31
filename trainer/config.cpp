// The run configuration: overrides applied to the YAML tree, then each section read with its key
// set, types and ranges checked; the resolved config written back as YAML.
#include "trainer/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string_view>
#include <type_traits>

#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "trainer/optimizer_yaml.h"

namespace trainer {

namespace {

struct SectionSchema;
const std::vector<SectionSchema>& schema();

// The sections, in the order resolved_yaml writes them.
std::vector<std::string> top_level_keys();

// Bounds that keep every product of batch sizes far from overflow and a step finite in time.
constexpr std::int64_t kMaxMicroTokens = std::int64_t{1} << 31;  // int32 token indexing on the device
constexpr std::int64_t kMaxAccumulation = 1 << 16;               // micro-batches per rank per step
// Far beyond any run (a trillion steps), and small enough that step and schedule arithmetic
// (warmup_steps + decay steps, the ETA) cannot overflow.
constexpr std::int64_t kMaxSteps = 1000000000000;

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

// The keys of each section, from the schema (built at the first use: a program adds its own
// families, models::add_family, before that).
const std::map<std::string, std::vector<std::string>>& section_keys();

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
    std::size_t length = lead < 0x80                    ? 1
                         : lead >= 0xC2 && lead <= 0xDF ? 2
                         : lead >= 0xE0 && lead <= 0xEF ? 3
                         : lead >= 0xF0 && lead <= 0xF4 ? 4
                                                        : 0;
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

std::string describe(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return "nothing";
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  return node.IsSequence() ? "a list" : "a mapping";
}

// Reads the tree, naming each key by its path and its origin (file line or override).
class Reader {
 public:
  Reader(std::string file, std::map<std::string, std::string> override_sources, bool check_paths)
      : file_(std::move(file)), override_sources_(std::move(override_sources)), check_paths_(check_paths) {}

  const std::string& file() const { return file_; }
  bool check_paths() const { return check_paths_; }

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
  bool check_paths_ = true;
};

// One section: its keys checked on construction, typed getters that leave the default when absent.
class Section {
 public:
  bool check_paths() const { return reader_.check_paths(); }

  Section(const Reader& reader, const YAML::Node& root, const std::string& name, bool required)
      : reader_(reader), root_(root), name_(name), node_(root[name]), present_(node_.IsDefined() && !node_.IsNull()) {
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

  // Where `path` of another section is set (its override, or that section's line).
  std::string where_in(const std::string& path, const std::string& section) const {
    return reader_.where(path, root_[section]);
  }

 private:
  const Reader& reader_;
  const YAML::Node& root_;
  std::string name_;
  YAML::Node node_;
  bool present_;
};

// The non-throwing checks: a path the system cannot look up (too long, a loop of links) is a bad
// value like a missing one, named with the reason.
void require_existing_path(const Section& section, const std::string& key, const std::string& value,
                           const std::string& what) {
  if (!section.check_paths()) return;
  std::error_code ec;
  if (!std::filesystem::exists(value, ec)) {
    section.fail(key, what + " '" + value + "' " + (ec ? "cannot be looked up: " + ec.message() : "does not exist"));
  }
}

// Token shards are read by size and offset: a FIFO, device or directory would block or mislead.
void require_regular_file(const Section& section, const std::string& key, const std::string& value) {
  if (!section.check_paths()) return;
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
      throw core::InputError(origin + ": " + section + ": expected " + section +
                             ".KEY=VALUE (a key inside the section)");
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
    const char* expected = f.type == models::FieldType::integer   ? "an integer"
                           : f.type == models::FieldType::number  ? "a number"
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
  if (s.has("preset")) {  // given, even as '' or a bare tag: one of the names
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

// The global batch: `auto` (unset) or a number of sequences, a whole number of micro-batches.
void read_global_batch(const Section& s, RunConfig& c) {
  if (!s.has("global_batch_size") ||
      (s.value("global_batch_size").IsScalar() && s.value("global_batch_size").Scalar() == "auto")) {
    return;
  }
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

// The run config's schema: every section and key, each row saying how the key is read (type,
// default, range) and written back by resolved_yaml. Rows are read and written in table order.
using ReadKey = std::function<void(const Section&, RunConfig&)>;
using WriteKey = std::function<void(YAML::Emitter&, const RunConfig&)>;

struct KeySchema {
  KeySchema(std::string name, ReadKey read, WriteKey write)
      : name(std::move(name)), read(std::move(read)), write(std::move(write)) {}

  std::string name;
  ReadKey read;
  WriteKey write;
  std::string required;  // non-empty: the key has no default; what is expected
};

struct SectionSchema {
  using ReadSection = std::function<void(const Reader&, const YAML::Node& root, RunConfig&)>;
  using KeyNames = std::function<std::vector<std::string>()>;

  // A mapping of plain keys.
  SectionSchema(std::string name, bool required, std::vector<KeySchema> keys)
      : name(std::move(name)), required(required), keys(std::move(keys)) {}
  // A section not made of plain keys (device, model, optimizer): it reads and writes itself.
  SectionSchema(std::string name, ReadSection read, WriteKey write, KeyNames key_names, bool scalar = false)
      : name(std::move(name)),
        read(std::move(read)),
        write(std::move(write)),
        key_names(std::move(key_names)),
        scalar(scalar) {}

  std::string name;
  bool required = false;
  std::vector<KeySchema> keys;
  ReadSection read;
  WriteKey write;
  KeyNames key_names;
  bool scalar = false;  // a top-level value, not a mapping (device)
};

void emit(YAML::Emitter& out, const std::string& key, std::int64_t v) { out << YAML::Key << key << YAML::Value << v; }
void emit(YAML::Emitter& out, const std::string& key, std::uint64_t v) { out << YAML::Key << key << YAML::Value << v; }
void emit(YAML::Emitter& out, const std::string& key, double v) {
  out << YAML::Key << key << YAML::Value << yaml_number(v);
}
void emit(YAML::Emitter& out, const std::string& key, bool v) { out << YAML::Key << key << YAML::Value << v; }
void emit(YAML::Emitter& out, const std::string& key, const std::string& v) {
  out << YAML::Key << key << YAML::Value << v;
}
// An empty string as null (an unset path).
void emit_optional(YAML::Emitter& out, const std::string& key, const std::string& v) {
  out << YAML::Key << key << YAML::Value;
  if (v.empty()) {
    out << YAML::Null;
  } else {
    out << v;
  }
}

template <typename Enum>
using Choices = std::vector<std::pair<std::string, Enum>>;
const Choices<Precision> kPrecisions = {{"bf16", Precision::bf16}, {"fp32", Precision::fp32}};
const Choices<VocabGradient> kVocabGradients = {{"whole", VocabGradient::whole}, {"windows", VocabGradient::windows}};
const Choices<ScheduleType> kSchedules = {{"constant", ScheduleType::constant},
                                          {"linear", ScheduleType::linear},
                                          {"cosine", ScheduleType::cosine},
                                          {"wsd", ScheduleType::wsd}};
template <typename Enum>
std::string choice_name(const Choices<Enum>& choices, Enum e) {
  for (const auto& [name, value] : choices) {
    if (value == e) return name;
  }
  return "";
}

void read_value(const Section& s, const std::string& key, std::int64_t& v) { s.integer(key, v); }
void read_value(const Section& s, const std::string& key, double& v) { s.number(key, v); }
void read_value(const Section& s, const std::string& key, bool& v) { s.boolean(key, v); }
void read_value(const Section& s, const std::string& key, std::string& v) { s.string(key, v); }

// A check of a key's value once read; it may look at the keys read before it.
template <typename T>
using Check = std::function<void(const Section&, const std::string& key, const T& value, const RunConfig&)>;

Check<std::int64_t> at_least(std::int64_t minimum) {
  return [minimum](const Section& s, const std::string& key, const std::int64_t& v, const RunConfig&) {
    s.at_least(v, minimum, key);
  };
}

Check<double> in_unit_interval() {
  return [](const Section& s, const std::string& key, const double& v, const RunConfig&) {
    s.check(v >= 0 && v <= 1, key, "a number in [0, 1]", yaml_number(v));
  };
}

// eval.decoder, sample.decoder: models::DecoderChoice by name.
void decoder_choice_check(const Section& s, const std::string& key, const std::string& v, const RunConfig&) {
  s.check(v == "auto" || v == "megakernel" || v == "plain", key, "auto, megakernel or plain", "'" + v + "'");
}

// A key bound to a member of a section of RunConfig: read with its type, checked, written back.
template <typename S, typename T>
KeySchema entry(const std::string& key, S RunConfig::*section, T S::*member,
                std::type_identity_t<Check<T>> check = nullptr) {
  return {key,
          [=](const Section& s, RunConfig& c) {
            read_value(s, key, c.*section.*member);
            if (check) check(s, key, c.*section.*member, c);
          },
          [=](YAML::Emitter& out, const RunConfig& c) { emit(out, key, c.*section.*member); }};
}

// A choice bound to an enum member.
template <typename S, typename Enum>
KeySchema bind_choice(const std::string& key, S RunConfig::*section, Enum S::*member, const Choices<Enum>& choices) {
  return {key, [=](const Section& s, RunConfig& c) { s.choice<Enum>(key, c.*section.*member, choices); },
          [=](YAML::Emitter& out, const RunConfig& c) { emit(out, key, choice_name(choices, c.*section.*member)); }};
}

KeySchema required(KeySchema key, const std::string& expected) {
  key.required = expected;
  return key;
}

// A string key that may not be '' (a path given empty would read as unset), then `then`'s checks.
Check<std::string> non_empty(const std::string& expected, Check<std::string> then = nullptr) {
  return [=](const Section& s, const std::string& key, const std::string& v, const RunConfig& c) {
    s.check(!v.empty(), key, expected, "''");
    if (then) then(s, key, v, c);
  };
}

// A data file: it must exist and be a regular file.
Check<std::string> data_file(const std::string& what) {
  return [what](const Section& s, const std::string& key, const std::string& v, const RunConfig&) {
    if (v.empty()) return;
    require_existing_path(s, key, v, what);
    require_regular_file(s, key, v);
  };
}

void read_device(const Reader& reader, const YAML::Node& root, RunConfig& c) {
  const YAML::Node device = root["device"];
  if (!device.IsDefined() || device.IsNull()) return;
  if (device.IsScalar() && device.Scalar() == "cuda") {
    c.device = Device::cuda;
  } else if (device.IsScalar() && device.Scalar() == "cpu") {
    c.device = Device::cpu;
  } else {
    reader.fail("device", device, "expected one of [cuda, cpu], got " + describe(device));
  }
}

void write_model(YAML::Emitter& out, const RunConfig& c) {
  emit(out, "arch", c.model.arch);
  emit_optional(out, "preset", c.model.preset);
  emit_optional(out, "init_from", c.model.init_from);
  for (const models::ConfigField& f : models::family(c.model.arch).fields()) {
    const nlohmann::json& v = c.model.shape.at(f.key);
    switch (f.type) {
      case models::FieldType::integer: emit(out, f.key, v.get<std::int64_t>()); break;
      case models::FieldType::number: emit(out, f.key, v.get<double>()); break;
      case models::FieldType::boolean: emit(out, f.key, v.get<bool>()); break;
      case models::FieldType::choice: emit(out, f.key, v.get<std::string>()); break;
    }
  }
}

const std::vector<SectionSchema>& schema() {
  static const std::vector<SectionSchema> sections = [] {
    std::vector<SectionSchema> s;
    s.push_back({"run",
                 true,
                 {entry("name", &RunConfig::run, &RunSection::name),
                  required(entry<RunSection, std::string>("output_dir", &RunConfig::run, &RunSection::output_dir,
                                                          non_empty("a directory path")),
                           "the directory for checkpoints, logs and the resolved config"),
                  {"seed",
                   [](const Section& s, RunConfig& c) {
                     std::int64_t seed = static_cast<std::int64_t>(c.run.seed);
                     s.integer("seed", seed);
                     s.at_least(seed, 0, "seed");
                     c.run.seed = static_cast<std::uint64_t>(seed);
                   },
                   [](YAML::Emitter& out, const RunConfig& c) { emit(out, "seed", c.run.seed); }}}});
    s.push_back(
        {"device", read_device,
         [](YAML::Emitter& out, const RunConfig& c) { emit(out, "device", std::string(device_name(c.device))); },
         nullptr, true});
    s.push_back({"model",
                 [](const Reader& reader, const YAML::Node& root, RunConfig& c) {
                   read_model(Section(reader, root, "model", true), c.model);
                 },
                 write_model,
                 [] {
                   std::vector<std::string> keys = {"arch", "preset", "init_from"};
                   for (const auto& key : model_shape_keys()) keys.push_back(key);
                   return keys;
                 }});
    s.push_back({"data",
                 true,
                 {required(entry<DataConfig, std::string>("train", &RunConfig::data, &DataConfig::train,
                                                          non_empty("a token shard path", data_file("training data"))),
                           "a token shard path"),
                  {"val",
                   [](const Section& s, RunConfig& c) {
                     s.string("val", c.data.val);
                     data_file("validation data")(s, "val", c.data.val, c);
                   },
                   [](YAML::Emitter& out, const RunConfig& c) { emit_optional(out, "val", c.data.val); }},
                  entry<DataConfig, std::int64_t>(
                      "seq_len", &RunConfig::data, &DataConfig::seq_len,
                      [](const Section& s, const std::string& key, const std::int64_t& v, const RunConfig& c) {
                        const auto spec = model_spec(c);
                        s.check(v > 0 && v <= spec->max_sequence_length(), key,
                                "an integer in [1, " + std::to_string(spec->max_sequence_length()) +
                                    "] (model max_position_embeddings)",
                                std::to_string(v));
                      }),
                  entry<DataConfig, std::string>(
                      "tokenizer", &RunConfig::data, &DataConfig::tokenizer,
                      [](const Section& s, const std::string& key, const std::string& v, const RunConfig& c) {
                        if (v != "byte") {
                          require_existing_path(s, key, v, "tokenizer (byte or a tokenizer.json path)");
                          return;
                        }
                        const auto spec = model_spec(c);
                        if (spec->vocab_size() < 256) {
                          throw core::InputError(
                              s.where_in("model.vocab_size", "model") +
                              ": model.vocab_size: the byte tokenizer needs vocab_size >= 256, got " +
                              std::to_string(spec->vocab_size()));
                        }
                      })}});
    s.push_back({"training",
                 true,
                 {entry<TrainingConfig, std::int64_t>(
                      "micro_batch_size", &RunConfig::training, &TrainingConfig::micro_batch_size,
                      [](const Section& s, const std::string& key, const std::int64_t& v, const RunConfig& c) {
                        s.at_least(v, 1, key);
                        s.check(v <= kMaxMicroTokens / c.data.seq_len, key,
                                "an integer in [1, " + std::to_string(kMaxMicroTokens / c.data.seq_len) +
                                    "] (at most " + std::to_string(kMaxMicroTokens) +
                                    " tokens per micro-batch at seq_len " + std::to_string(c.data.seq_len) + ")",
                                std::to_string(v));
                      }),
                  {"global_batch_size", read_global_batch,
                   [](YAML::Emitter& out, const RunConfig& c) {
                     if (c.training.global_batch_size) {
                       emit(out, "global_batch_size", *c.training.global_batch_size);
                     } else {
                       emit(out, "global_batch_size", std::string("auto"));
                     }
                   }},
                  required(entry<TrainingConfig, std::int64_t>(
                               "max_steps", &RunConfig::training, &TrainingConfig::max_steps,
                               [](const Section& s, const std::string& key, const std::int64_t& v, const RunConfig&) {
                                 s.check(v >= 1 && v <= kMaxSteps, key,
                                         "an integer in [1, " + std::to_string(kMaxSteps) + "]", std::to_string(v));
                               }),
                           "the number of optimizer steps, an integer >= 1"),
                  {"precision",
                   [](const Section& s, RunConfig& c) {
                     const Precision required = c.device == Device::cpu ? Precision::fp32 : Precision::bf16;
                     c.training.precision = required;
                     s.choice<Precision>("precision", c.training.precision, kPrecisions);
                     s.check(c.training.precision == required, "precision",
                             std::string(precision_name(required)) + " (device " + device_name(c.device) + ")",
                             precision_name(c.training.precision));
                   },
                   [](YAML::Emitter& out, const RunConfig& c) {
                     emit(out, "precision", choice_name(kPrecisions, c.training.precision));
                   }},
                  entry<TrainingConfig, double>(
                      "grad_clip", &RunConfig::training, &TrainingConfig::grad_clip,
                      [](const Section& s, const std::string& key, const double& v, const RunConfig&) {
                        s.check(std::isfinite(v) && v >= 0, key, "a finite number >= 0 (0 disables)", yaml_number(v));
                      })}});
    s.push_back({"optimizer",
                 [](const Reader& reader, const YAML::Node& root, RunConfig& c) {
                   const Section s(reader, root, "optimizer", false);
                   if (s.present()) {
                     try {
                       c.optimizer = optimizer_config_from_yaml(s.node(), reader.file());
                     } catch (const core::InputError& e) {
                       reader.rethrow_optimizer_error(e.what());
                     }
                   }
                   c.optimizer.grad_clip = c.training.grad_clip;
                 },
                 [](YAML::Emitter& out, const RunConfig& c) { emit_optimizer_config(out, c.optimizer); },
                 [] {
                   std::vector<std::string> keys;
                   for (const auto& key : optimizer_config_keys()) {
                     if (key != "grad_clip") keys.push_back(key);
                   }
                   return keys;
                 }});
    s.push_back({"schedule",
                 false,
                 {bind_choice("type", &RunConfig::schedule, &ScheduleConfig::type, kSchedules),
                  entry<ScheduleConfig, std::int64_t>(
                      "warmup_steps", &RunConfig::schedule, &ScheduleConfig::warmup_steps,
                      [](const Section& s, const std::string& key, const std::int64_t& v, const RunConfig& c) {
                        s.check(v >= 0 && v <= c.training.max_steps, key,
                                "an integer in [0, training.max_steps = " + std::to_string(c.training.max_steps) + "]",
                                std::to_string(v));
                      }),
                  // A value the chosen schedule never reads would be ignored without a word (the default,
                  // as a resolved config.yaml writes it, is fine).
                  entry<ScheduleConfig, double>(
                      "min_lr_ratio", &RunConfig::schedule, &ScheduleConfig::min_lr_ratio,
                      [](const Section& s, const std::string& key, const double& v, const RunConfig& c) {
                        in_unit_interval()(s, key, v, c);
                        if (c.schedule.type == ScheduleType::constant && v != ScheduleConfig{}.min_lr_ratio) {
                          s.fail(key, "the constant schedule never decays (use linear, cosine or wsd)");
                        }
                      }),
                  entry<ScheduleConfig, double>(
                      "decay_ratio", &RunConfig::schedule, &ScheduleConfig::decay_ratio,
                      [](const Section& s, const std::string& key, const double& v, const RunConfig& c) {
                        in_unit_interval()(s, key, v, c);
                        if (c.schedule.type != ScheduleType::wsd && v != ScheduleConfig{}.decay_ratio) {
                          s.fail(key, std::string("only the wsd schedule has a decay phase (schedule.type is ") +
                                          schedule_type_name(c.schedule.type) + ")");
                        }
                        if (c.schedule.type != ScheduleType::wsd) return;
                        const std::int64_t decay = wsd_decay_steps(c.schedule, c.training.max_steps);
                        s.check(c.schedule.warmup_steps + decay <= c.training.max_steps, key,
                                "warmup_steps + decay steps <= training.max_steps (" +
                                    std::to_string(c.training.max_steps) + ")",
                                std::to_string(c.schedule.warmup_steps) + " + " + std::to_string(decay));
                      })}});
    s.push_back(
        {"parallel",
         false,
         {{"zero_stage",
           [](const Section& s, RunConfig& c) {
             std::int64_t stage = c.parallel.zero_stage;
             s.integer("zero_stage", stage);
             s.check(stage >= 0 && stage <= 3, "zero_stage", "one of [0, 1, 2, 3]", std::to_string(stage));
             c.parallel.zero_stage = static_cast<int>(stage);
           },
           [](YAML::Emitter& out, const RunConfig& c) {
             emit(out, "zero_stage", static_cast<std::int64_t>(c.parallel.zero_stage));
           }},
          entry("timeout_s", &RunConfig::parallel, &ParallelConfig::timeout_s, at_least(1)),
          bind_choice("vocab_gradient", &RunConfig::parallel, &ParallelConfig::vocab_gradient, kVocabGradients)}});
    s.push_back({"checkpoint",
                 false,
                 {entry("every", &RunConfig::checkpoint, &CheckpointConfig::every, at_least(0)),
                  entry("keep_last", &RunConfig::checkpoint, &CheckpointConfig::keep_last, at_least(0)),
                  entry("at_end", &RunConfig::checkpoint, &CheckpointConfig::at_end),
                  entry("allow_data_change", &RunConfig::checkpoint, &CheckpointConfig::allow_data_change),
                  entry("allow_schedule_change", &RunConfig::checkpoint, &CheckpointConfig::allow_schedule_change),
                  entry<CheckpointConfig, std::string>(
                      "resume", &RunConfig::checkpoint, &CheckpointConfig::resume,
                      [](const Section& s, const std::string& key, const std::string& v, const RunConfig&) {
                        if (v != "auto" && v != "never") {
                          require_existing_path(s, key, v, "checkpoint (resume: auto, never or a path)");
                        }
                      })}});
    s.push_back(
        {"eval",
         false,
         {{"every",
           [](const Section& s, RunConfig& c) {
             if (!c.data.val.empty()) c.eval.every = 200;
             s.integer("every", c.eval.every);
             s.at_least(c.eval.every, 0, "every");
             if (c.eval.every > 0 && c.data.val.empty()) {
               s.fail("every", "eval.every > 0 needs data.val (or set eval.every: 0)");
             }
           },
           [](YAML::Emitter& out, const RunConfig& c) { emit(out, "every", c.eval.every); }},
          entry("batches", &RunConfig::eval, &EvalConfig::batches, at_least(1)),
          {"tasks",
           [](const Section& s, RunConfig& c) {
             if (!s.has("tasks")) return;
             const YAML::Node list = s.value("tasks");
             if (!list.IsSequence()) s.fail("tasks", "expected a list of task files, got " + describe(list));
             for (const auto& item : list) {
               if (!item.IsScalar() || item.Scalar().empty()) {
                 s.fail("tasks", "expected task file paths, got " + describe(item));
               }
               std::error_code ec;  // exists() leaves it clear for a path that is not there
               if (s.check_paths() && !(std::filesystem::exists(item.Scalar(), ec) &&
                                        std::filesystem::is_regular_file(item.Scalar(), ec))) {
                 s.fail("tasks", "task file '" + item.Scalar() + "' " +
                                     (ec ? "cannot be looked up: " + ec.message() : "does not exist"));
               }
               c.eval.tasks.push_back(item.Scalar());
             }
           },
           [](YAML::Emitter& out, const RunConfig& c) {
             out << YAML::Key << "tasks" << YAML::Value << YAML::Flow << YAML::BeginSeq;
             for (const std::string& task : c.eval.tasks) out << task;
             out << YAML::EndSeq;
           }},
          entry("tasks_every", &RunConfig::eval, &EvalConfig::tasks_every, at_least(0)),
          entry("tasks_limit", &RunConfig::eval, &EvalConfig::tasks_limit, at_least(0)),
          entry<EvalConfig, std::string>("decoder", &RunConfig::eval, &EvalConfig::decoder, decoder_choice_check)}});
    s.push_back({"logging",
                 false,
                 {entry("every", &RunConfig::logging, &LoggingConfig::every, at_least(1)),
                  entry("tensorboard", &RunConfig::logging, &LoggingConfig::tensorboard),
                  entry<LoggingConfig, std::int64_t>(
                      "timeline_step", &RunConfig::logging, &LoggingConfig::timeline_step,
                      [](const Section& s, const std::string& key, const std::int64_t& v, const RunConfig& c) {
                        s.at_least(v, 0, key);
                        s.check(v == 0 || c.device == Device::cuda, key, "0 (the timeline needs device: cuda)",
                                std::to_string(v));
                      })}});
    s.push_back({"sample",
                 false,
                 {entry("every", &RunConfig::sample, &SampleConfig::every, at_least(0)),
                  entry("tokens", &RunConfig::sample, &SampleConfig::tokens, at_least(1)),
                  entry("prompt", &RunConfig::sample, &SampleConfig::prompt),
                  entry<SampleConfig, std::string>("decoder", &RunConfig::sample, &SampleConfig::decoder,
                                                   decoder_choice_check)}});
    return s;
  }();
  return sections;
}

std::vector<std::string> top_level_keys() {
  std::vector<std::string> keys;
  for (const SectionSchema& section : schema()) keys.push_back(section.name);
  return keys;
}

const std::map<std::string, std::vector<std::string>>& section_keys() {
  static const std::map<std::string, std::vector<std::string>> sections = [] {
    std::map<std::string, std::vector<std::string>> s;
    for (const SectionSchema& section : schema()) {
      if (section.scalar) continue;
      if (section.key_names) {
        s[section.name] = section.key_names();
        continue;
      }
      for (const KeySchema& key : section.keys) s[section.name].push_back(key.name);
    }
    return s;
  }();
  return sections;
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
  for (const SectionSchema& section : schema()) {
    if (section.read) {
      section.read(reader, root, c);
      continue;
    }
    const Section s(reader, root, section.name, section.required);
    for (const KeySchema& key : section.keys) {
      if (!key.required.empty()) s.require(key.name, key.required);
    }
    for (const KeySchema& key : section.keys) key.read(s, c);
  }
  return c;
}

}  // namespace

const char* device_name(Device device) { return device == Device::cuda ? "cuda" : "cpu"; }
const char* precision_name(Precision precision) { return precision == Precision::bf16 ? "bf16" : "fp32"; }

RunConfig parse_run_config(const std::string& yaml, const std::string& source,
                           const std::vector<std::string>& overrides, const ConfigOptions& options) {
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
    throw core::InputError(source + ": expected a mapping with the sections " + joined(top_level_keys()) + ", got " +
                           describe(root));
  }
  const Reader reader(source, apply_overrides(root, overrides), options.check_paths);
  return read_config(root, reader);
}

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides,
                          const ConfigOptions& options) {
  constexpr std::uintmax_t kMaxConfigBytes = 1 << 20;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    throw core::InputError(path + ": " +
                           (std::filesystem::exists(path, ec) ? "not a regular file" : "cannot open the config file"));
  }
  if (std::filesystem::file_size(path, ec) > kMaxConfigBytes) {
    throw core::InputError(path + ": larger than " + std::to_string(kMaxConfigBytes) + " bytes: not a config file");
  }
  std::ifstream in(path);
  if (!in) throw core::InputError(path + ": cannot open the config file");
  std::stringstream text;
  text << in.rdbuf();
  return parse_run_config(text.str(), path, overrides, options);
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
  out << YAML::BeginMap;
  for (const SectionSchema& section : schema()) {
    if (section.scalar) {
      section.write(out, c);
      continue;
    }
    out << YAML::Key << section.name << YAML::Value << YAML::BeginMap;
    if (section.write) {
      section.write(out, c);
    } else {
      for (const KeySchema& key : section.keys) key.write(out, c);
    }
    out << YAML::EndMap;
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace trainer
