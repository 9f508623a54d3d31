// The model as the training loop sees it, on either backend: run a micro-batch forward and
// backward (gradients added to the slab), evaluate a loss, and give next-token logits for
// sampling. Inputs come from the host; the cuda runner stages them into device buffers and
// fetches losses lazily, so the loop synchronises once per optimizer step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"
#include "models/qwen3/config.h"
#include "models/qwen3/model_cuda.h"
#include "optim/slab.h"

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
};

// The runner for the slab's device: the fp32 cpu model or the bf16 cuda model.
std::unique_ptr<ModelRunner> make_model_runner(const models::qwen3::Qwen3Config& config, optim::Slab& slab,
                                               const core::DeviceContext& context, std::int64_t max_tokens,
                                               std::int64_t max_seq, models::qwen3::Recompute recompute);

}  // namespace trainer
