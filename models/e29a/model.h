// The E29a language model on the cpu backend in fp32 (config.h has the structure): forward to the
// loss and backward to the slab's gradients (accumulated) through the layer reference (layer.h),
// and the recurrent decoder, whose state per layer is the working state h [D] and the tape [N, D].
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/device.h"
#include "models/e29a/config.h"
#include "models/cpu_weights.h"
#include "models/e29a/layer.h"
#include "models/model.h"
#include "models/ops/cross_entropy.h"
#include "optim/slab.h"

namespace models::e29a {

// Slab tensor indices of a model laid out from parameter_specs(config); core::Error when missing.
struct TensorIndex {
  int embed = 0, final_norm = 0, head = 0;
  std::vector<LayerTensors> layers;
  TensorIndex(const E29aConfig& config, const optim::SlabLayout& layout);

  // The ranges the model reads its weights in (ZeRO-3 gathers each whole): the embedding, each
  // layer (norm to tape0, contiguous), then the final norm with an untied head after it.
  optim::Range embed_range(const optim::SlabLayout& layout) const;
  optim::Range layer_range(const optim::SlabLayout& layout, std::size_t layer) const;
  optim::Range tail_range(const optim::SlabLayout& layout) const;
};

class E29aCpu final : public TrainableModel {
 public:
  // The weights are the slab's master (covering the whole model), `full_weights`, or with ZeRO-3
  // what `source` gathers range by range (TensorIndex's ranges), before the forward's and the
  // backward's use of each.
  E29aCpu(const E29aConfig& config, optim::Slab& slab, const float* full_weights,
          optim::WeightSource* source = nullptr);

  void forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                        float grad_scale) override;
  void forward_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                    std::int64_t seq) override;
  const float* loss() const override { return &loss_; }
  // Diagnostics: while set, each forward_backward fills one trace per layer (layer.h).
  void set_backward_trace(std::vector<LayerBackwardTrace<float>>* traces) { traces_ = traces; }
  const float* token_losses() const override { return token_losses_.data(); }

 private:
  struct LayerSaved;
  std::span<const float> weight(int tensor) const;
  std::span<float> grad(int tensor);
  LayerWeights<float> layer_weights(const LayerTensors& t) const;
  ops::CrossEntropyResult run(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                              std::int64_t seq, bool backward, double grad_scale);

  E29aConfig config_;
  optim::Slab& slab_;
  mutable CpuWeights weights_;
  TensorIndex index_;
  optim::Range embed_range_, tail_range_;
  std::vector<optim::Range> layer_ranges_;
  float loss_ = 0;
  std::vector<LayerBackwardTrace<float>>* traces_ = nullptr;
  std::vector<float> token_losses_;  // of the last forward_loss
};

class E29aCpuDecoder final : public HostDecoder {
 public:
  E29aCpuDecoder(const E29aConfig& config, optim::Slab& slab, const core::DeviceContext& context,
                 const DecoderOptions& options);

  void prefill(std::span<const std::int32_t> tokens, float* all_logits = nullptr) override;
  void step(std::int32_t token, const std::int32_t* device_token = nullptr) override;

 private:
  std::span<const float> weight(int tensor) const;

  E29aConfig config_;
  optim::Slab& slab_;
  CpuWeights weights_;
  TensorIndex index_;
  std::vector<LayerState<float>> state_;  // per layer: h [D], tape [N, D]
};

}  // namespace models::e29a
