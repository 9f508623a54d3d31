// A family's config table at work: complete shapes from fallbacks and presets, each field's type
// and range, config.json read and written from the same table, and JSON files read with the
// parser's line and column in errors. The trainer's YAML reader (trainer/config.cpp) uses the
// same table and field checks.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "models/model.h"

namespace models {

// Every field's fallback, then the values of `preset` (empty: no preset).
Shape base_shape(const Family& family, const std::string& preset);

// What is wrong with `value` for `field` ("expected an integer in [1, 1048576], got 0"), or nullopt.
std::optional<std::string> field_problem(const ConfigField& field, const nlohmann::json& value);
// A value as written in messages.
std::string describe_value(const nlohmann::json& value);

// Every field of `shape`, then the family's rules; core::InputError "<where>: model.<key>: ...".
void check_shape(const Family& family, const Shape& shape, const std::string& where);

// The fields of a config.json object: family.check_hf first, then each field with a config.json
// key (type and range; absent keys take hf_default, or are an error when it is null); fields
// without a config.json key keep `base`'s value. core::InputError "<where>: <config.json key>: ...".
Shape shape_from_hf(const Family& family, const nlohmann::json& config, const std::string& where, const Shape& base);
// The config.json keys of `shape` (nested keys such as rope_parameters.rope_theta expanded).
nlohmann::ordered_json hf_fields(const Family& family, const Shape& shape);
// The part of `shape` that defines the weights (fields with ConfigField::shape).
Shape weights_shape(const Family& family, const Shape& shape);

// Parses a JSON file; core::InputError with the path and the parser's line and column.
nlohmann::json read_json_file(const std::filesystem::path& path);

}  // namespace models
