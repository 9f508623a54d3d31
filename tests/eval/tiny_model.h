// A small byte-vocabulary model of a registered family on the cpu for the evaluation tests: the
// family's preset with a few fields overridden, weights from the family's initialisation plus
// noise (so the logits are far from uniform and choices differ), and its cpu scorer.
#pragma once

#include <memory>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "models/model.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "optim/initialize.h"
#include "optim/slab.h"

namespace test {

struct TinyModel {
  core::DeviceContext context{core::Device::cpu()};
  std::unique_ptr<models::ModelSpec> spec;
  std::unique_ptr<optim::Slab> slab;
  std::unique_ptr<models::TrainableModel> scorer;

  TinyModel(const std::string& family_name, const std::string& preset, const nlohmann::json& overrides,
            std::uint64_t seed, float noise = 0.3f) {
    const models::Family& family = models::family(family_name);
    models::Shape shape = models::base_shape(family, preset);
    for (const auto& [key, value] : overrides.items()) shape[key] = value;
    models::check_shape(family, shape, "tiny model");
    spec = family.spec(shape);
    slab = std::make_unique<optim::Slab>(optim::SlabLayout(spec->parameters(), 1), context);
    optim::initialize_owned(*slab, context, seed);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, noise);
    float* w = slab->master().as<float>();
    for (std::size_t i = 0; i < slab->master().bytes() / sizeof(float); ++i) w[i] += normal(rng);
    scorer = spec->trainable(*slab, context, {.max_tokens = 4096});
  }

  static TinyModel qwen3(std::uint64_t seed) {
    return TinyModel("qwen3", "qwen3-tiny",
                     {{"vocab_size", 256},
                      {"hidden_size", 64},
                      {"intermediate_size", 128},
                      {"num_layers", 2},
                      {"num_heads", 2},
                      {"num_kv_heads", 1},
                      {"head_dim", 32},
                      {"max_position_embeddings", 256}},
                     seed);
  }
  static TinyModel e29a(std::uint64_t seed) {
    return TinyModel("e29a", "e29a-tiny", {{"vocab_size", 256}, {"hidden_size", 32}, {"num_layers", 2}}, seed, 0.1f);
  }
};

}  // namespace test
