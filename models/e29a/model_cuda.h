// The E29a language model on one GPU: bf16 activations and weights from the slab's bf16 mirror,
// the layers through the hybrid CUDA path (layer_cuda.h), the embedding, RMSNorm and fused
// chunked cross-entropy ops of models/ops. Weight gradients accumulate in fp32 into the slab, or
// go range by range to a gradient sink: each layer's tensors are one contiguous range, handed
// over as soon as that layer's backward is done (ZeRO-2 reduces them while the backward goes on).
// The recurrent layer's buffers are sized at the first micro-batch of a (batch, seq) shape (a
// larger shape later re-sizes them once); everything else at construction for max_tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "core/device.h"
#include "models/e29a/config.h"
#include "models/model.h"
#include "optim/gradient_sink.h"
#include "optim/slab.h"

namespace models::e29a {

class E29aCuda final : public TrainableModel {
 public:
  // `source`: ZeRO-3's weight source (optim/weight_source.h); null reads the slab's mirror.
  E29aCuda(const E29aConfig& config, optim::Slab& slab, const core::DeviceContext& context, std::int64_t max_tokens,
           optim::WeightSource* source = nullptr);
  ~E29aCuda() override;

  void forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                        float grad_scale) override;
  void forward_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                    std::int64_t seq) override;
  const float* loss() const override;
  const float* token_losses() const override;  // device fp32, of the last forward_loss
  const std::int32_t* invalid_id_flag() const override;
  void check_device_faults() override;  // the persistent recurrence's deadlines (LayerCuda::check)
  void set_gradient_sink(optim::GradientSink* sink) override;
  std::int64_t largest_gradient_range() const override;
  std::size_t activation_bytes() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Recurrent decoding of one sequence on the GPU: per layer h [D] and the tape [N, D] in fp32 on
// the device; prefill runs the appended tokens through the layers as one sequence from that state.
class E29aCudaDecoder final : public Decoder {
 public:
  E29aCudaDecoder(const E29aConfig& config, optim::Slab& slab, const core::DeviceContext& context,
                  const DecoderOptions& options);
  ~E29aCudaDecoder() override;

  void reset() override;
  void prefill(std::span<const std::int32_t> tokens, float* all_logits = nullptr) override;
  void step(std::int32_t token, const std::int32_t* device_token = nullptr) override;
  const float* logits() const override;
  std::int64_t position() const override;
  std::int64_t capacity() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace models::e29a
