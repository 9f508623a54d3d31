#include "models/model_config.h"

#include <charconv>
#include <cmath>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace models {

namespace {

constexpr std::size_t kMaxJsonDepth = 64;           // config.json nests two or three levels
constexpr std::uintmax_t kMaxJsonBytes = 64 << 20;  // an index or config far beyond any real one

std::string format_number(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, separator);) parts.push_back(part);
  return parts;
}

// The value at a dotted path ("rope_parameters.rope_theta"), or nullptr.
const nlohmann::json* find_path(const nlohmann::json& j, const std::string& path) {
  const nlohmann::json* node = &j;
  for (const std::string& key : split(path, '.')) {
    if (!node->is_object()) return nullptr;
    const auto it = node->find(key);
    if (it == node->end()) return nullptr;
    node = &*it;
  }
  return node;
}

void set_path(nlohmann::ordered_json& j, const std::string& path, const nlohmann::json& value) {
  nlohmann::ordered_json* node = &j;
  const auto keys = split(path, '.');
  for (std::size_t i = 0; i + 1 < keys.size(); ++i) node = &(*node)[keys[i]];
  (*node)[keys.back()] = value;
}

std::string range_text(const ConfigField& f) {
  if (f.min > f.max) return "";
  if (f.type == FieldType::integer) {
    return " in [" + std::to_string(static_cast<long long>(f.min)) + ", " +
           std::to_string(static_cast<long long>(f.max)) + "]";
  }
  return " in [" + format_number(f.min) + ", " + format_number(f.max) + "]";
}

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

}  // namespace

std::string describe_value(const nlohmann::json& value) {
  if (value.is_null()) return "nothing";
  if (value.is_string()) return "'" + value.get<std::string>() + "'";
  if (value.is_number_float()) return format_number(value.get<double>());
  if (value.is_array()) return "a list";
  if (value.is_object()) return "a mapping";
  return value.dump();
}

std::optional<std::string> field_problem(const ConfigField& f, const nlohmann::json& v) {
  switch (f.type) {
    case FieldType::integer: {
      const bool integral = v.is_number_integer() ||
                            (v.is_number_float() && std::isfinite(v.get<double>()) &&
                             std::floor(v.get<double>()) == v.get<double>() && std::fabs(v.get<double>()) < 9.0e15);
      if (!integral) return "expected an integer" + range_text(f) + ", got " + describe_value(v);
      const double x = v.is_number_unsigned() ? static_cast<double>(v.get<std::uint64_t>()) : v.get<double>();
      if (f.min <= f.max && x < f.min)
        return "expected an integer >= " + std::to_string(static_cast<long long>(f.min)) + ", got " + v.dump();
      if (f.min <= f.max && x > f.max)
        return "expected an integer <= " + std::to_string(static_cast<long long>(f.max)) + ", got " + v.dump();
      return std::nullopt;
    }
    case FieldType::number: {
      if (!v.is_number() || !std::isfinite(v.get<double>()))
        return "expected a finite number" + range_text(f) + ", got " + describe_value(v);
      const double x = v.get<double>();
      if (f.min <= f.max && (x < f.min || x > f.max))
        return "expected a number" + range_text(f) + ", got " + format_number(x);
      return std::nullopt;
    }
    case FieldType::boolean:
      if (!v.is_boolean()) return "expected true or false, got " + describe_value(v);
      return std::nullopt;
    case FieldType::choice:
      if (v.is_string()) {
        for (const auto& c : f.choices) {
          if (v.get<std::string>() == c) return std::nullopt;
        }
      }
      return "expected one of [" + joined(f.choices) + "], got " + describe_value(v);
  }
  return std::nullopt;
}

Shape base_shape(const Family& family, const std::string& preset) {
  Shape shape = Shape::object();
  for (const ConfigField& f : family.fields()) shape[f.key] = f.fallback;
  if (!preset.empty()) {
    const Shape values = family.preset(preset);
    for (const auto& [key, value] : values.items()) shape[key] = value;
  }
  return shape;
}

void check_shape(const Family& family, const Shape& shape, const std::string& where) {
  for (const ConfigField& f : family.fields()) {
    if (!shape.contains(f.key)) throw core::InputError(where + ": model." + f.key + ": missing");
    if (auto problem = field_problem(f, shape[f.key]))
      throw core::InputError(where + ": model." + f.key + ": " + *problem);
  }
  if (auto error = family.check(shape)) throw core::InputError(where + ": model." + error->key + ": " + error->message);
}

