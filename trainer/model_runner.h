// The model as the training loop sees it, on either backend: run a micro-batch forward and
// backward (gradients added to the slab), evaluate a loss, and give next-token logits for
// sampling. Inputs come from the host; the cuda runner stages them into device buffers and
// fetches losses lazily, so the loop synchronises once per optimizer step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/device.h"
#include "models/qwen3/config.h"
#include "models/qwen3/model_cuda.h"
#include "optim/slab.h"
#include "optim/gradient_sink.h"

namespace trainer {

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  // Adds the gradient of grad_scale * mean loss of the micro-batch [batch, seq] to the slab.
  virtual void micro_step(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                          float grad_scale) = 0;
  // Mean loss of each micro_step since the last call, in order (waits for the device).
  virtual std::vector<double> take_losses() = 0;
  // Mean loss of a batch without gradients.
  virtual double eval_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                           std::int64_t seq) = 0;
  // Logits of the last position of `ids` [1, seq].
  virtual std::vector<float> next_logits(const std::int32_t* ids, std::int64_t seq) = 0;
  // Ids outside the vocabulary were seen (cuda checks its device flag; cpu throws at once).
  virtual bool saw_invalid_ids() { return false; }
  // Brings the weights the model reads up to date after an optimizer step or a load: with ZeRO
  // >= 1 and several ranks each rank has updated only its shard (cuda: the mirror shards are
  // all-gathered in place; cpu: the fp32 master shards into the model's whole-model copy).
  virtual void gather_weights(comm::Communicator& comm) = 0;
  // Where the next micro-batches put their gradients (optim/gradient_sink.h; nullptr: the slab).
  // The cpu model always adds into the slab's whole gradient buffer and ignores it.
  virtual void set_gradient_sink(optim::GradientSink* sink) { (void)sink; }
  // The staging a limited sink needs for this model (0: the backend takes no sink).
  virtual std::int64_t largest_gradient_range() const { return 0; }
};

// The runner for the slab's device: the fp32 cpu model or the bf16 cuda model.
// `gathered`: the slab's master covers only this rank's shard and other ranks hold the rest (the
// cpu runner then keeps a whole-model copy of the weights).
std::unique_ptr<ModelRunner> make_model_runner(const models::qwen3::Qwen3Config& config, optim::Slab& slab,
                                               const core::DeviceContext& context, std::int64_t max_tokens,
                                               std::int64_t max_seq, models::qwen3::Recompute recompute,
                                               bool gathered = false);

}  // namespace trainer
