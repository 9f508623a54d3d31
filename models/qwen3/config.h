// Qwen3 model shape (as Hugging Face's Qwen3Config; each member is bound to a row of the config
// table in models/qwen3/family.cpp, which gives its default), named presets, and the parameter
// list in slab order. q/k/v projections are one tensor `qkv` and gate/up one tensor `gate_up`, so each
// is a single GEMM; a layer's tensors are contiguous so its gradients are one slab range.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "optim/param_spec.h"
#include "optim/slab_layout.h"

namespace models::qwen3 {

struct Qwen3Config {
  std::int64_t vocab_size = 151936;
  std::int64_t hidden_size = 1024;
  std::int64_t intermediate_size = 3072;
  std::int64_t num_layers = 28;
  std::int64_t num_heads = 16;
  std::int64_t num_kv_heads = 8;
  std::int64_t head_dim = 128;
  double rope_theta = 1e6;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = true;
  std::int64_t max_position_embeddings = 40960;

  std::int64_t q_size() const { return num_heads * head_dim; }
  std::int64_t kv_size() const { return num_kv_heads * head_dim; }
  std::int64_t qkv_size() const { return q_size() + 2 * kv_size(); }
  std::int64_t parameter_count() const;

  bool operator==(const Qwen3Config&) const = default;
};

// Throws core::InputError naming `where` when a field is out of range or inconsistent: the
// checks of the config table and the family's rules (models/qwen3/family.cpp), as for YAML.
void validate(const Qwen3Config& config, const std::string& where);

// qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, and test sizes qwen3-tiny (byte vocabulary) and qwen3-test (the
// preset table in models/qwen3/family.cpp).
Qwen3Config preset(const std::string& name);
std::vector<std::string> preset_names();

// Parameter specs in slab order: embed_tokens; per layer input_norm, qkv, q_norm, k_norm,
// o_proj, post_norm, gate_up, down; final_norm; lm_head (untied only). 2-D weights are marked
// factored (Adafactor) and decayed, those of the layers also hidden matrices; norm weights none of these.
// Initialisation: normal(0, 0.02) for matrices (Hugging Face's initializer_range), ones for norms. qkv has the parts q,
// k and v and gate_up the parts gate and up: stored fused for the GEMMs, separate tensors to the optimizers.
std::vector<optim::ParamSpec> parameter_specs(const Qwen3Config& config);

// Where a Hugging Face tensor lives in ours: tensor name and first row (q/k/v and gate/up are
// row blocks of the fused tensors).
struct HfLocation {
  std::string name;
  std::int64_t row_offset = 0;
  std::int64_t rows = 0;
};
std::vector<std::pair<std::string, HfLocation>> hf_tensor_map(const Qwen3Config& config);

// Where each tensor of a Qwen3 model sits in a slab laid out from parameter_specs(): indices
// into its layout, layer by layer; the head is the embedding when tied. core::Error names a tensor
// the layout lacks (`who`: the model or decoder asking).
struct Qwen3LayerTensors {
  int input_norm, qkv, q_norm, k_norm, o_proj, post_norm, gate_up, down;
};
struct Qwen3TensorIndex {
  int embed = 0, final_norm = 0, head = 0;
  std::vector<Qwen3LayerTensors> layers;
  Qwen3TensorIndex(const Qwen3Config& config, const optim::SlabLayout& layout, const std::string& who);

  // The ranges the model reads its weights in (ZeRO-3 gathers each whole): the embedding, each
  // layer (input_norm to down, contiguous), then the final norm with an untied head after it.
  optim::Range embed_range(const optim::SlabLayout& layout) const;
  optim::Range layer_range(const optim::SlabLayout& layout, std::size_t layer) const;
  optim::Range tail_range(const optim::SlabLayout& layout) const;
  // The gradient ranges of layer `layer`'s backward, in the order it finishes them: the MLP
  // (post_norm to down) and the attention (input_norm to o_proj).
  optim::Range mlp_range(const optim::SlabLayout& layout, std::size_t layer) const;
  optim::Range attention_range(const optim::SlabLayout& layout, std::size_t layer) const;
  // The largest range the cuda backward hands a limited sink: a layer's MLP or attention, the
  // final norm, or one row of a vocabulary-sized tensor (`hidden` elements).
  std::int64_t largest_gradient_range(const optim::SlabLayout& layout, std::int64_t hidden) const;
};

}  // namespace models::qwen3
