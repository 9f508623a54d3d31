// The E29a language model and its decoder on one GPU (model_cuda.h).
#include "models/e29a/model_cuda.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "core/buffer.h"
#include "core/error.h"
#include "models/e29a/gemm_cuda.h"
#include "models/e29a/layer_cuda.h"
#include "models/e29a/layer_kernels.h"
#include "models/e29a/model.h"
#include "models/e29a/residual_cuda.h"
#include "models/lm_ends_cuda.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/embedding.h"
#include "models/ops/linear.h"
#include "models/ops/rmsnorm.h"
#include "models/weight_holds.h"

namespace models::e29a {

using bf16 = __nv_bfloat16;

struct E29aCuda::Impl {
  struct LayerSlots {
    std::size_t x_in, normed, rstd;
    std::size_t sum = 0, sum_rstd = 0;  // normed_sum: x_in + y and its rstd, for the backward
  };

  E29aConfig c;
  optim::Slab& slab;
  SlabGradientSink slab_sink{slab};
  optim::GradientSink* sink = &slab_sink;
  const core::DeviceContext& ctx;
  cudaStream_t stream;
  std::int64_t max_tokens;
  TensorIndex index;
  // ZeRO-3: the ranges held from the weight source (inactive without one) and the ranges read.
  WeightHolds holds;
  optim::Range embed_range, tail_range;
  std::vector<optim::Range> layer_ranges;
  LmEndsCuda ends;
  ResidualCuda residual;
  // The recurrent layer (shared by all layers: same sizes, used in turn) and each layer's saved
  // activations, sized for the largest (batch, seq) seen.
  std::unique_ptr<LayerCuda> layer;
  std::vector<LayerActivationsCuda> acts;
  std::int64_t layer_batch = 0, layer_steps = 0;

  core::Buffer memory;
  std::vector<LayerSlots> slots;
  std::size_t y = 0, du = 0, dtmp = 0, dsum = 0, workspace = 0, workspace_bytes = 0;

  Impl(const E29aConfig& config, optim::Slab& s, const core::DeviceContext& context, std::int64_t tokens,
       optim::WeightSource* source)
      : c(config),
        slab(s),
        ctx(context),
        stream(context.stream()),
        max_tokens(tokens),
        index(config, s.layout()),
        holds(source, s.layout(), sizeof(bf16)),
        ends(context, s,
             {index.embed, index.final_norm, index.head, config.vocab_size, config.hidden_size, config.rms_norm_eps},
             tokens),
        residual(context, config.residual, config.hidden_size) {}

  template <typename T>
  T* at(std::size_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(memory.data()) + offset);
  }
  const bf16* w(int tensor) {
    if (holds.active()) return static_cast<const bf16*>(holds.find(tensor));
    return reinterpret_cast<const bf16*>(slab.mirror_view(tensor).data);
  }
  // The range the head's weights are read from: the embedding's when tied, else the tail's.
  optim::Range head_range() const { return index.head == index.embed ? embed_range : tail_range; }
  optim::Range range_of(int tensor) const { return slab.layout().tensors()[static_cast<std::size_t>(tensor)].range(); }
  float* grad_in(float* base, const optim::Range& group, int tensor) const {
    return base + (range_of(tensor).begin - group.begin);
  }
  ops::DeviceWorkspace ws() { return {at<char>(workspace), workspace_bytes}; }
  LayerWeightsCuda layer_weights(const LayerTensors& t) {
    return {w(t.w_xz), w(t.w_h), w(t.b_h), w(t.w_write), w(t.tape0)};
  }

  void ensure_layer(std::int64_t batch, std::int64_t seq) {
    if (layer && batch <= layer_batch && seq <= layer_steps) return;
    const std::int64_t b = std::max(batch, layer_batch), t = std::max(seq, layer_steps);
    CUDA_CHECK(cudaStreamSynchronize(stream));  // the old buffers may still be in use
    acts.clear();
    layer.reset();
    layer = std::make_unique<LayerCuda>(ctx, c.hidden_size, c.n_slots, b, t, c.checkpoint_interval, c.backward);
    // Forcing `persistent` where a kernel cannot take the shape throws, naming why.
    layer->set_forward_kernel(c.recurrence_kernel);
    layer->set_backward_kernel(c.recurrence_kernel);
    for (std::size_t l = 0; l < index.layers.size(); ++l) acts.push_back(layer->make_activations());
    layer_batch = b;
    layer_steps = t;
  }

