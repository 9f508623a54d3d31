#include "models/qwen3/config.h"

#include <algorithm>

#include "core/error.h"
#include "models/weight_holds.h"

namespace models::qwen3 {

namespace {

std::string layer(std::int64_t i) { return "layers." + std::to_string(i) + "."; }

}  // namespace

std::int64_t Qwen3Config::parameter_count() const {
  const std::int64_t per_layer = 2 * hidden_size + qkv_size() * hidden_size + 2 * head_dim + hidden_size * q_size() +
                                 3 * intermediate_size * hidden_size;
  return vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2) + num_layers * per_layer + hidden_size;
}

std::vector<optim::ParamSpec> parameter_specs(const Qwen3Config& c) {
  using optim::InitKind;
  std::vector<optim::ParamSpec> p;
  auto matrix = [&](std::string name, std::int64_t rows, std::int64_t cols, bool hidden) {
    p.push_back({.name = std::move(name),
                 .shape = {rows, cols},
                 .decay = true,
                 .factored = true,
                 .hidden_matrix = hidden,
                 .init = InitKind::normal,
                 .init_std = 0.02f});
  };
  auto norm = [&](std::string name, std::int64_t n) {
    p.push_back({.name = std::move(name), .shape = {n}, .decay = false, .init = InitKind::ones});
  };
  matrix("embed_tokens", c.vocab_size, c.hidden_size, false);
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    norm(layer(i) + "input_norm", c.hidden_size);
    matrix(layer(i) + "qkv", c.qkv_size(), c.hidden_size, true);
    p.back().parts = {{layer(i) + "q", c.q_size()}, {layer(i) + "k", c.kv_size()}, {layer(i) + "v", c.kv_size()}};
    norm(layer(i) + "q_norm", c.head_dim);
    norm(layer(i) + "k_norm", c.head_dim);
    matrix(layer(i) + "o_proj", c.hidden_size, c.q_size(), true);
    norm(layer(i) + "post_norm", c.hidden_size);
    matrix(layer(i) + "gate_up", 2 * c.intermediate_size, c.hidden_size, true);
    p.back().parts = {{layer(i) + "gate", c.intermediate_size}, {layer(i) + "up", c.intermediate_size}};
    matrix(layer(i) + "down", c.hidden_size, c.intermediate_size, true);
  }
  norm("final_norm", c.hidden_size);
  if (!c.tie_word_embeddings) matrix("lm_head", c.vocab_size, c.hidden_size, false);
  return p;
}

std::vector<std::pair<std::string, HfLocation>> hf_tensor_map(const Qwen3Config& c) {
  std::vector<std::pair<std::string, HfLocation>> m;
  m.push_back({"model.embed_tokens.weight", {"embed_tokens", 0, c.vocab_size}});
  for (std::int64_t i = 0; i < c.num_layers; ++i) {
    const std::string hf = "model.layers." + std::to_string(i) + ".";
    const std::string ours = layer(i);
    m.push_back({hf + "input_layernorm.weight", {ours + "input_norm", 0, c.hidden_size}});
    m.push_back({hf + "self_attn.q_proj.weight", {ours + "qkv", 0, c.q_size()}});
    m.push_back({hf + "self_attn.k_proj.weight", {ours + "qkv", c.q_size(), c.kv_size()}});
    m.push_back({hf + "self_attn.v_proj.weight", {ours + "qkv", c.q_size() + c.kv_size(), c.kv_size()}});
    m.push_back({hf + "self_attn.q_norm.weight", {ours + "q_norm", 0, c.head_dim}});
    m.push_back({hf + "self_attn.k_norm.weight", {ours + "k_norm", 0, c.head_dim}});
    m.push_back({hf + "self_attn.o_proj.weight", {ours + "o_proj", 0, c.hidden_size}});
    m.push_back({hf + "post_attention_layernorm.weight", {ours + "post_norm", 0, c.hidden_size}});
    m.push_back({hf + "mlp.gate_proj.weight", {ours + "gate_up", 0, c.intermediate_size}});
    m.push_back({hf + "mlp.up_proj.weight", {ours + "gate_up", c.intermediate_size, c.intermediate_size}});
    m.push_back({hf + "mlp.down_proj.weight", {ours + "down", 0, c.hidden_size}});
  }
  m.push_back({"model.norm.weight", {"final_norm", 0, c.hidden_size}});
  if (!c.tie_word_embeddings) m.push_back({"lm_head.weight", {"lm_head", 0, c.vocab_size}});
  return m;
}

Qwen3TensorIndex::Qwen3TensorIndex(const Qwen3Config& config, const optim::SlabLayout& layout, const std::string& who) {
  auto find = [&](const std::string& name) {
    const int i = layout.find(name);
    if (i < 0) throw core::Error(who + ": the slab has no tensor '" + name + "' (not laid out from parameter_specs)");
    return i;
  };
  embed = find("embed_tokens");
  final_norm = find("final_norm");
  head = config.tie_word_embeddings ? embed : find("lm_head");
  for (std::int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    layers.push_back({find(p + "input_norm"), find(p + "qkv"), find(p + "q_norm"), find(p + "k_norm"),
                      find(p + "o_proj"), find(p + "post_norm"), find(p + "gate_up"), find(p + "down")});
  }
}

optim::Range Qwen3TensorIndex::embed_range(const optim::SlabLayout& layout) const {
  return tensor_span(layout, embed, embed);
}

optim::Range Qwen3TensorIndex::layer_range(const optim::SlabLayout& layout, std::size_t layer) const {
  return tensor_span(layout, layers[layer].input_norm, layers[layer].down);
}

optim::Range Qwen3TensorIndex::tail_range(const optim::SlabLayout& layout) const {
  return tail_span(layout, final_norm, head, embed);
}

optim::Range Qwen3TensorIndex::mlp_range(const optim::SlabLayout& layout, std::size_t layer) const {
  return tensor_span(layout, layers[layer].post_norm, layers[layer].down);
}

optim::Range Qwen3TensorIndex::attention_range(const optim::SlabLayout& layout, std::size_t layer) const {
  return tensor_span(layout, layers[layer].input_norm, layers[layer].o_proj);
}

std::int64_t Qwen3TensorIndex::largest_gradient_range(const optim::SlabLayout& layout, std::int64_t hidden) const {
  std::int64_t largest = std::max(tensor_span(layout, final_norm, final_norm).size(), hidden);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    largest = std::max({largest, mlp_range(layout, l).size(), attention_range(layout, l).size()});
  }
  return largest;
}

}  // namespace models::qwen3
