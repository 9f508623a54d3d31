// Qwen3 behind the model interface: the config table (YAML keys, config.json keys, defaults,
// ranges), the presets, and the spec that builds the cpu and cuda models of a shape.
#pragma once

#include "models/model.h"
#include "models/qwen3/config.h"
#include "models/qwen3/model_cuda.h"

namespace models::qwen3 {

const Family& qwen3_family();

// A shape of the Qwen3 family as the typed config the Qwen3 code uses, and back.
Qwen3Config config_from_shape(const Shape& shape);
Shape shape_from_config(const Qwen3Config& config, Recompute recompute = Recompute::none);

}  // namespace models::qwen3
