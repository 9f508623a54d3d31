// One E29a layer on the GPU, the hybrid path: the input projection W_xz over all steps is one
// cuBLASLt product; per step, W_h h_{t-1} and W_write h_t are cuBLASLt products over the batch and
// the attention / state update / tape update / gate phases are kernels (layer_kernels.h); the
// backward walks the steps in reverse with the same structure and is exact (layer.h has the
// equations). It is the correctness baseline and fallback of faster kernels.
//
// Precision: weights are the slab's bf16 mirror, the input u and output y bf16 (the model's
// activations). Everything the recurrence carries is fp32: x/z (fp32 output of the projection),
// h, r, w, the tape, all gradients through time; the per-step products run on fp32 copies of W_h
// and W_write with true fp32 compute. The products over all B*T rows (W_xz forward, du, and the
// weight gradients of W_xz, W_h, W_write) take bf16 operands with fp32 accumulation, like every
// linear layer of the project; weight gradients are added (+=) in fp32 to the caller's buffers.
//
// Each direction's recurrence runs either as the hybrid path's launches per step or as one
// persistent kernel for all steps (layer_persistent.h), which the default takes where the device
// and shape allow; both forwards save the same tensors and both backwards give the same operands,
// so any forward pairs with any backward.
//
// Memory: the forward saves x/z, h (fp32 and bf16), r, w and both attentions for every step,
// but the tape only every `checkpoint_interval` steps; the backward replays each segment's tapes
// from its checkpoint and the saved w and write attention with the forward's arithmetic (bit-
// identical), so a tape of [B, N, D] per step is never stored for all T.
//
// Determinism: no atomics; reductions over features are fixed shuffle trees, over the batch and
// time fixed-order loops or cuBLASLt products with deterministic reduction schemes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "core/buffer.h"
#include "core/device.h"
#include "models/e29a/layer.h"

namespace models::e29a {

// Device pointers of one layer's weights (bf16 mirror).
struct LayerWeightsCuda {
  const __nv_bfloat16* w_xz = nullptr;     // [2D, D]
  const __nv_bfloat16* w_h = nullptr;      // [D, D]
  const __nv_bfloat16* b_h = nullptr;      // [D]
  const __nv_bfloat16* w_write = nullptr;  // [D, D]
  const __nv_bfloat16* tape0 = nullptr;    // [N, D]
};

// Device pointers of one layer's fp32 gradients, accumulated (+=).
struct LayerGradientsCuda {
  float* w_xz = nullptr;
  float* w_h = nullptr;
  float* b_h = nullptr;
  float* w_write = nullptr;
  float* tape0 = nullptr;
};

// A recurrent state on the device, fp32: h [batch, D], tape [batch, N, D].
struct LayerStateCuda {
  float* h = nullptr;
  float* tape = nullptr;
};

// Score gradients (dL/d logits of the read and write attentions), fp32 [steps, batch, N] each.
struct ScoreGradientsCuda {
  float* read = nullptr;
  float* write = nullptr;
};

class LayerCuda;

// What one layer's forward keeps for its backward (device memory sized at creation).
class LayerActivationsCuda {
 public:
  LayerActivationsCuda() = default;
  std::int64_t batch() const { return batch_; }
  std::int64_t steps() const { return steps_; }
  std::size_t bytes() const { return buffer_.bytes(); }
  // Views of the last forward, time-major: [steps, batch, N] attentions, [steps + 1, batch, D] h.
  const float* read_attn() const { return read_attn_; }
  const float* write_attn() const { return write_attn_; }
  const float* h() const { return h_; }

 private:
  friend class LayerCuda;
  core::Buffer buffer_;
  std::int64_t batch_ = 0, steps_ = 0;
  float* xz_ = nullptr;  // [batch, steps, 2D]
  float* h_ = nullptr;   // [steps + 1, batch, D]
  __nv_bfloat16* h_bf16_ = nullptr;
  float* read_ = nullptr;         // [steps, batch, D]
  float* write_ = nullptr;        // [steps, batch, D]
  float* read_attn_ = nullptr;    // [steps, batch, N]
  float* write_attn_ = nullptr;   // [steps, batch, N]
  float* checkpoints_ = nullptr;  // [ceil(steps / K), batch, N, D]
};

class LayerCuda {
 public:
  // Sized for up to max_batch sequences of max_steps; checkpoint_interval 0 picks about
  // sqrt(max_steps). slots in [1, 64] (kernels are built for 8, 16, 32, 64). `options`: the
  // backward's treatment of the paths through time (layer.h; default exact).
  LayerCuda(const core::DeviceContext& context, std::int64_t dim, std::int64_t slots, std::int64_t max_batch,
            std::int64_t max_steps, std::int64_t checkpoint_interval = 0, const LayerBackwardOptions& options = {});
  ~LayerCuda();
  LayerCuda(LayerCuda&&) noexcept;
  LayerCuda& operator=(LayerCuda&&) = delete;
  LayerCuda(const LayerCuda&) = delete;
  LayerCuda& operator=(const LayerCuda&) = delete;

