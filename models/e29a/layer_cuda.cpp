// The hybrid CUDA path of one E29a layer (layer_cuda.h): cuBLASLt products (gemm_cuda.h) for the
// input projection, the per-step recurrent products and the weight gradients; the phase kernels
// of layer_kernels.h in between. Buffers are carved from one allocation each (activations,
// scratch) at 256-byte aligned offsets.
#include "models/e29a/layer_cuda.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "models/e29a/gemm_cuda.h"
#include "models/e29a/layer_kernels.h"
#include "models/e29a/layer_persistent.h"

namespace models::e29a {
namespace {

using bf16 = __nv_bfloat16;

std::size_t align_up(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

void record(cudaEvent_t event, cudaStream_t stream) {
  if (event) CUDA_CHECK(cudaEventRecord(event, stream));
}

// Offsets of named regions inside one allocation.
class Carver {
 public:
  std::size_t take(std::size_t bytes) {
    const std::size_t at = size_;
    size_ = align_up(size_ + bytes);
    return at;
  }
  std::size_t size() const { return size_; }

 private:
  std::size_t size_ = 0;
};

struct ActivationOffsets {
  std::size_t xz, h, h_bf16, read, write, read_attn, write_attn, checkpoints, total;
};

ActivationOffsets activation_offsets(std::int64_t batch, std::int64_t steps, std::int64_t dim, std::int64_t slots,
                                     std::int64_t interval) {
  const auto b = static_cast<std::size_t>(batch), t = static_cast<std::size_t>(steps);
  const auto d = static_cast<std::size_t>(dim), n = static_cast<std::size_t>(slots);
  const std::size_t segments = (t + static_cast<std::size_t>(interval) - 1) / static_cast<std::size_t>(interval);
  Carver c;
  ActivationOffsets o{};
  o.xz = c.take(b * t * 2 * d * sizeof(float));
  o.h = c.take((t + 1) * b * d * sizeof(float));
  o.h_bf16 = c.take((t + 1) * b * d * sizeof(bf16));
  o.read = c.take(t * b * d * sizeof(float));
  o.write = c.take(t * b * d * sizeof(float));
  o.read_attn = c.take(t * b * n * sizeof(float));
  o.write_attn = c.take(t * b * n * sizeof(float));
  o.checkpoints = c.take(segments * b * n * d * sizeof(float));
  o.total = c.size();
  return o;
}

// The attention scores' scale, 1 / sqrt(D).
float score_scale(std::int64_t dim) { return static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim))); }

}  // namespace

// Scratch of the forward and backward, sized for max_batch x max_steps, and the product plan.
// A persistent launch's barrier words (device), their copy after the launch (pinned) and the event
// that says the copy landed. The abort record in the words is sticky: a launch resets only the
// barrier counter, so an abort stays recorded through later launches until the host has read and
// reported it (then the words are cleared), even when a later launch's copy overwrote the pinned
// record before the host looked at it.
struct PersistentLaunch {
  PersistentLaunch(const core::DeviceContext& context, bool backward)
      : sync(context.device(), sizeof(kernels::PersistentSync)),
        record(core::Device::cpu(), sizeof(kernels::PersistentSync), true),
        stream(context.stream()),
        backward(backward) {
    CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    clear();
  }
  ~PersistentLaunch() { cudaEventDestroy(done); }
  PersistentLaunch(const PersistentLaunch&) = delete;
  PersistentLaunch& operator=(const PersistentLaunch&) = delete;

