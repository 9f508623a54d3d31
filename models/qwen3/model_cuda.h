// The Qwen3 decoder on one GPU: bf16 activations and matrix operands read from the slab's bf16
// mirror, fp32 statistics and accumulation, weight gradients accumulated in fp32 into the slab
// or handed range by range to a gradient sink (one layer's gradients are one contiguous range). Activation memory is
// allocated once for `max_tokens`; a training micro-batch allocates nothing and never waits for the host (the loss
// stays on the device). Activation recompute: none (keep everything for the backward), mlp
// (recompute the MLP's gate/up and SwiGLU outputs), full (keep only each layer's input).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/buffer.h"
#include "core/device.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/linear.h"
#include "models/model.h"
#include "models/qwen3/config.h"
#include "optim/gradient_sink.h"
#include "optim/slab.h"

namespace models::qwen3 {

enum class Recompute { none, mlp, full };
Recompute recompute_from_string(const std::string& name);  // throws core::InputError

class Qwen3Cuda final : public TrainableModel {
 public:
  // `slab`: laid out from parameter_specs(config), on the context's cuda device, bf16 mirror
  // spanning the whole model, or with ZeRO-3 its shard and a `source` that gathers each range
  // (the embedding, a layer, the tail) before the forward's and the backward's use of it; gradients
  // go to the slab unless a gradient sink is set.
  Qwen3Cuda(const Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context, std::int64_t max_tokens,
            Recompute recompute, optim::WeightSource* source = nullptr);
  ~Qwen3Cuda() override;

  // ids and targets: device int32 [batch * seq] (targets -100 = ignored). Adds the gradient of
  // grad_scale * mean loss to the slab's gradients. The loss is left in loss().
  void forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                        float grad_scale) override;
  // The loss only (evaluation).
  void forward_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                    std::int64_t seq) override;
  // bf16 logits [batch * seq, vocab] into `logits` (device).
  void logits(const std::int32_t* ids, std::int64_t batch, std::int64_t seq, std::uint16_t* logits);

  // Where forward_backward puts the weight gradients (optim/gradient_sink.h); nullptr: the slab's
  // gradient buffer, added to (the default). A sink with a range limit gets every range in turn
  // (the final norm, each layer's MLP and attention, the vocabulary-sized tensors in row windows)
  // as soon as its gradients are final; ZeRO-2 reduces them while the backward goes on. The limit
  // must be at least largest_gradient_range() (core::Error). The sink must outlive its use.
  void set_gradient_sink(optim::GradientSink* sink) override;
  // The most elements one range given to a limited sink spans (the size of its staging).
  std::int64_t largest_gradient_range() const override;
  // Events around each phase of forward_backward, the same names in every layer (embedding, the
  // layers' norms, products, attention, SwiGLU and residual adds, recompute, the fused head and
  // loss), ".fwd" or ".bwd" after each; nullptr (the default) records nothing.
  void set_phase_timer(core::PhaseTimer* timer) override;

  const float* loss() const override;          // device fp32: mean loss of the last call
  const float* token_losses() const override;  // device fp32, of the last forward_loss
  // Device flag set when an input id was outside the vocabulary (checked lazily by callers).
  const std::int32_t* invalid_id_flag() const override;
  std::size_t activation_bytes() const override { return activation_bytes_; }
  // What activation_bytes() will be for these arguments, computed without a GPU (memory plans).
  static std::size_t planned_activation_bytes(const Qwen3Config& config, std::int64_t max_tokens, Recompute recompute);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::size_t activation_bytes_ = 0;
};

}  // namespace models::qwen3
