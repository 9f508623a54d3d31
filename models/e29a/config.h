// The E29a language model's shape and parameters: token embedding (byte or BPE vocabulary), per
// layer x = x + E29a(RMSNorm(x)) or its normed sum (`residual`, residual.h; layer.h has the
// layer's equations), final RMSNorm, a tied or untied head. Slab order, layer by layer (one
// layer's tensors are one contiguous range):
//   embed_tokens [V, D]
//   layers.l.norm [D], layers.l.w_xz [2D, D], layers.l.w_h [D, D], layers.l.b_h [D],
//   layers.l.w_write [D, D], layers.l.tape0 [N, D]          (l = 0 .. L-1)
//   final_norm [D], lm_head [V, D] (untied only)
// Initialisation as upstream: W_h orthogonal x 0.9, W_xz and W_write Xavier uniform, b_h zero,
// norms one, the embedding (and head) normal(0, 0.02); the initial tape normal(0, tape_init_std)
// ("learned") or zero ("zeros", upstream's start: every slot stays equal, see docs/e29a.md).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "models/e29a/layer.h"
#include "optim/param_spec.h"

namespace models::e29a {

// How a layer's output joins the residual stream (residual.h has the definitions).
enum class Residual { pre_norm, normed_sum };

struct E29aConfig {
  std::int64_t vocab_size = 256;
  std::int64_t hidden_size = 256;
  std::int64_t num_layers = 4;
  std::int64_t n_slots = 8;
  bool tie_word_embeddings = true;
  bool tape_init_zeros = false;  // tape_init: zeros (true) | learned (false)
  Residual residual = Residual::pre_norm;
  double tape_init_std = 0.5;
  double rms_norm_eps = 1e-6;
  std::int64_t checkpoint_interval = 0;  // cuda: tape checkpoint every K steps (0: about sqrt(seq))
  LayerBackwardOptions backward;         // detach_scores, carry_grad_clip (default: the exact gradient)
  RecurrenceKernel recurrence_kernel = RecurrenceKernel::automatic;  // cuda: both directions

  std::int64_t parameter_count() const;
};

// Index of each tensor of a layer in the slab, and of the model's own tensors.
struct LayerTensors {
  int norm, w_xz, w_h, b_h, w_write, tape0;
};

std::string layer_prefix(std::int64_t layer);
std::vector<optim::ParamSpec> parameter_specs(const E29aConfig& config);
// Hugging Face tensor names (E29aForCausalLM) and the slab tensor each is (same shape).
std::vector<std::pair<std::string, std::string>> hf_tensor_names(const E29aConfig& config);

}  // namespace models::e29a
