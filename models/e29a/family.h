// E29a behind the model interface: the config table (YAML keys, config.json keys, defaults,
// ranges), the presets, and the spec that builds the cpu and cuda models and decoders of a shape.
#pragma once

#include "models/e29a/config.h"
#include "models/model.h"

namespace models::e29a {

const Family& e29a_family();

// A shape of the E29a family as the typed config, and back.
E29aConfig config_from_shape(const Shape& shape);
Shape shape_from_config(const E29aConfig& config);

}  // namespace models::e29a
