// The Qwen3-0.6B parameter list in Hugging Face order (310 tensors, 596,049,920 elements, tied
// 151936 x 1024 embedding), as the optimizer benchmarks see it. Norm weights take no decay.
#pragma once

#include <string>
#include <vector>

#include "optim/param_spec.h"

namespace bench {

inline std::vector<optim::ParamSpec> qwen3_0_6b_params() {
  constexpr std::int64_t hidden = 1024, layers = 28, heads = 16, kv_heads = 8, head_dim = 128, ffn = 3072,
                         vocab = 151936;
  std::vector<optim::ParamSpec> p;
  auto add = [&](std::string name, core::Shape shape, bool decay = true) {
    p.push_back({.name = std::move(name), .shape = std::move(shape), .decay = decay});
  };
  add("model.embed_tokens.weight", {vocab, hidden});
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    add(pre + "input_layernorm.weight", {hidden}, false);
    add(pre + "self_attn.q_proj.weight", {heads * head_dim, hidden});
    add(pre + "self_attn.k_proj.weight", {kv_heads * head_dim, hidden});
    add(pre + "self_attn.v_proj.weight", {kv_heads * head_dim, hidden});
    add(pre + "self_attn.o_proj.weight", {hidden, heads * head_dim});
    add(pre + "self_attn.q_norm.weight", {head_dim}, false);
    add(pre + "self_attn.k_norm.weight", {head_dim}, false);
    add(pre + "post_attention_layernorm.weight", {hidden}, false);
    add(pre + "mlp.gate_proj.weight", {ffn, hidden});
    add(pre + "mlp.up_proj.weight", {ffn, hidden});
    add(pre + "mlp.down_proj.weight", {hidden, ffn});
  }
  add("model.norm.weight", {hidden}, false);
  return p;
}

}  // namespace bench
