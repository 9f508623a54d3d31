#include "trainer/model_runner.h"

#include <algorithm>

#include "core/error.h"

namespace trainer {

ModelRunner::ModelRunner(const models::ModelSpec& spec, optim::Slab& slab, const core::DeviceContext& context,
                         std::int64_t max_tokens, const float* full_weights, optim::WeightSource* weight_source)
    : context_(context),
      model_(spec.trainable(slab, context,
                            {.max_tokens = max_tokens, .full_weights = full_weights, .weight_source = weight_source})),
      max_tokens_(max_tokens),
      cuda_(context.is_cuda()) {
  if (!cuda_) return;
  const auto bytes = static_cast<std::size_t>(max_tokens) * 4;
  for (int i = 0; i < kSets; ++i) {
    ids_[i] = core::Buffer(context.device(), bytes);
    targets_[i] = core::Buffer(context.device(), bytes);
    staging_[i] = core::Buffer(core::Device::cpu(), 2 * bytes, /*pinned=*/true);
    CUDA_CHECK(cudaEventCreateWithFlags(&staged_[i], cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(staged_[i], context.stream()));
  }
  losses_ = core::Buffer(core::Device::cpu(), kMaxPending * sizeof(float), /*pinned=*/true);
  if (model_->invalid_id_flag() != nullptr) {
    CUDA_CHECK(cudaMemsetAsync(const_cast<std::int32_t*>(model_->invalid_id_flag()), 0, 4, context.stream()));
  }
}

ModelRunner::~ModelRunner() {
  for (cudaEvent_t e : staged_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
}

int ModelRunner::stage(const std::int32_t* ids, const std::int32_t* targets, std::int64_t n) {
  if (n <= 0 || n > max_tokens_) {
    throw core::Error("ModelRunner: " + std::to_string(n) + " tokens outside (0, " + std::to_string(max_tokens_) + "]");
  }
  const int set = next_set_;
  next_set_ = (next_set_ + 1) % kSets;
  // The copies out of this set, queued kSets micro-batches ago, must be done before it is refilled.
  CUDA_CHECK(cudaEventSynchronize(staged_[set]));
  auto* host = staging_[set].as<std::int32_t>();
  std::copy(ids, ids + n, host);
  std::copy(targets, targets + n, host + n);
  const auto bytes = static_cast<std::size_t>(n) * 4;
  CUDA_CHECK(cudaMemcpyAsync(ids_[set].data(), host, bytes, cudaMemcpyHostToDevice, context_.stream()));
  CUDA_CHECK(cudaMemcpyAsync(targets_[set].data(), host + n, bytes, cudaMemcpyHostToDevice, context_.stream()));
  CUDA_CHECK(cudaEventRecord(staged_[set], context_.stream()));
  return set;
}

void ModelRunner::micro_step(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                             float grad_scale) {
  if (!cuda_) {
    model_->forward_backward(ids, targets, batch, seq, grad_scale);
    host_losses_.push_back(*model_->loss());
    return;
  }
  if (pending_ == kMaxPending) throw core::Error("too many micro-batches between two optimizer steps");
  const int set = stage(ids, targets, batch * seq);
  model_->forward_backward(ids_[set].as<std::int32_t>(), targets_[set].as<std::int32_t>(), batch, seq, grad_scale);
  CUDA_CHECK(
      cudaMemcpyAsync(losses_.as<float>() + pending_, model_->loss(), 4, cudaMemcpyDeviceToHost, context_.stream()));
  ++pending_;
}

std::vector<double> ModelRunner::take_losses() {
  if (!cuda_) return std::exchange(host_losses_, {});
  context_.synchronize();
  model_->check_device_faults();
  std::vector<double> out(losses_.as<float>(), losses_.as<float>() + pending_);
  pending_ = 0;
  return out;
}

double ModelRunner::eval_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                              std::int64_t seq) {
  if (!cuda_) {
    model_->forward_loss(ids, targets, batch, seq);
    return *model_->loss();
  }
  const int set = stage(ids, targets, batch * seq);
  model_->forward_loss(ids_[set].as<std::int32_t>(), targets_[set].as<std::int32_t>(), batch, seq);
  float loss = 0;
  CUDA_CHECK(cudaMemcpyAsync(&loss, model_->loss(), 4, cudaMemcpyDeviceToHost, context_.stream()));
  context_.synchronize();
  model_->check_device_faults();
  return loss;
}

bool ModelRunner::saw_invalid_ids() {
  if (model_->invalid_id_flag() == nullptr) return false;
  std::int32_t flag = 0;
  CUDA_CHECK(cudaMemcpyAsync(&flag, model_->invalid_id_flag(), 4, cudaMemcpyDeviceToHost, context_.stream()));
  context_.synchronize();
  return flag != 0;
}

}  // namespace trainer
