// The model as the training loop sees it, on either backend, over the model interface
// (models/model.h): run a micro-batch forward and backward (gradients into the slab or the
// gradient sink), evaluate a loss. Inputs come from the host; on cuda they are staged through
// pinned buffers (two sets, alternating, so staging the next micro-batch never waits for the
// device) and losses are fetched lazily: the loop synchronises once per optimizer step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"
#include "models/model.h"
#include "optim/gradient_sink.h"
#include "optim/slab.h"

namespace trainer {

class ModelRunner {
 public:
  // `full_weights`: cpu with a sharded master, the whole-model fp32 weights the model reads;
  // `weight_source`: ZeRO-3's gather or ZeRO-1/2's chunked mirror gather (models::TrainableOptions).
  ModelRunner(const models::ModelSpec& spec, optim::Slab& slab, const core::DeviceContext& context,
              std::int64_t max_tokens, const float* full_weights = nullptr,
              optim::WeightSource* weight_source = nullptr);
  ~ModelRunner();

  // Adds the gradient of grad_scale * mean loss of the micro-batch [batch, seq] to the gradients.
  void micro_step(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                  float grad_scale);
  // Mean loss of each micro_step since the last call, in order (waits for the device; a fault the
  // device recorded meanwhile throws: TrainableModel::check_device_faults).
  std::vector<double> take_losses();
  // Mean loss of a batch without gradients (waits for the device, then checks for faults as above).
  double eval_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq);
  // Ids outside the vocabulary reached the model (cuda checks its device flag; cpu throws at once).
  bool saw_invalid_ids();
  void set_gradient_sink(optim::GradientSink* sink) { model_->set_gradient_sink(sink); }
  std::int64_t largest_gradient_range() const { return model_->largest_gradient_range(); }
  // The model itself (downstream evaluation scores with its forward_loss and token_losses).
  models::TrainableModel& model() { return *model_; }
  std::int64_t max_tokens() const { return max_tokens_; }

 private:
  // Copies host ids/targets into the next device staging set; returns its index.
  int stage(const std::int32_t* ids, const std::int32_t* targets, std::int64_t n);

  static constexpr std::size_t kMaxPending = 4096;
  static constexpr int kSets = 2;
  const core::DeviceContext& context_;
  std::unique_ptr<models::TrainableModel> model_;
  std::int64_t max_tokens_;
  bool cuda_;
  core::Buffer ids_[kSets], targets_[kSets], staging_[kSets];  // cuda only
  cudaEvent_t staged_[kSets] = {};                             // the device has read staging set i
  int next_set_ = 0;
  core::Buffer losses_;              // pinned host (cuda)
  std::vector<double> host_losses_;  // cpu
  std::size_t pending_ = 0;
};

}  // namespace trainer