Shape shape_from_hf(const Family& family, const nlohmann::json& config, const std::string& where, const Shape& base) {
  if (!config.is_object()) throw core::InputError(where + ": expected a JSON object");
  std::optional<FieldError> hf_error;
  try {
    hf_error = family.check_hf(config);
  } catch (const nlohmann::json::exception& e) {  // a family's check reading a key of another type
    throw core::InputError(where + ": unexpected value: " + e.what());
  }
  if (hf_error) throw core::InputError(where + ": " + hf_error->key + ": " + hf_error->message);
  Shape shape = base;
  for (const ConfigField& f : family.fields()) {
    if (f.hf_key.empty()) continue;
    const nlohmann::json* value = nullptr;
    std::string used;
    for (const std::string& key : split(f.hf_key, '|')) {
      if ((value = find_path(config, key))) {
        used = key;
        break;
      }
    }
    if (value == nullptr) {
      if (f.hf_default.is_null()) throw core::InputError(where + ": missing key '" + split(f.hf_key, '|')[0] + "'");
      shape[f.key] = f.hf_default;
      continue;
    }
    if (auto problem = field_problem(f, *value)) throw core::InputError(where + ": " + used + ": " + *problem);
    nlohmann::json v = *value;
    if (f.type == FieldType::integer && v.is_number_float()) v = static_cast<std::int64_t>(v.get<double>());
    if (f.type == FieldType::number) v = v.get<double>();
    shape[f.key] = v;
  }
  if (auto error = family.check(shape)) {
    std::string key = error->key;
    for (const ConfigField& f : family.fields()) {
      if (f.key == error->key && !f.hf_key.empty()) key = split(f.hf_key, '|')[0];
    }
    throw core::InputError(where + ": " + key + ": " + error->message);
  }
  return shape;
}

nlohmann::ordered_json hf_fields(const Family& family, const Shape& shape) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const ConfigField& f : family.fields()) {
    if (!f.hf_key.empty()) set_path(j, split(f.hf_key, '|')[0], shape.at(f.key));
  }
  return j;
}

Shape weights_shape(const Family& family, const Shape& shape) {
  Shape out = Shape::object();
  for (const ConfigField& f : family.fields()) {
    if (f.shape) out[f.key] = shape.at(f.key);
  }
  return out;
}

nlohmann::json read_json_file(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw core::InputError(path.string() + ": not a regular file");
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec || size > kMaxJsonBytes) {
    throw core::InputError(path.string() + ": " +
                           (ec ? "cannot read its size" : "larger than " + std::to_string(kMaxJsonBytes) + " bytes"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw core::InputError(path.string() + ": cannot open");
  std::string text(static_cast<std::size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (static_cast<std::uintmax_t>(in.gcount()) != size) throw core::InputError(path.string() + ": read failed");
  try {
    return nlohmann::json::parse(text, [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (static_cast<std::size_t>(depth) > kMaxJsonDepth) {
        throw core::InputError(path.string() + ": nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
      }
      return true;
    });
  } catch (const nlohmann::json::parse_error& e) {
    std::size_t line = 1, column = 1;
    for (std::size_t i = 0; i + 1 < e.byte && i < text.size(); ++i) {
      if (text[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw core::InputError(path.string() + ":" + std::to_string(line) + ":" + std::to_string(column) +
                           ": not valid JSON: " + e.what());
  } catch (const nlohmann::json::exception& e) {  // a number beyond double's range, say
    throw core::InputError(path.string() + ": not valid JSON: " + e.what());
  }
}

std::int64_t ModelSpec::parameter_count() const {
  std::int64_t n = 0;
  for (const auto& p : parameters()) n += core::shape_numel(p.shape);
  return n;
}

int param_index(const std::vector<optim::ParamSpec>& params, const std::string& name, const std::string& family) {
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].name == name) return static_cast<int>(i);
  }
  throw core::Error(family + ": no parameter '" + name + "'");
}

HfTensor tied_head_tensor(int embed_param, std::int64_t vocab, std::int64_t hidden) {
  return {.name = "lm_head.weight",
          .param = embed_param,
          .row_offset = 0,
          .rows = vocab,
          .shape = {vocab, hidden},
          .optional = true,
          .tied_copy = true};
}

}  // namespace models