  kernels::PersistentSync* words() { return sync.as<kernels::PersistentSync>(); }
  // After the launch (on the layer's stream): copy the words back and mark it.
  void after() {
    CUDA_CHECK(
        cudaMemcpyAsync(record.data(), sync.data(), sizeof(kernels::PersistentSync), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaEventRecord(done, stream));
    launched = true;
  }
  // Waits for the last launch's record; throws if it, or an earlier launch not yet reported, aborted.
  void check(double timeout_seconds) {
    if (!launched) return;
    CUDA_CHECK(cudaEventSynchronize(done));
    launched = false;
    const kernels::PersistentSync words = *record.as<kernels::PersistentSync>();
    if (words.aborted != 0) {
      clear();
      throw core::Error(kernels::persistent_abort_message(words, timeout_seconds, backward));
    }
  }
  // Before a new launch: the previous one's record if it has landed (no wait: check() waits).
  void check_if_landed(double timeout_seconds) {
    if (!launched) return;
    const cudaError_t landed = cudaEventQuery(done);
    if (landed == cudaSuccess) {
      check(timeout_seconds);
    } else if (landed == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: the launch is still running
    } else {
      CUDA_CHECK(landed);
    }
  }

  // Zero words: no abort recorded (queued on the layer's stream, before any later launch).
  void clear() { CUDA_CHECK(cudaMemsetAsync(sync.data(), 0, sizeof(kernels::PersistentSync), stream)); }

  core::Buffer sync, record;
  cudaStream_t stream;
  cudaEvent_t done = nullptr;
  bool launched = false;
  bool backward;
};

// The backward's scratch (Plan offsets) as pointers.
struct BackwardScratch {
  float *w_h, *w_write, *d_tape, *dh_next, *dh_local, *d_gate, *d_write, *dh_write, *d_pre, *d_bias, *segment;
  bf16 *d_pre_all, *d_write_all, *dxz;
};

struct LayerCuda::Plan {
  explicit Plan(const core::DeviceContext& context)
      : gemm(context), forward_launch(context, false), backward_launch(context, true) {}
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  GemmPlan gemm;
  PersistentLaunch forward_launch, backward_launch;
  // fp32 copies of the recurrent weights (the per-step products run in fp32).
  std::size_t w_h = 0, w_write = 0;
  // Forward: the running tape [B, N, D], W_h h_{t-1} and w_t staging [B, D], h_t for the rows phase.
  std::size_t tape = 0, recurrent = 0, h_frag = 0;
  // Backward: carried dL/dH and dL/dh, per-step vectors, replayed tapes of two segments,
  // the bf16 operands of the weight-gradient products over all rows.
  std::size_t d_tape = 0, dh_next = 0, dh_local = 0, d_gate = 0, d_write = 0, dh_write = 0, d_pre = 0, d_bias = 0;
  std::size_t segment = 0, d_pre_all = 0, d_write_all = 0, dxz = 0;

