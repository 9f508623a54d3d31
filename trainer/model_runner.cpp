#include "trainer/model_runner.h"

#include <span>

#include "core/error.h"
#include "core/half.h"
#include "models/qwen3/model.h"

namespace trainer {

namespace q3 = models::qwen3;

namespace {

class CpuRunner final : public ModelRunner {
 public:
  CpuRunner(const q3::Qwen3Config& config, optim::Slab& slab, bool gathered)
      : slab_(slab),
        full_weights_(core::Device::cpu(), gathered ? static_cast<std::size_t>(slab.layout().total_elements()) * 4 : 0),
        model_(config, slab, gathered ? full_weights_.as<float>() : nullptr) {}

  void gather_weights(comm::Communicator& comm) override {
    if (full_weights_.bytes() == 0) return;
    const optim::Range owned = slab_.owned();
    std::copy(slab_.master().as<float>(), slab_.master().as<float>() + owned.size(), full_weights_.as<float>() + owned.begin);
    comm.all_gather(full_weights_.data(), core::DType::f32, static_cast<std::size_t>(owned.size()), "weight all-gather");
  }

  void micro_step(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                  float grad_scale) override {
    const auto n = static_cast<std::size_t>(batch * seq);
    losses_.push_back(model_.step({ids, n}, {targets, n}, batch, seq, true, grad_scale).loss);
  }
  std::vector<double> take_losses() override { return std::exchange(losses_, {}); }
  double eval_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq) override {
    const auto n = static_cast<std::size_t>(batch * seq);
    return model_.step({ids, n}, {targets, n}, batch, seq, false).loss;
  }
  std::vector<float> next_logits(const std::int32_t* ids, std::int64_t seq) override {
    const std::int64_t vocab = model_.config().vocab_size;
    std::vector<float> all(static_cast<std::size_t>(seq * vocab));
    model_.logits({ids, static_cast<std::size_t>(seq)}, 1, seq, all);
    return {all.end() - vocab, all.end()};
  }

 private:
  optim::Slab& slab_;
  core::Buffer full_weights_;  // whole-model fp32 weights when the master is sharded
  q3::Qwen3Model model_;
  std::vector<double> losses_;
};

class CudaRunner final : public ModelRunner {
 public:
  CudaRunner(const q3::Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context,
             std::int64_t max_tokens, std::int64_t max_seq, q3::Recompute recompute, bool gathered)
      : config_(config), context_(context), slab_(slab), gathered_(gathered),
        model_(config, slab, context, max_tokens, recompute),
        ids_(context.device(), static_cast<std::size_t>(max_tokens) * 4),
        targets_(context.device(), static_cast<std::size_t>(max_tokens) * 4),
        staging_(core::Device::cpu(), static_cast<std::size_t>(max_tokens) * 8, /*pinned=*/true),
        losses_(core::Device::cpu(), kMaxPending * sizeof(float), /*pinned=*/true),
        logits_(context.device(), static_cast<std::size_t>(config.vocab_size) * static_cast<std::size_t>(max_seq) * 2) {
    CUDA_CHECK(cudaMemsetAsync(const_cast<std::int32_t*>(model_.invalid_id_flag()), 0, 4, context.stream()));
  }

