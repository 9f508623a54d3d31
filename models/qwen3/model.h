// The Qwen3 decoder (as transformers' modeling_qwen3) over a slab, on the cpu backend in fp32:
// forward to the loss, backward to the slab's gradients (accumulated), logits for evaluation,
// and initialisation from the parameter specs. The GPU path (bf16 compute from the mirror)
// reuses the same structure with the CUDA ops.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "models/cpu_weights.h"
#include "models/ops/cross_entropy.h"
#include "models/qwen3/config.h"
#include "optim/slab.h"
#include "optim/weight_source.h"

namespace models::qwen3 {

class Qwen3Model {
 public:
  // `slab` must be laid out from parameter_specs(config) and live on cpu. The weights are the
  // slab's master weights, which must then cover the whole slab, or `full_weights` (fp32 over the
  // whole slab, e.g. gathered from the shards of every rank under ZeRO-1/2), or, with ZeRO-3,
  // what `source` gathers range by range (the embedding, each layer, the final norm and head:
  // Qwen3TensorIndex's ranges), acquired before each use in the forward and again in the backward.
  Qwen3Model(const Qwen3Config& config, optim::Slab& slab, float* full_weights = nullptr,
             optim::WeightSource* source = nullptr);

  const Qwen3Config& config() const { return config_; }

  // Writes every master weight from its spec's init (normal(0, std) or ones), seeded.
  void initialize(std::uint64_t seed);

  // Mean cross-entropy of `targets` (ignore index -100) given `ids`, both [batch, seq]; with
  // `backward`, adds the gradient of grad_scale * loss to the slab's gradients. Without it,
  // `token_losses` (empty or [batch * seq]) receives each token's loss.
  ops::CrossEntropyResult step(std::span<const std::int32_t> ids, std::span<const std::int32_t> targets,
                               std::int64_t batch, std::int64_t seq, bool backward, double grad_scale = 1.0,
                               std::span<float> token_losses = {});

  // Logits [batch * seq, vocab] for `ids`.
  void logits(std::span<const std::int32_t> ids, std::int64_t batch, std::int64_t seq, std::span<float> out);

 private:
  using LayerWeights = Qwen3LayerTensors;
  struct LayerActivations;

  std::span<float> weight(int tensor);
  std::span<float> grad(int tensor);
  // Runs the stack to the final norm's output; keeps what the backward needs.
  void forward(std::span<const std::int32_t> ids, std::int64_t batch, std::int64_t seq,
               std::vector<LayerActivations>& saved, std::vector<float>& final_in, std::vector<float>& final_out,
               std::vector<float>& final_rstd);

  Qwen3Config config_;
  optim::Slab& slab_;
  CpuWeights weights_;
  int embed_ = 0, final_norm_ = 0, head_ = 0;
  std::vector<LayerWeights> layers_;
  optim::Range embed_range_, tail_range_;
  std::vector<optim::Range> layer_ranges_;
  optim::Range head_range() const { return head_ == embed_ ? embed_range_ : tail_range_; }
};

}  // namespace models::qwen3