  BackwardScratch backward_scratch(void* scratch) const {
    char* base = static_cast<char*>(scratch);
    auto f = [&](std::size_t offset) { return reinterpret_cast<float*>(base + offset); };
    auto h = [&](std::size_t offset) { return reinterpret_cast<bf16*>(base + offset); };
    return {f(w_h),      f(w_write), f(d_tape), f(dh_next), f(dh_local),  f(d_gate),      f(d_write),
            f(dh_write), f(d_pre),   f(d_bias), f(segment), h(d_pre_all), h(d_write_all), h(dxz)};
  }
};

LayerCuda::LayerCuda(const core::DeviceContext& context, std::int64_t dim, std::int64_t slots, std::int64_t max_batch,
                     std::int64_t max_steps, std::int64_t checkpoint_interval, const LayerBackwardOptions& options)
    : context_(&context),
      dim_(dim),
      slots_(slots),
      max_batch_(max_batch),
      max_steps_(max_steps),
      interval_(checkpoint_interval),
      options_(options) {
  if (!context.is_cuda())
    throw core::Error("e29a LayerCuda needs a CUDA device context, got " + context.device().str());
  if (dim < 1 || max_batch < 1 || max_steps < 1 || checkpoint_interval < 0) {
    throw core::Error("e29a LayerCuda: dim, max_batch, max_steps must be positive and checkpoint_interval >= 0, got " +
                      std::to_string(dim) + ", " + std::to_string(max_batch) + ", " + std::to_string(max_steps) + ", " +
                      std::to_string(checkpoint_interval));
  }
  if (slots < 1 || slots > kernels::kMaxSlots) {
    throw core::Error("e29a LayerCuda: slots must be in [1, " + std::to_string(kernels::kMaxSlots) + "], got " +
                      std::to_string(slots));
  }
  if (dim > (1 << 20)) throw core::Error("e29a LayerCuda: dim " + std::to_string(dim) + " is too large");
  if (interval_ == 0) {
    interval_ = std::max<std::int64_t>(1, std::llround(std::sqrt(static_cast<double>(max_steps))));
  }
  interval_ = std::min(interval_, max_steps);

  plan_ = std::make_unique<Plan>(context);
  Plan& p = *plan_;
  const auto b = static_cast<std::size_t>(max_batch), t = static_cast<std::size_t>(max_steps);
  const auto d = static_cast<std::size_t>(dim), n = static_cast<std::size_t>(slots);
  const auto k = static_cast<std::size_t>(interval_);
  Carver c;
  p.w_h = c.take(d * d * sizeof(float));
  p.w_write = c.take(d * d * sizeof(float));
  p.tape = c.take(b * n * d * sizeof(float));
  p.recurrent = c.take(b * d * sizeof(float));
  const std::size_t operand = std::max(b * d, kernels::persistent_fragment_floats(max_batch, static_cast<int>(dim)));
  p.h_frag = c.take(operand * sizeof(float));
  p.d_tape = c.take(b * n * d * sizeof(float));
  p.dh_next = c.take(b * d * sizeof(float));
  p.dh_local = c.take(b * d * sizeof(float));
  p.d_gate = c.take(b * d * sizeof(float));
  p.d_write = c.take(operand * sizeof(float));
  p.dh_write = c.take(b * d * sizeof(float));
  p.d_pre = c.take(operand * sizeof(float));
  p.d_bias = c.take(b * d * sizeof(float));
  p.segment = c.take(2 * k * b * n * d * sizeof(float));  // the persistent backward's two buffers
  p.d_pre_all = c.take(t * b * d * sizeof(bf16));
  p.d_write_all = c.take(t * b * d * sizeof(bf16));
  p.dxz = c.take(b * t * 2 * d * sizeof(bf16));
  scratch_ = core::Buffer(context.device(), c.size());
  workspace_ = core::Buffer(context.device(), ops::linear_workspace_bytes());
  set_persistent_cluster(0);
}

void LayerCuda::set_persistent_cluster(int blocks) {
  cluster_ = blocks;
  update_refusals();
}

void LayerCuda::set_persistent_batch_parts(int parts) {
  batch_parts_ = parts;
  update_refusals();
}

void LayerCuda::update_refusals() {
  const int dim = static_cast<int>(dim_), slots = static_cast<int>(slots_);
  persistent_refusal_ = kernels::persistent_forward_refusal(dim, slots, max_batch_, cluster_, batch_parts_);
  backward_refusal_ = options_.carry_clip > 0
                          ? "carry_grad_clip needs the carried gradients' whole norm before each step"
                          : kernels::persistent_backward_refusal(dim, slots, max_batch_, cluster_, batch_parts_);
}

void LayerCuda::set_forward_kernel(RecurrenceKernel kernel) {
  if (kernel == RecurrenceKernel::persistent && !persistent_refusal_.empty()) {
    throw core::Error("e29a LayerCuda: the persistent forward cannot run this layer: " + persistent_refusal_);
  }
  forward_kernel_ = kernel;
}

void LayerCuda::set_backward_kernel(RecurrenceKernel kernel) {
  if (kernel == RecurrenceKernel::persistent && !backward_refusal_.empty()) {
    throw core::Error("e29a LayerCuda: the persistent backward cannot run this layer: " + backward_refusal_);
  }
  backward_kernel_ = kernel;
}

void LayerCuda::check() {
  plan_->forward_launch.check(timeout_seconds_);
  plan_->backward_launch.check(timeout_seconds_);
}

LayerCuda::~LayerCuda() = default;
LayerCuda::LayerCuda(LayerCuda&&) noexcept = default;

std::size_t LayerCuda::activation_bytes() const {
  return activation_offsets(max_batch_, max_steps_, dim_, slots_, interval_).total;
}

LayerActivationsCuda LayerCuda::make_activations() const {
  LayerActivationsCuda a;
  a.buffer_ = core::Buffer(context_->device(), activation_bytes());
  return a;
}

template <typename Args>
void LayerCuda::fill_persistent_args(Args& a, const LayerWeightsCuda& weights,
                                     const LayerActivationsCuda& saved) const {
  a.batch = saved.batch_;
  a.steps = saved.steps_;
  a.dim = static_cast<int>(dim_);
  a.slots = static_cast<int>(slots_);
  a.scale = score_scale(dim_);
  a.w_h = weights.w_h;
  a.w_write = weights.w_write;
  a.xz = saved.xz_;
  a.h = saved.h_;
  a.read = saved.read_;
  a.write = saved.write_;
  a.read_attn = saved.read_attn_;
  a.write_attn = saved.write_attn_;
  a.checkpoints = saved.checkpoints_;
  a.interval = interval_;
  a.timeout_seconds = timeout_seconds_;
  a.stall_block = stall_block_;
  a.cluster = cluster_;
  a.batch_parts = batch_parts_;
}

void LayerCuda::forward(const LayerWeightsCuda& weights, const bf16* u, std::int64_t batch, std::int64_t steps, bf16* y,
                        LayerActivationsCuda& saved, const LayerStateCuda* start, const LayerStateCuda* end) {
  if (batch < 0 || steps < 0 || batch > max_batch_ || steps > max_steps_) {
    throw core::Error("e29a LayerCuda::forward: batch " + std::to_string(batch) + " and steps " +
                      std::to_string(steps) + " must be within [0, " + std::to_string(max_batch_) + "] and [0, " +
                      std::to_string(max_steps_) + "]");
  }
  if (saved.buffer_.bytes() < activation_bytes()) {
    throw core::Error("e29a LayerCuda::forward: activations not made by this layer (make_activations)");
  }
  const cudaStream_t stream = context_->stream();
  Plan& p = *plan_;
  const std::int64_t B = batch, T = steps, D = dim_, N = slots_;
  const ops::DeviceWorkspace ws{workspace_.data(), workspace_.bytes()};
  char* act = static_cast<char*>(saved.buffer_.data());
  char* scr = static_cast<char*>(scratch_.data());
  // Activations are laid out for this call's batch and steps (the backward uses the same sizes).
  const ActivationOffsets o = activation_offsets(B, T, D, N, interval_);
  saved.batch_ = B;
  saved.steps_ = T;
  saved.xz_ = reinterpret_cast<float*>(act + o.xz);
  saved.h_ = reinterpret_cast<float*>(act + o.h);
  saved.h_bf16_ = reinterpret_cast<bf16*>(act + o.h_bf16);
  saved.read_ = reinterpret_cast<float*>(act + o.read);
  saved.write_ = reinterpret_cast<float*>(act + o.write);
  saved.read_attn_ = reinterpret_cast<float*>(act + o.read_attn);
  saved.write_attn_ = reinterpret_cast<float*>(act + o.write_attn);
  saved.checkpoints_ = reinterpret_cast<float*>(act + o.checkpoints);
  if (B == 0) return;

  float* tape = reinterpret_cast<float*>(scr + p.tape);
  float* recurrent = reinterpret_cast<float*>(scr + p.recurrent);
  float* w_h = reinterpret_cast<float*>(scr + p.w_h);
  float* w_write = reinterpret_cast<float*>(scr + p.w_write);

  // Start state.
  const std::size_t h_bytes = static_cast<std::size_t>(B * D) * sizeof(float);
  const std::size_t tape_bytes = static_cast<std::size_t>(B * N * D) * sizeof(float);
  if (start) {
    CUDA_CHECK(cudaMemcpyAsync(saved.h_, start->h, h_bytes, cudaMemcpyDeviceToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(tape, start->tape, tape_bytes, cudaMemcpyDeviceToDevice, stream));
  } else {
    CUDA_CHECK(cudaMemsetAsync(saved.h_, 0, h_bytes, stream));
    kernels::broadcast_tape(weights.tape0, B, N * D, tape, stream);
  }
  kernels::float_to_bf16(saved.h_, B * D, saved.h_bf16_, stream);

  if (T > 0) {
    // [x ; z] for every step: xz [B*T, 2D] = u [B*T, D] W_xz^T.
    p.gemm.run(B * T, 2 * D, D, {u, CUDA_R_16BF, D, Transpose::no}, {weights.w_xz, CUDA_R_16BF, D, Transpose::yes},
               {saved.xz_, CUDA_R_32F, 2 * D, false}, ws);
    kernels::bf16_to_float(weights.w_h, D * D, w_h, stream);
    kernels::bf16_to_float(weights.w_write, D * D, w_write, stream);
  }

  const float scale = score_scale(D);
  const bool persistent = forward_kernel_ == RecurrenceKernel::persistent ||
                          (forward_kernel_ == RecurrenceKernel::automatic && persistent_refusal_.empty());
  last_forward_ = persistent ? RecurrenceKernel::persistent : RecurrenceKernel::hybrid;
  record(events_.forward_start, stream);
  if (persistent && T > 0) {
    p.forward_launch.check_if_landed(timeout_seconds_);
    kernels::PersistentForwardArgs a;
    fill_persistent_args(a, weights, saved);
    a.bias = weights.b_h;
    a.h_bf16 = saved.h_bf16_;
    a.tape = tape;
    a.recurrent = recurrent;
    a.h_frag = reinterpret_cast<float*>(scr + p.h_frag);
    a.y = y;
    a.sync = p.forward_launch.words();
    a.profile = profile_;
    kernels::persistent_forward(a, stream);
    p.forward_launch.after();
  }
  for (std::int64_t t = 0; t < T && !persistent; ++t) {
    float* h_prev = saved.h_ + t * B * D;
    float* h_cur = saved.h_ + (t + 1) * B * D;
    float* write = saved.write_ + t * B * D;
    float* read = saved.read_ + t * B * D;
    // W_h h_{t-1} [B, D].
    p.gemm.run(B, D, D, {h_prev, CUDA_R_32F, D, Transpose::no}, {w_h, CUDA_R_32F, D, Transpose::yes},
               {recurrent, CUDA_R_32F, D, false}, ws);
    kernels::ReadStepArgs r;
    r.batch = B;
    r.dim = static_cast<int>(D);
    r.slots = static_cast<int>(N);
    r.scale = scale;
    r.tape = tape;
    r.h_prev = h_prev;
    r.x = saved.xz_ + t * 2 * D;
    r.x_stride = T * 2 * D;
    r.recurrent = recurrent;
    r.bias = weights.b_h;
    r.h = h_cur;
    r.h_bf16 = saved.h_bf16_ + (t + 1) * B * D;
    r.read = read;
    r.read_attn = saved.read_attn_ + t * B * N;
    kernels::read_step(r, stream);
    // w_t = W_write h_t [B, D].
    p.gemm.run(B, D, D, {h_cur, CUDA_R_32F, D, Transpose::no}, {w_write, CUDA_R_32F, D, Transpose::yes},
               {write, CUDA_R_32F, D, false}, ws);
    kernels::WriteStepArgs w;
    w.batch = B;
    w.dim = static_cast<int>(D);
    w.slots = static_cast<int>(N);
    w.scale = scale;
    w.tape = tape;
    w.checkpoint = t % interval_ == 0 ? saved.checkpoints_ + (t / interval_) * B * N * D : nullptr;
    w.write = write;
    w.h = h_cur;
    w.read = read;
    w.z = saved.xz_ + t * 2 * D + D;
    w.z_stride = T * 2 * D;
    w.write_attn = saved.write_attn_ + t * B * N;
    w.y = y + t * D;
    w.y_stride = T * D;
    kernels::write_step(w, stream);
  }
  record(events_.forward_end, stream);

  if (end) {
    CUDA_CHECK(cudaMemcpyAsync(end->h, saved.h_ + T * B * D, h_bytes, cudaMemcpyDeviceToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(end->tape, tape, tape_bytes, cudaMemcpyDeviceToDevice, stream));
  }
}

void LayerCuda::hybrid_backward(const LayerWeightsCuda& weights, const bf16* dy, const LayerActivationsCuda& saved,
                                const ScoreGradientsCuda* scores) {
  const cudaStream_t stream = context_->stream();
  Plan& p = *plan_;
  const std::int64_t B = saved.batch_, T = saved.steps_, D = dim_, N = slots_;
  const ops::DeviceWorkspace ws{workspace_.data(), workspace_.bytes()};
  const auto [w_h, w_write, d_tape, dh_next, dh_local, d_gate, d_write, dh_write, d_pre, d_bias, segment, d_pre_all,
              d_write_all, dxz] = p.backward_scratch(scratch_.data());

  // The forward of another call may have replaced the fp32 weight copies.
  kernels::bf16_to_float(weights.w_h, D * D, w_h, stream);
  kernels::bf16_to_float(weights.w_write, D * D, w_write, stream);
  CUDA_CHECK(cudaMemsetAsync(d_tape, 0, static_cast<std::size_t>(B * N * D) * sizeof(float), stream));
  CUDA_CHECK(cudaMemsetAsync(dh_next, 0, static_cast<std::size_t>(B * D) * sizeof(float), stream));
  CUDA_CHECK(cudaMemsetAsync(d_bias, 0, static_cast<std::size_t>(B * D) * sizeof(float), stream));

  const float scale = score_scale(D);
  const std::int64_t segments = (T + interval_ - 1) / interval_;
  for (std::int64_t s = segments - 1; s >= 0; --s) {
    const std::int64_t s0 = s * interval_, s1 = std::min(T, s0 + interval_);
    // The tapes before steps s0 .. s1 - 1, from the checkpoint and the saved writes.
    kernels::replay_tape(saved.checkpoints_ + s * B * N * D, saved.write_attn_ + s0 * B * N, saved.write_ + s0 * B * D,
                         B, static_cast<int>(N), static_cast<int>(D), static_cast<int>(s1 - s0), segment, stream);
    for (std::int64_t t = s1 - 1; t >= s0; --t) {
      const float* tape = segment + (t - s0) * B * N * D;
      const float* h_cur = saved.h_ + (t + 1) * B * D;
      const float* read = saved.read_ + t * B * D;
      kernels::WriteBackArgs w;
      w.batch = B;
      w.dim = static_cast<int>(D);
      w.slots = static_cast<int>(N);
      w.scale = scale;
      w.tape = tape;
      w.d_tape = d_tape;
      w.write = saved.write_ + t * B * D;
      w.write_attn = saved.write_attn_ + t * B * N;
      w.h = h_cur;
      w.read = read;
      w.z = saved.xz_ + t * 2 * D + D;
      w.z_stride = T * 2 * D;
      w.dy = dy + t * D;
      w.dy_stride = T * D;
      w.dh_next = dh_next;
      w.dh_local = dh_local;
      w.d_gate = d_gate;
      w.d_write = d_write;
      w.d_write_bf16 = d_write_all + t * B * D;
      w.dz = dxz + t * 2 * D + D;
      w.dz_stride = T * 2 * D;
      w.score_grad = scores && scores->write ? scores->write + t * B * N : nullptr;
      w.detach_scores = options_.detach_write_scores;
      w.carry_clip = static_cast<float>(options_.carry_clip);
      kernels::write_back(w, stream);
      // W_write^T dw_t: dh_write [B, D] = d_write [B, D] W_write [D, D].
      p.gemm.run(B, D, D, {d_write, CUDA_R_32F, D, Transpose::no}, {w_write, CUDA_R_32F, D, Transpose::no},
                 {dh_write, CUDA_R_32F, D, false}, ws);
      kernels::ReadBackArgs r;
      r.batch = B;
      r.dim = static_cast<int>(D);
      r.slots = static_cast<int>(N);
      r.scale = scale;
      r.tape = tape;
      r.d_tape = d_tape;
      r.h_prev = saved.h_ + t * B * D;
      r.h = h_cur;
      r.read_attn = saved.read_attn_ + t * B * N;
      r.dh_local = dh_local;
      r.dh_write = dh_write;
      r.d_gate = d_gate;
      r.dh_prev = dh_next;
      r.d_pre = d_pre;
      r.d_pre_bf16 = d_pre_all + t * B * D;
      r.dx = dxz + t * 2 * D;
      r.dx_stride = T * 2 * D;
      r.d_bias = d_bias;
      r.score_grad = scores && scores->read ? scores->read + t * B * N : nullptr;
      r.detach_scores = options_.detach_read_scores;
      kernels::read_back(r, stream);
      // dh_{t-1} += W_h^T dp_t: dh_next [B, D] += d_pre [B, D] W_h [D, D].
      p.gemm.run(B, D, D, {d_pre, CUDA_R_32F, D, Transpose::no}, {w_h, CUDA_R_32F, D, Transpose::no},
                 {dh_next, CUDA_R_32F, D, true}, ws);
    }
  }
}

void LayerCuda::backward(const LayerWeightsCuda& weights, const bf16* u, const bf16* dy, bf16* du,
                         const LayerGradientsCuda& grads, const LayerActivationsCuda& saved,
                         const ScoreGradientsCuda* scores) {
  if (saved.xz_ == nullptr) throw core::Error("e29a LayerCuda::backward: no forward was run on these activations");
  const cudaStream_t stream = context_->stream();
  Plan& p = *plan_;
  const std::int64_t B = saved.batch_, T = saved.steps_, D = dim_, N = slots_;
  if (B == 0 || T == 0) return;
  const ops::DeviceWorkspace ws{workspace_.data(), workspace_.bytes()};
  const BackwardScratch bs = p.backward_scratch(scratch_.data());

  const bool persistent = backward_kernel_ == RecurrenceKernel::persistent ||
                          (backward_kernel_ == RecurrenceKernel::automatic && backward_refusal_.empty());
  last_backward_ = persistent ? RecurrenceKernel::persistent : RecurrenceKernel::hybrid;
  record(events_.backward_start, stream);
  if (persistent) {
    p.backward_launch.check_if_landed(timeout_seconds_);
    kernels::PersistentBackwardArgs a;
    fill_persistent_args(a, weights, saved);
    a.dy = dy;
    a.d_pre_bf16 = bs.d_pre_all;
    a.d_write_bf16 = bs.d_write_all;
    a.dxz = bs.dxz;
    a.d_bias = bs.d_bias;
    a.d_tape = bs.d_tape;
    a.read_scores = scores ? scores->read : nullptr;
    a.write_scores = scores ? scores->write : nullptr;
    a.detach_read = options_.detach_read_scores;
    a.detach_write = options_.detach_write_scores;
    a.d_pre = bs.d_pre;
    a.d_write = bs.d_write;
    a.recurrent = bs.dh_next;
    a.dh_write = bs.dh_write;
    a.segment = bs.segment;
    a.sync = p.backward_launch.words();
    a.profile = backward_profile_;
    kernels::persistent_backward(a, stream);
    p.backward_launch.after();
  } else {
    hybrid_backward(weights, dy, saved, scores);
  }
  record(events_.backward_end, stream);

  // Weight gradients over all T*B rows (time-major for the recurrent ones, token order for W_xz).
  const std::int64_t rows = T * B;
  p.gemm.run(D, D, rows, {bs.d_pre_all, CUDA_R_16BF, D, Transpose::yes}, {saved.h_bf16_, CUDA_R_16BF, D, Transpose::no},
             {grads.w_h, CUDA_R_32F, D, true}, ws);
  p.gemm.run(D, D, rows, {bs.d_write_all, CUDA_R_16BF, D, Transpose::yes},
             {saved.h_bf16_ + B * D, CUDA_R_16BF, D, Transpose::no}, {grads.w_write, CUDA_R_32F, D, true}, ws);
  p.gemm.run(2 * D, D, rows, {bs.dxz, CUDA_R_16BF, 2 * D, Transpose::yes}, {u, CUDA_R_16BF, D, Transpose::no},
             {grads.w_xz, CUDA_R_32F, D, true}, ws);
  // du [B*T, D] = dxz [B*T, 2D] W_xz [2D, D].
  p.gemm.run(rows, D, 2 * D, {bs.dxz, CUDA_R_16BF, 2 * D, Transpose::no}, {weights.w_xz, CUDA_R_16BF, D, Transpose::no},
             {du, CUDA_R_16BF, D, false}, ws);
  kernels::add_batch_sum(bs.d_bias, B, D, grads.b_h, stream);
  kernels::add_batch_sum(bs.d_tape, B, N * D, grads.tape0, stream);
}

}  // namespace models::e29a