  void forward(const std::int32_t* ids, std::int64_t batch, std::int64_t seq) {
    const std::int64_t n = batch * seq, d = c.hidden_size;
    if (batch <= 0 || seq <= 0 || n > max_tokens) {
      throw core::Error("E29aCuda: batch * seq = " + std::to_string(n) + " outside (0, " + std::to_string(max_tokens) +
                        "]");
    }
    ensure_layer(batch, seq);
    {
      const auto held = holds.hold(embed_range, layer_ranges.front());
      ends.embed(ids, n, at<bf16>(slots[0].x_in));
    }
    for (std::size_t l = 0; l < index.layers.size(); ++l) {
      // The next range is gathered while this layer computes.
      const auto held = holds.hold(layer_ranges[l], l + 1 < layer_ranges.size() ? layer_ranges[l + 1] : tail_range);
      const LayerTensors& t = index.layers[l];
      const LayerSlots& s = slots[l];
      ops::rmsnorm_forward_cuda(at<bf16>(s.x_in), w(t.norm), n, d, c.rms_norm_eps, at<bf16>(s.normed),
                                at<float>(s.rstd), stream);
      layer->forward(layer_weights(t), at<bf16>(s.normed), batch, seq, at<bf16>(y), acts[l]);
      bf16* next = l + 1 < slots.size() ? at<bf16>(slots[l + 1].x_in) : ends.x_final();
      residual.forward(at<bf16>(s.x_in), at<bf16>(y), n, c.rms_norm_eps, at<bf16>(s.sum), at<float>(s.sum_rstd), next,
                       stream);
    }
    const auto held = holds.hold(tail_range);
    ends.final_norm(n);
  }

  // Gradients go to the sink range by range: the head (unlimited sink) or its row windows
  // (limited sink, after the layers), the final norm, each layer's tensors, the embedding.
  void backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                float grad_scale) {
    const std::int64_t n = batch * seq, d = c.hidden_size;
    optim::GradientSink& out = *sink;
    {
      // The tail holds the final norm and an untied head; a tied head is the embedding.
      const auto tail = holds.hold(tail_range);
      const auto tied = holds.hold(index.head == index.embed ? embed_range : optim::Range{}, layer_ranges.back());
      ends.backward_head(out, targets, n, grad_scale, at<bf16>(dtmp), ws());
    }
    bf16* dx = ends.dx();
    for (std::size_t l = index.layers.size(); l-- > 0;) {
      const auto held = holds.hold(layer_ranges[l], l > 0 ? layer_ranges[l - 1] : head_range());
      const LayerTensors& t = index.layers[l];
      const LayerSlots& s = slots[l];
      const optim::Range range = layer_ranges[l];
      float* g = out.acquire(range);
      const LayerGradientsCuda grads{grad_in(g, range, t.w_xz), grad_in(g, range, t.w_h), grad_in(g, range, t.b_h),
                                     grad_in(g, range, t.w_write), grad_in(g, range, t.tape0)};
      // dL/d(x_l + y_l), which both terms of the sum get: dx itself for pre_norm.
      const bf16* dsum_l = dx;
      if (residual.normed()) {
        residual.backward(dx, at<bf16>(s.sum), at<float>(s.sum_rstd), n, at<bf16>(dsum), ws(), stream);
        dsum_l = at<bf16>(dsum);
      }
      layer->backward(layer_weights(t), at<bf16>(s.normed), dsum_l, at<bf16>(du), grads, acts[l]);
      ops::rmsnorm_backward_cuda(at<bf16>(du), at<bf16>(s.x_in), w(t.norm), at<float>(s.rstd), n, d, at<bf16>(dtmp),
                                 grad_in(g, range, t.norm), at<char>(workspace), workspace_bytes, stream);
      out.release(range);
      kernels::add_bf16(dsum_l, at<bf16>(dtmp), n * d, dx, stream);
    }
    // Row windows recompute the logits from the head's weights.
    const auto held = holds.hold(head_range());
    ends.backward_embedding(out, ids, targets, n, grad_scale, ws());
  }

  std::int64_t largest_group() const {
    std::int64_t largest = ends.largest_range();
    for (const optim::Range& r : layer_ranges) largest = std::max(largest, r.size());
    return largest;
  }
};