  void micro_step(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                  float grad_scale) override {
    if (pending_ == kMaxPending) throw core::Error("too many micro-batches between two optimizer steps");
    stage(ids, targets, batch * seq);
    model_.forward_backward(ids_.as<std::int32_t>(), targets_.as<std::int32_t>(), batch, seq, grad_scale);
    copy_loss();
  }
  std::vector<double> take_losses() override {
    context_.synchronize();
    std::vector<double> out(losses_.as<float>(), losses_.as<float>() + pending_);
    pending_ = 0;
    return out;
  }
  double eval_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq) override {
    stage(ids, targets, batch * seq);
    model_.forward_loss(ids_.as<std::int32_t>(), targets_.as<std::int32_t>(), batch, seq);
    float loss = 0;
    CUDA_CHECK(cudaMemcpyAsync(&loss, model_.loss(), 4, cudaMemcpyDeviceToHost, context_.stream()));
    context_.synchronize();
    return loss;
  }
  std::vector<float> next_logits(const std::int32_t* ids, std::int64_t seq) override {
    stage(ids, ids, seq);
    model_.logits(ids_.as<std::int32_t>(), 1, seq, logits_.as<std::uint16_t>());
    std::vector<std::uint16_t> last(static_cast<std::size_t>(config_.vocab_size));
    CUDA_CHECK(cudaMemcpyAsync(last.data(), logits_.as<std::uint16_t>() + (seq - 1) * config_.vocab_size,
                               last.size() * 2, cudaMemcpyDeviceToHost, context_.stream()));
    context_.synchronize();
    std::vector<float> out(last.size());
    for (std::size_t i = 0; i < last.size(); ++i) out[i] = core::bf16_to_float(last[i]);
    return out;
  }
  void gather_weights(comm::Communicator& comm) override {
    if (!gathered_) return;
    const optim::Range owned = slab_.owned();
    comm.all_gather(slab_.mirror().data(), slab_.mirror_dtype(), static_cast<std::size_t>(owned.size()),
                    "mirror all-gather");
  }
  void set_gradient_sink(optim::GradientSink* sink) override { model_.set_gradient_sink(sink); }
  std::int64_t largest_gradient_range() const override { return model_.largest_gradient_range(); }
  bool saw_invalid_ids() override {
    std::int32_t flag = 0;
    CUDA_CHECK(cudaMemcpyAsync(&flag, model_.invalid_id_flag(), 4, cudaMemcpyDeviceToHost, context_.stream()));
    context_.synchronize();
    return flag != 0;
  }

 private:
  static constexpr std::size_t kMaxPending = 4096;

  // Pinned staging so the copies are asynchronous; the previous copy has finished when the
  // stream reaches this point only if we wait for it, so wait on the staging reuse.
  void stage(const std::int32_t* ids, const std::int32_t* targets, std::int64_t n) {
    CUDA_CHECK(cudaStreamSynchronize(context_.stream()));  // the staging buffer is free again
    auto* host = staging_.as<std::int32_t>();
    std::copy(ids, ids + n, host);
    std::copy(targets, targets + n, host + n);
    CUDA_CHECK(cudaMemcpyAsync(ids_.data(), host, static_cast<std::size_t>(n) * 4, cudaMemcpyHostToDevice, context_.stream()));
    CUDA_CHECK(cudaMemcpyAsync(targets_.data(), host + n, static_cast<std::size_t>(n) * 4, cudaMemcpyHostToDevice,
                               context_.stream()));
  }
  void copy_loss() {
    CUDA_CHECK(cudaMemcpyAsync(losses_.as<float>() + pending_, model_.loss(), 4, cudaMemcpyDeviceToHost, context_.stream()));
    ++pending_;
  }

  q3::Qwen3Config config_;
  const core::DeviceContext& context_;
  optim::Slab& slab_;
  bool gathered_;
  q3::Qwen3Cuda model_;
  core::Buffer ids_, targets_, staging_, losses_, logits_;
  std::size_t pending_ = 0;
};

}  // namespace

std::unique_ptr<ModelRunner> make_model_runner(const q3::Qwen3Config& config, optim::Slab& slab,
                                               const core::DeviceContext& context, std::int64_t max_tokens,
                                               std::int64_t max_seq, q3::Recompute recompute, bool gathered) {
  if (context.is_cuda()) {
    return std::make_unique<CudaRunner>(config, slab, context, max_tokens, max_seq, recompute, gathered);
  }
  return std::make_unique<CpuRunner>(config, slab, gathered);
}

}  // namespace trainer
