// Parameter specs and Hugging Face tensor names of the E29a language model (config.h).
#include "models/e29a/config.h"

#include <algorithm>

namespace models::e29a {

std::string layer_prefix(std::int64_t layer) { return "layers." + std::to_string(layer) + "."; }

std::int64_t E29aConfig::parameter_count() const {
  const std::int64_t d = hidden_size;
  const std::int64_t per_layer = d + 2 * d * d + d * d + d + d * d + n_slots * d;
  return vocab_size * d * (tie_word_embeddings ? 1 : 2) + num_layers * per_layer + d;
}

std::vector<optim::ParamSpec> parameter_specs(const E29aConfig& c) {
  using optim::InitKind;
  const std::int64_t d = c.hidden_size;
  std::vector<optim::ParamSpec> p;
  // stacked: the rows of each matrix stacked in it (0: one matrix); < 0: not a hidden matrix.
  auto matrix = [&](std::string name, std::int64_t rows, InitKind init, float gain, std::int64_t stacked) {
    p.push_back({.name = std::move(name),
                 .shape = {rows, d},
                 .decay = true,
                 .factored = true,
                 .hidden_matrix = stacked >= 0,
                 .stacked_rows = std::max<std::int64_t>(stacked, 0),
                 .init = init,
                 .init_std = 0.02f,
                 .init_gain = gain});
  };
  auto vector = [&](std::string name, InitKind init) {
    p.push_back({.name = std::move(name), .shape = {d}, .decay = false, .init = init});
  };
  matrix("embed_tokens", c.vocab_size, InitKind::normal, 1.0f, -1);
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const std::string prefix = layer_prefix(l);
    vector(prefix + "norm", InitKind::ones);
    matrix(prefix + "w_xz", 2 * d, InitKind::xavier_uniform, 1.0f, d);  // W_x over W_z
    matrix(prefix + "w_h", d, InitKind::orthogonal, 0.9f, 0);
    vector(prefix + "b_h", InitKind::zeros);
    matrix(prefix + "w_write", d, InitKind::xavier_uniform, 1.0f, 0);
    // The initial tape is a state, not a weight: no decay.
    p.push_back({.name = prefix + "tape0",
                 .shape = {c.n_slots, d},
                 .decay = false,
                 .factored = true,
                 .init = c.tape_init_zeros ? InitKind::zeros : InitKind::normal,
                 .init_std = static_cast<float>(c.tape_init_std)});
  }
  vector("final_norm", InitKind::ones);
  if (!c.tie_word_embeddings) matrix("lm_head", c.vocab_size, InitKind::normal, 1.0f, -1);
  return p;
}

std::vector<std::pair<std::string, std::string>> hf_tensor_names(const E29aConfig& c) {
  std::vector<std::pair<std::string, std::string>> m;
  m.emplace_back("model.embed_tokens.weight", "embed_tokens");
  for (std::int64_t l = 0; l < c.num_layers; ++l) {
    const std::string hf = "model.layers." + std::to_string(l) + ".";
    const std::string ours = layer_prefix(l);
    m.emplace_back(hf + "input_layernorm.weight", ours + "norm");
    m.emplace_back(hf + "mixer.W_xz.weight", ours + "w_xz");
    m.emplace_back(hf + "mixer.W_h.weight", ours + "w_h");
    m.emplace_back(hf + "mixer.b_h", ours + "b_h");
    m.emplace_back(hf + "mixer.W_write.weight", ours + "w_write");
    m.emplace_back(hf + "mixer.tape_init", ours + "tape0");
  }
  m.emplace_back("model.norm.weight", "final_norm");
  if (!c.tie_word_embeddings) m.emplace_back("lm_head.weight", "lm_head");
  return m;
}

}  // namespace models::e29a