E29aCuda::E29aCuda(const E29aConfig& config, optim::Slab& slab, const core::DeviceContext& context,
                   std::int64_t max_tokens, optim::WeightSource* source)
    : impl_(std::make_unique<Impl>(config, slab, context, max_tokens, source)) {
  check_cuda_slab(slab, context, "E29aCuda");
  if (max_tokens <= 0) throw core::Error("E29aCuda: max_tokens must be > 0");
  if (config.n_slots > kernels::kMaxSlots) {
    throw core::InputError("E29aCuda: n_slots " + std::to_string(config.n_slots) +
                           " is more than the cuda kernels take (" + std::to_string(kernels::kMaxSlots) + ")");
  }
  Impl& m = *impl_;
  for (std::size_t l = 0; l < m.index.layers.size(); ++l) {
    m.layer_ranges.push_back(m.index.layer_range(slab.layout(), l));
  }
  m.embed_range = m.index.embed_range(slab.layout());
  m.tail_range = m.index.tail_range(slab.layout());
  m.ends.set_weight_holds(&m.holds);
  DeviceArena a;
  const auto n = static_cast<std::size_t>(max_tokens), d = static_cast<std::size_t>(config.hidden_size);
  for (std::size_t l = 0; l < m.index.layers.size(); ++l) {
    Impl::LayerSlots& s =
        m.slots.emplace_back(Impl::LayerSlots{a.reserve(n * d * 2), a.reserve(n * d * 2), a.reserve(n * 4)});
    if (m.residual.normed()) {
      s.sum = a.reserve(n * d * 2);
      s.sum_rstd = a.reserve(n * 4);
    }
  }
  m.y = a.reserve(n * d * 2);
  m.du = a.reserve(n * d * 2);
  m.dtmp = a.reserve(n * d * 2);
  if (m.residual.normed()) m.dsum = a.reserve(n * d * 2);
  m.workspace_bytes = LmEndsCuda::workspace_bytes(max_tokens, config.vocab_size, config.hidden_size);
  m.workspace = a.reserve(m.workspace_bytes);
  m.memory = core::Buffer(context.device(), a.size());
  m.memory.fill_bytes(0, context.stream());
}

E29aCuda::~E29aCuda() = default;

void E29aCuda::forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                                std::int64_t seq, float grad_scale) {
  impl_->forward(ids, batch, seq);
  impl_->backward(ids, targets, batch, seq, grad_scale);
}

void E29aCuda::forward_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                            std::int64_t seq) {
  Impl& m = *impl_;
  m.forward(ids, batch, seq);
  const auto held = m.holds.hold(m.head_range());
  m.ends.loss(targets, batch * seq, m.ws());
}

const float* E29aCuda::loss() const { return impl_->ends.loss_value(); }
const float* E29aCuda::token_losses() const { return impl_->ends.token_losses(); }
const std::int32_t* E29aCuda::invalid_id_flag() const { return impl_->ends.invalid_id_flag(); }

void E29aCuda::check_device_faults() {
  if (impl_->layer) impl_->layer->check();
}

void E29aCuda::set_gradient_sink(optim::GradientSink* sink) {
  Impl& m = *impl_;
  m.sink = checked_sink(sink, &m.slab_sink, m.largest_group(), "E29aCuda");
}

std::int64_t E29aCuda::largest_gradient_range() const { return impl_->largest_group(); }

std::size_t E29aCuda::activation_bytes() const {
  const Impl& m = *impl_;
  std::size_t bytes = m.memory.bytes() + m.ends.bytes();
  if (m.layer) bytes += m.layer->scratch_bytes() + m.acts.size() * m.layer->activation_bytes();
  return bytes;
}

// ---- decoder ----

struct E29aCudaDecoder::Impl {
  E29aConfig c;
  optim::Slab& slab;
  const void* whole_mirror = nullptr;  // DecoderOptions::whole_mirror
  const core::DeviceContext& ctx;
  cudaStream_t stream;
  TensorIndex index;
  std::int64_t capacity = 0, position = 0;
  LayerCuda layer;
  LayerActivationsCuda acts;
  ResidualCuda residual;
  GemmPlan gemm;
  core::Buffer memory;  // ids, x, normed, rstd, y, logits, the per-layer states, workspace
  std::size_t ids = 0, x = 0, normed = 0, rstd = 0, y = 0, logits = 0, h = 0, tape = 0, invalid = 0, workspace = 0;

  Impl(const E29aConfig& config, optim::Slab& s, const core::DeviceContext& context, std::int64_t cap)
      : c(config),
        slab(s),
        ctx(context),
        stream(context.stream()),
        index(config, s.layout()),
        capacity(cap),
        layer(context, config.hidden_size, config.n_slots, 1, cap, config.checkpoint_interval),
        acts(layer.make_activations()),
        residual(context, config.residual, config.hidden_size),
        gemm(context) {}