  std::int64_t dim() const { return dim_; }
  std::int64_t slots() const { return slots_; }
  std::int64_t checkpoint_interval() const { return interval_; }
  // Choosing `persistent` where the persistent kernel cannot take the layer throws, naming why.
  void set_forward_kernel(RecurrenceKernel kernel);
  void set_backward_kernel(RecurrenceKernel kernel);
  // Why the persistent forward cannot run this layer on this device ("" when it can).
  const std::string& persistent_refusal() const { return persistent_refusal_; }
  // Why the persistent backward cannot ("" when it can): its own shared memory, or a carried
  // gradient clip (which needs the whole carried norm before the step).
  const std::string& persistent_backward_refusal() const { return backward_refusal_; }
  // What the last forward and backward ran (hybrid or persistent).
  RecurrenceKernel last_forward_kernel() const { return last_forward_; }
  RecurrenceKernel last_backward_kernel() const { return last_backward_; }
  // Waits for the last persistent launches and throws core::Error if a barrier passed its deadline
  // (each launch also checks, without waiting, the one before it); a record is reported once.
  // Tests set the deadline and stall a block on purpose.
  void check();
  void set_persistent_timeout(double seconds) { timeout_seconds_ = seconds; }
  void stall_block_for_tests(int block) { stall_block_ = block; }
  // Blocks a sequence spreads over in the persistent kernels (1, 2 or 4; 0, the default: chosen at
  // each launch). Tests and benchmarks; the refusals above then say whether it can be.
  void set_persistent_cluster(int blocks);
  // Blocks a row block's rows phase spreads its batch over (1 or 2; 0, the default: chosen).
  void set_persistent_batch_parts(int parts);
  // Benchmarks: device arrays of 11 (forward) and 12 (backward) uint64 that receive ns per phase
  // kind (layer_persistent.h).
  void set_persistent_profile(std::uint64_t* device_ns) { profile_ = device_ns; }
  void set_persistent_backward_profile(std::uint64_t* device_ns) { backward_profile_ = device_ns; }
  // Benchmarks: events recorded on the layer's stream before and after each direction's
  // recurrence (the persistent launch or the hybrid steps), so it is timed apart from the layer's
  // products over all tokens. Null events are not recorded.
  struct RecurrenceEvents {
    cudaEvent_t forward_start = nullptr, forward_end = nullptr, backward_start = nullptr, backward_end = nullptr;
  };
  void set_recurrence_events(const RecurrenceEvents& events) { events_ = events; }
  // Device bytes of one LayerActivationsCuda, and of this object's own scratch.
  std::size_t activation_bytes() const;
  std::size_t scratch_bytes() const { return scratch_.bytes() + workspace_.bytes(); }
  LayerActivationsCuda make_activations() const;

  // y = E29a(u), u and y bf16 [batch, steps, D] (device). `start` (optional) replaces h_0 = 0 and
  // the tape H_0 of every sequence; `end` (optional) receives the state after the last step.
  void forward(const LayerWeightsCuda& weights, const __nv_bfloat16* u, std::int64_t batch, std::int64_t steps,
               __nv_bfloat16* y, LayerActivationsCuda& saved, const LayerStateCuda* start = nullptr,
               const LayerStateCuda* end = nullptr);

  // du (bf16, written) and the weight gradients (added) from dy and the last forward of `saved`
  // on the same u. The start tape's gradient summed over the batch goes to grads.tape0.
  void backward(const LayerWeightsCuda& weights, const __nv_bfloat16* u, const __nv_bfloat16* dy, __nv_bfloat16* du,
                const LayerGradientsCuda& grads, const LayerActivationsCuda& saved,
                const ScoreGradientsCuda* scores = nullptr);

 private:
  struct Plan;
  // The fields both persistent launches take from the layer, its weights and the saved activations.
  template <typename Args>
  void fill_persistent_args(Args& a, const LayerWeightsCuda& weights, const LayerActivationsCuda& saved) const;
  // The backward's recurrence as launches per step (writes the same operands as the persistent one).
  void update_refusals();
  void hybrid_backward(const LayerWeightsCuda& weights, const __nv_bfloat16* dy, const LayerActivationsCuda& saved,
                       const ScoreGradientsCuda* scores);
  const core::DeviceContext* context_;
  std::int64_t dim_, slots_, max_batch_, max_steps_, interval_;
  LayerBackwardOptions options_;
  RecurrenceKernel forward_kernel_ = RecurrenceKernel::automatic;
  RecurrenceKernel backward_kernel_ = RecurrenceKernel::automatic;
  RecurrenceKernel last_forward_ = RecurrenceKernel::hybrid;
  RecurrenceKernel last_backward_ = RecurrenceKernel::hybrid;
  std::string persistent_refusal_, backward_refusal_;
  double timeout_seconds_ = 5.0;
  int stall_block_ = -1;
  int cluster_ = 0, batch_parts_ = 0;
  std::uint64_t* profile_ = nullptr;
  std::uint64_t* backward_profile_ = nullptr;
  RecurrenceEvents events_;
  core::Buffer scratch_;
  core::Buffer workspace_;
  std::unique_ptr<Plan> plan_;
};

}  // namespace models::e29a
