// What every decoder-only language model on one GPU shares around its stack of layers (Qwen3,
// E29a): the token embedding in; the final RMSNorm and the head through the fused chunked
// cross-entropy out; and their backward into any gradient sink. With the slab as the sink
// (unlimited ranges), or staging that offers a held range of the head's size, the head's gradient
// comes from the fused backward (token chunks, dW accumulated over them). With staging alone
// (ZeRO-2 with sharded gradients: ranges of at most max_range_elements()) no whole [vocab, dim]
// gradient may exist: the cross-entropy backward first gives the hidden gradient and each token's
// logsumexp, and after the layers the head (and embedding) gradient is produced in row windows,
// each final before the next (the logits are computed a second time for that). Also the pieces every such model's
// memory plan uses: an arena of 256-byte aligned offsets and the slab's gradient buffer as a sink.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>

#include "core/buffer.h"
#include "core/device.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/linear.h"
#include "models/weight_holds.h"
#include "optim/gradient_sink.h"
#include "optim/slab.h"

namespace models {

// Carves arrays out of one device allocation: reserve() hands out offsets (each 256-byte aligned),
// then the caller allocates size() bytes.
class DeviceArena {
 public:
  std::size_t reserve(std::size_t bytes) {
    const std::size_t at = size_;
    size_ = (size_ + bytes + 255) / 256 * 256;
    return at;
  }
  std::size_t size() const { return size_; }

 private:
  std::size_t size_ = 0;
};

// The slab's own gradient buffer as a sink: any range, gradients accumulate across micro-batches.
class SlabGradientSink final : public optim::GradientSink {
 public:
  explicit SlabGradientSink(optim::Slab& slab) : slab_(slab) {}
  std::int64_t max_range_elements() const override { return 0; }
  float* acquire(optim::Range range) override { return slab_.grad_origin() + range.begin; }
  void release(optim::Range) override {}

 private:
  optim::Slab& slab_;
};

// `sink` for a backward whose largest acquired range is `largest` elements (`what` names the model
// in the error when the sink's ranges are smaller); null gives `fallback`.
optim::GradientSink* checked_sink(optim::GradientSink* sink, optim::GradientSink* fallback, std::int64_t largest,
                                  const char* what);

// Slab tensors and sizes of the two ends (head == embed for a tied head).
struct LmEndsSpec {
  int embed = 0;
  int final_norm = 0;
  int head = 0;
  std::int64_t vocab = 0;
  std::int64_t dim = 0;
  double eps = 0.0;
};

// Where LmEndsCuda's arrays live: offsets into one allocation of `total_` bytes, computed
// without allocating so memory plans size it from the same arithmetic.
struct LmEndsLayout {
  LmEndsLayout(std::int64_t max_tokens, std::int64_t vocab, std::int64_t dim);
  std::size_t x_final_ = 0, x_norm_ = 0, rstd_ = 0, dx_ = 0, token_losses_ = 0, token_lse_ = 0, mean_loss_ = 0;
  std::size_t count_ = 0, invalid_ = 0, embed_workspace_ = 0, embed_workspace_bytes_ = 0;
  std::size_t total_ = 0;
};

class LmEndsCuda : private LmEndsLayout {
 public:
  using bf16 = __nv_bfloat16;

  // Memory for up to `max_tokens` tokens per call. The slab's mirror holds bf16 weights.
  LmEndsCuda(const core::DeviceContext& context, optim::Slab& slab, const LmEndsSpec& spec, std::int64_t max_tokens);

  // Workspace bytes the calls below need (the caller's workspace may serve its own ops too).
  static std::size_t workspace_bytes(std::int64_t max_tokens, std::int64_t vocab, std::int64_t dim);
  // ZeRO-3: the weights are read from the ranges the model holds (it holds the embedding, the
  // tail and the head's range around the calls below) instead of the slab's mirror.
  void set_weight_holds(const WeightHolds* holds) { holds_ = holds; }
  // bytes() of an instance for these arguments.
  static std::size_t memory_bytes(std::int64_t max_tokens, std::int64_t vocab, std::int64_t dim) {
    return LmEndsLayout(max_tokens, vocab, dim).total_;
  }

  // x0 [n, dim] = embedding rows of ids (out-of-range ids clamp and raise invalid_id_flag()).
  void embed(const std::int32_t* ids, std::int64_t n, bf16* x0);
  // x_norm() = RMSNorm(x_final()), where the stack left its output.
  void final_norm(std::int64_t n);
  // The mean loss of the targets into loss().
  void loss(const std::int32_t* targets, std::int64_t n, ops::DeviceWorkspace workspace);
  // The head's and the final norm's backward: leaves dL/dx_final in dx() (`scratch`: [n, dim]
  // bf16 the call may overwrite).
  void backward_head(optim::GradientSink& sink, const std::int32_t* targets, std::int64_t n, float grad_scale,
                     bf16* scratch, ops::DeviceWorkspace workspace);
  // After the layers left dL/dx0 in dx(): the embedding's gradient (and, with row windows, the
  // head's), to the sink.
  void backward_embedding(optim::GradientSink& sink, const std::int32_t* ids, const std::int32_t* targets,
                          std::int64_t n, float grad_scale, ops::DeviceWorkspace workspace);

  // The largest range the two backward calls acquire from a limited sink.
  std::int64_t largest_range() const;

  bf16* x_final();
  const bf16* x_norm();
  bf16* dx();
  const float* loss_value() const;
  const float* token_losses() const;  // [n] of the last loss() (0 for ignored targets)
  const std::int32_t* invalid_id_flag() const;
  std::size_t bytes() const { return memory_.bytes(); }

 private:
  template <typename T>
  T* at(std::size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(const_cast<void*>(memory_.data())) + offset);
  }
  const bf16* weight(int tensor) const;
  optim::Range range_of(int tensor) const;
  ops::CrossEntropyDeviceOutputs loss_outputs() const;
  // Whether `sink` keeps the whole head gradient (and a separate embedding's) open: the fused
  // one-pass backward; else the row windows after the layers, which compute the logits again.
  bool one_pass(const optim::GradientSink& sink) const;

  cudaStream_t stream_;
  optim::Slab& slab_;
  LmEndsSpec spec_;
  ops::CrossEntropyPlan cross_entropy_;
  core::Buffer memory_;
  float* head_grad_ = nullptr;  // the tied head's gradient, acquired by backward_head (one pass)
  const WeightHolds* holds_ = nullptr;
};

}  // namespace models