  template <typename T>
  T* at(std::size_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(memory.data()) + offset);
  }
  const bf16* w(int tensor) { return static_cast<const bf16*>(decoder_mirror_tensor(slab, whole_mirror, tensor)); }
  LayerStateCuda state(std::size_t l) {
    const std::int64_t d = c.hidden_size;
    return {at<float>(h) + l * d, at<float>(tape) + l * c.n_slots * d};
  }

  // Runs `count` tokens already in ids[0, count) through the stack from the current state.
  void run(std::int64_t count, float* all_logits) {
    const std::int64_t d = c.hidden_size;
    ops::embedding_forward_cuda(at<std::int32_t>(ids), count, w(index.embed), c.vocab_size, d, at<bf16>(x),
                                at<std::int32_t>(invalid), stream);
    for (std::size_t l = 0; l < index.layers.size(); ++l) {
      const LayerTensors& t = index.layers[l];
      ops::rmsnorm_forward_cuda(at<bf16>(x), w(t.norm), count, d, c.rms_norm_eps, at<bf16>(normed), at<float>(rstd),
                                stream);
      const LayerStateCuda s = state(l);
      layer.forward({w(t.w_xz), w(t.w_h), w(t.b_h), w(t.w_write), w(t.tape0)}, at<bf16>(normed), 1, count, at<bf16>(y),
                    acts, position > 0 ? &s : nullptr, &s);
      // The normed sum goes through y (free once added): its output must not alias its input. The
      // input norm is done with rstd, so the sum's rstd can go there.
      residual.forward(at<bf16>(x), at<bf16>(y), count, c.rms_norm_eps, at<bf16>(y), at<float>(rstd), at<bf16>(x),
                       stream);
    }
    ops::rmsnorm_forward_cuda(at<bf16>(x), w(index.final_norm), count, d, c.rms_norm_eps, at<bf16>(normed),
                              at<float>(rstd), stream);
    const ops::DeviceWorkspace ws{at<char>(workspace), ops::linear_workspace_bytes()};
    const Matrix head{w(index.head), CUDA_R_16BF, d, Transpose::yes};
    gemm.run(1, c.vocab_size, d, {at<bf16>(normed) + (count - 1) * d, CUDA_R_16BF, d, Transpose::no}, head,
             {at<float>(logits), CUDA_R_32F, c.vocab_size, false}, ws);
    if (all_logits != nullptr) {
      gemm.run(count, c.vocab_size, d, {at<bf16>(normed), CUDA_R_16BF, d, Transpose::no}, head,
               {all_logits, CUDA_R_32F, c.vocab_size, false}, ws);
    }
    position += count;
  }
};

E29aCudaDecoder::E29aCudaDecoder(const E29aConfig& config, optim::Slab& slab, const core::DeviceContext& context,
                                 const DecoderOptions& options) {
  check_cuda_slab(slab, context, "E29aCudaDecoder");
  check_decoder_capacity(options.max_tokens);
  impl_ = std::make_unique<Impl>(config, slab, context, options.max_tokens);
  Impl& m = *impl_;
  m.whole_mirror = options.whole_mirror;
  DeviceArena a;
  const auto cap = static_cast<std::size_t>(options.max_tokens), d = static_cast<std::size_t>(config.hidden_size);
  const auto layers = static_cast<std::size_t>(config.num_layers);
  m.ids = a.reserve(cap * 4);
  m.x = a.reserve(cap * d * 2);
  m.normed = a.reserve(cap * d * 2);
  m.rstd = a.reserve(cap * 4);
  m.y = a.reserve(cap * d * 2);
  m.logits = a.reserve(static_cast<std::size_t>(config.vocab_size) * 4);
  m.h = a.reserve(layers * d * 4);
  m.tape = a.reserve(layers * static_cast<std::size_t>(config.n_slots) * d * 4);
  m.invalid = a.reserve(4);
  m.workspace = a.reserve(ops::linear_workspace_bytes());
  m.memory = core::Buffer(context.device(), a.size());
  m.memory.fill_bytes(0, context.stream());
}

E29aCudaDecoder::~E29aCudaDecoder() = default;

void E29aCudaDecoder::reset() { impl_->position = 0; }

void E29aCudaDecoder::prefill(std::span<const std::int32_t> tokens, float* all_logits) {
  Impl& m = *impl_;
  const auto count = static_cast<std::int64_t>(tokens.size());
  if (count == 0) return;
  check_decoder_prompt(tokens, m.position, m.capacity, m.c.vocab_size);
  CUDA_CHECK(
      cudaMemcpyAsync(m.at<std::int32_t>(m.ids), tokens.data(), tokens.size_bytes(), cudaMemcpyHostToDevice, m.stream));
  m.run(count, all_logits);
  // The host span may go away after return: the copy must have read it.
  CUDA_CHECK(cudaStreamSynchronize(m.stream));
}

void E29aCudaDecoder::step(std::int32_t token, const std::int32_t* device_token) {
  Impl& m = *impl_;
  if (device_token == nullptr) {
    prefill(std::span<const std::int32_t>(&token, 1));
    return;
  }
  check_decoder_room(m.position, 1, m.capacity);
  CUDA_CHECK(cudaMemcpyAsync(m.at<std::int32_t>(m.ids), device_token, sizeof(std::int32_t), cudaMemcpyDeviceToDevice,
                             m.stream));
  m.run(1, nullptr);
}

const float* E29aCudaDecoder::logits() const { return impl_->at<float>(impl_->logits); }
std::int64_t E29aCudaDecoder::position() const { return impl_->position; }
std::int64_t E29aCudaDecoder::capacity() const { return impl_->capacity; }

}  // namespace models::e29a
