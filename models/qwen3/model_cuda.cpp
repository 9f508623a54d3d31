#include "models/qwen3/model_cuda.h"

#include <algorithm>
#include <limits>
#include <vector>

#include <cuda_bf16.h>

#include "core/error.h"
#include "core/phase_timer.h"
#include "models/lm_ends_cuda.h"
#include "models/ops/attention.h"
#include "models/ops/embedding.h"
#include "models/ops/rmsnorm.h"
#include "models/ops/qk_norm_rope.h"
#include "models/ops/rope.h"
#include "models/ops/swiglu.h"
#include "models/qwen3/model_kernels.h"

namespace models::qwen3 {

using bf16 = __nv_bfloat16;

Recompute recompute_from_string(const std::string& name) {
  if (name == "none") return Recompute::none;
  if (name == "mlp") return Recompute::mlp;
  if (name == "full") return Recompute::full;
  throw core::InputError("activation recompute must be none, mlp or full, got '" + name + "'");
}

namespace {

// Where the activations live: offsets into one allocation of `total` bytes. The model carves its
// memory from it and a memory plan sizes it without allocating (Qwen3Cuda::planned_activation_bytes).
struct ActivationLayout {
  // A layer's slots (the same layout for the saved copies and for the recompute scratch).
  struct LayerSlots {
    std::size_t x_in, rstd_in, h, qkv, qk, rstd_q, rstd_k, att, lse, x_mid, rstd_post, h2, gate_up, act;
  };

  static LayerSlots reserve_layer(DeviceArena& a, const Qwen3Config& config, std::int64_t tokens, bool keep_all,
                                  bool keep_mlp) {
    const std::size_t n = static_cast<std::size_t>(tokens);
    const std::size_t d = static_cast<std::size_t>(config.hidden_size);
    LayerSlots s{};
    s.x_in = a.reserve(n * d * 2);
    if (!keep_all) return s;
    s.rstd_in = a.reserve(n * 4);
    s.h = a.reserve(n * d * 2);
    s.qkv = a.reserve(n * static_cast<std::size_t>(config.qkv_size()) * 2);
    s.qk = a.reserve(n * static_cast<std::size_t>(config.q_size() + config.kv_size()) * 2);
    s.rstd_q = a.reserve(n * static_cast<std::size_t>(config.num_heads) * 4);
    s.rstd_k = a.reserve(n * static_cast<std::size_t>(config.num_kv_heads) * 4);
    s.att = a.reserve(n * static_cast<std::size_t>(config.q_size()) * 2);
    s.lse = a.reserve(n * static_cast<std::size_t>(config.num_heads) * 4);
    s.x_mid = a.reserve(n * d * 2);
    s.rstd_post = a.reserve(n * 4);
    s.h2 = a.reserve(n * d * 2);
    if (keep_mlp) {
      s.gate_up = a.reserve(n * 2 * static_cast<std::size_t>(config.intermediate_size) * 2);
      s.act = a.reserve(n * static_cast<std::size_t>(config.intermediate_size) * 2);
    }
    return s;
  }

  ActivationLayout(const Qwen3Config& config, std::int64_t tokens, Recompute recompute) {
    DeviceArena a;
    const std::size_t n = static_cast<std::size_t>(tokens), d = static_cast<std::size_t>(config.hidden_size);
    const std::size_t f = static_cast<std::size_t>(config.intermediate_size);
    for (std::int64_t l = 0; l < config.num_layers; ++l) {
      saved.push_back(reserve_layer(a, config, tokens, recompute != Recompute::full, recompute == Recompute::none));
    }
    if (recompute != Recompute::none) scratch = reserve_layer(a, config, tokens, true, true);
    positions = a.reserve(n * 4);
    dtmp = a.reserve(n * d * 2);
    datt = a.reserve(n * static_cast<std::size_t>(config.q_size()) * 2);
    dqk = a.reserve(n * static_cast<std::size_t>(config.q_size() + config.kv_size()) * 2);
    dqkv = a.reserve(n * static_cast<std::size_t>(config.qkv_size()) * 2);
    dgate_up = a.reserve(n * 2 * f * 2);
    dact = a.reserve(n * f * 2);
    dh = a.reserve(n * d * 2);
    const ops::AttentionShape widest{1, tokens, config.num_heads, config.num_kv_heads, config.head_dim};
    workspace_bytes = std::max({LmEndsCuda::workspace_bytes(tokens, config.vocab_size, config.hidden_size),
                                ops::head_rmsnorm_backward_workspace_bytes(tokens, config.num_heads, config.head_dim),
                                ops::qk_norm_rope_backward_workspace_bytes({.tokens = tokens,
                                                                            .q_heads = config.num_heads,
                                                                            .kv_heads = config.num_kv_heads,
                                                                            .head_dim = config.head_dim}),
                                ops::attention_backward_workspace_bytes(widest)});
    workspace = a.reserve(workspace_bytes);
    total = a.size();
  }

  std::vector<LayerSlots> saved;  // per layer
  LayerSlots scratch{};           // recompute target
  std::size_t positions = 0;
  std::size_t dtmp = 0, datt = 0, dqk = 0, dqkv = 0, dgate_up = 0, dact = 0, dh = 0;
  std::size_t workspace = 0, workspace_bytes = 0;
  std::size_t total = 0;
};

}  // namespace

struct Qwen3Cuda::Impl : ActivationLayout {
  using LayerWeights = Qwen3LayerTensors;
  using Scope = core::PhaseScope;

  // The gradient ranges of one layer's backward, in the order it finishes them.
  struct LayerGroups {
    optim::Range mlp, attention;
  };

  Qwen3Config c;
  optim::Slab& slab;
  SlabGradientSink slab_sink{slab};
  optim::GradientSink* sink = &slab_sink;
  const core::DeviceContext& ctx;
  cudaStream_t stream;
  std::int64_t max_tokens;
  Recompute recompute;
  ops::LinearPlan linear;
  int embed = 0, final_norm = 0, head = 0;
  std::unique_ptr<LmEndsCuda> ends;
  std::vector<LayerWeights> layers;
  std::vector<LayerGroups> groups;  // per layer

  core::Buffer memory;
  // ZeRO-3: the ranges held from the weight source (inactive without one) and the ranges read.
  WeightHolds holds;
  optim::Range embed_range, tail_range;
  std::vector<optim::Range> layer_ranges;
  core::PhaseTimer* timer = nullptr;  // set_phase_timer; null records nothing
  // q/k norm + RoPE in one pass each way where the shape allows (activations are 256-byte aligned
  // slices of one allocation, so the packed strides decide), else the four separate launches.
  bool fused_qk_norm_rope;

  Impl(const Qwen3Config& config, optim::Slab& s, const core::DeviceContext& context, std::int64_t tokens, Recompute r,
       optim::WeightSource* source)
      : ActivationLayout(config, tokens, r),
        c(config),
        slab(s),
        ctx(context),
        stream(context.stream()),
        max_tokens(tokens),
        recompute(r),
        linear(context),
        holds(source, s.layout(), sizeof(bf16)),
        fused_qk_norm_rope(ops::qk_norm_rope_supported(qk_norm_rope_shape(tokens),
                                                       {config.qkv_size(), config.q_size() + config.kv_size()}, {})) {}

  template <typename T>
  T* at(std::size_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(memory.data()) + offset);
  }
  const bf16* w(int tensor) {
    if (holds.active()) return static_cast<const bf16*>(holds.find(tensor));
    return reinterpret_cast<const bf16*>(slab.mirror_view(tensor).data);
  }
  optim::Range head_range() const { return head == embed ? embed_range : tail_range; }
  optim::Range range_of(int tensor) const { return slab.layout().tensors()[static_cast<std::size_t>(tensor)].range(); }
  // Gradient memory of `tensor` inside the acquired `group` whose memory starts at `base`.
  float* grad_in(float* base, const optim::Range& group, int tensor) const {
    return base + (range_of(tensor).begin - group.begin);
  }
  ops::DeviceWorkspace ws() { return {at<char>(workspace), workspace_bytes}; }
  ops::QkNormRopeShape qk_norm_rope_shape(std::int64_t tokens) const {
    return {tokens, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.rope_theta};
  }

  // One layer forward from s.x_in into out_x (the next layer's input), filling s's slots. `t`
  // times its phases (null inside a backward's recompute, which is timed as one phase).
  void layer_forward(std::size_t l, const LayerSlots& s, bf16* out_x, std::int64_t batch, std::int64_t seq,
                     core::PhaseTimer* t) {
    const LayerWeights& lw = layers[l];
    const std::int64_t n = batch * seq, d = c.hidden_size, qs = c.q_size(), kvs = c.kv_size(), qkv = c.qkv_size();
    const std::int64_t qk = qs + kvs, f = c.intermediate_size;
    {
      const Scope phase(t, "attn.norm.fwd");
      ops::rmsnorm_forward_cuda(at<bf16>(s.x_in), w(lw.input_norm), n, d, c.rms_norm_eps, at<bf16>(s.h),
                                at<float>(s.rstd_in), stream);
    }
    {
      const Scope phase(t, "attn.qkv.fwd");
      linear.forward(at<bf16>(s.h), w(lw.qkv), n, d, qkv, at<bf16>(s.qkv), ws());
    }
    const std::int32_t* pos = at<std::int32_t>(positions);
    {
      const Scope phase(t, "attn.qk_norm_rope.fwd");
      if (fused_qk_norm_rope) {
        // One pass (the same bits as the four launches below).
        const ops::QkNormRopeShape qk_shape = qk_norm_rope_shape(n);
        ops::qk_norm_rope_forward_cuda(at<bf16>(s.qkv), qkv, w(lw.q_norm), w(lw.k_norm), pos, qk_shape, at<bf16>(s.qk),
                                       qk, at<float>(s.rstd_q), at<float>(s.rstd_k), stream);
      } else {
        ops::head_rmsnorm_forward_cuda(at<bf16>(s.qkv), qkv, w(lw.q_norm), n, c.num_heads, c.head_dim, c.rms_norm_eps,
                                       at<bf16>(s.qk), qk, at<float>(s.rstd_q), stream);
        ops::head_rmsnorm_forward_cuda(at<bf16>(s.qkv) + qs, qkv, w(lw.k_norm), n, c.num_kv_heads, c.head_dim,
                                       c.rms_norm_eps, at<bf16>(s.qk) + qs, qk, at<float>(s.rstd_k), stream);
        ops::rope_forward_cuda(at<bf16>(s.qk), qk, at<bf16>(s.qk), qk, pos, n, c.num_heads, c.head_dim, c.rope_theta,
                               stream);
        ops::rope_forward_cuda(at<bf16>(s.qk) + qs, qk, at<bf16>(s.qk) + qs, qk, pos, n, c.num_kv_heads, c.head_dim,
                               c.rope_theta, stream);
      }
    }
    const ops::AttentionShape shape{batch, seq, c.num_heads, c.num_kv_heads, c.head_dim};
    {
      const Scope phase(t, "attn.core.fwd");
      ops::attention_forward_cuda(shape, {at<std::uint16_t>(s.qk), qk}, {at<std::uint16_t>(s.qk) + qs, qk},
                                  {at<std::uint16_t>(s.qkv) + qs + kvs, qkv}, at<std::uint16_t>(s.att),
                                  at<float>(s.lse), stream);
    }
    {
      const Scope phase(t, "attn.o_proj.fwd");
      linear.forward(at<bf16>(s.att), w(lw.o_proj), n, qs, d, at<bf16>(dtmp), ws());
    }
    {
      const Scope phase(t, "residual.fwd");
      add_bf16(at<bf16>(s.x_in), at<bf16>(dtmp), at<bf16>(s.x_mid), n * d, stream);
    }
    mlp_forward(l, s, n, t);
    {
      const Scope phase(t, "mlp.down.fwd");
      linear.forward(at<bf16>(s.act), w(lw.down), n, f, d, at<bf16>(dtmp), ws());
    }
    const Scope phase(t, "residual.fwd");
    add_bf16(at<bf16>(s.x_mid), at<bf16>(dtmp), out_x, n * d, stream);
  }

  // norm -> gate_up -> swiglu from s.x_mid.
  void mlp_forward(std::size_t l, const LayerSlots& s, std::int64_t n, core::PhaseTimer* t) {
    const LayerWeights& lw = layers[l];
    const std::int64_t d = c.hidden_size, f = c.intermediate_size;
    {
      const Scope phase(t, "mlp.norm.fwd");
      ops::rmsnorm_forward_cuda(at<bf16>(s.x_mid), w(lw.post_norm), n, d, c.rms_norm_eps, at<bf16>(s.h2),
                                at<float>(s.rstd_post), stream);
    }
    {
      const Scope phase(t, "mlp.gate_up.fwd");
      linear.forward(at<bf16>(s.h2), w(lw.gate_up), n, d, 2 * f, at<bf16>(s.gate_up), ws());
    }
    const Scope phase(t, "mlp.silu.fwd");
    ops::swiglu_forward_cuda(at<bf16>(s.gate_up), n, f, at<bf16>(s.act), stream);
  }

  // The slots a layer's backward reads, recomputing what the mode did not keep.
  LayerSlots slots_for_backward(std::size_t l, std::int64_t batch, std::int64_t seq) {
    const std::int64_t n = batch * seq;
    if (recompute == Recompute::full) {
      LayerSlots s = scratch;
      s.x_in = saved[l].x_in;
      const Scope phase(timer, "recompute.bwd");
      layer_forward(l, s, at<bf16>(dh), batch, seq, nullptr);  // the layer's output is not needed: dh is free here
      return s;
    }
    LayerSlots s = saved[l];
    if (recompute == Recompute::mlp) {
      const Scope phase(timer, "recompute.bwd");
      s.gate_up = scratch.gate_up;
      s.act = scratch.act;
      const LayerWeights& lw = layers[l];
      linear.forward(at<bf16>(s.h2), w(lw.gate_up), n, c.hidden_size, 2 * c.intermediate_size, at<bf16>(s.gate_up),
                     ws());
      ops::swiglu_forward_cuda(at<bf16>(s.gate_up), n, c.intermediate_size, at<bf16>(s.act), stream);
    }
    return s;
  }

  // Runs the stack; leaves the final norm's output in x_norm.
  void forward(const std::int32_t* ids, std::int64_t batch, std::int64_t seq) {
    const std::int64_t n = batch * seq;
    if (batch <= 0 || seq <= 0 || n > max_tokens) {
      throw core::Error("Qwen3Cuda: batch * seq = " + std::to_string(n) + " outside (0, " + std::to_string(max_tokens) +
                        "]");
    }
    {
      const Scope phase(timer, "embedding.fwd");  // with the positions RoPE reads
      fill_positions(at<std::int32_t>(positions), n, seq, stream);
      const auto held = holds.hold(embed_range, layer_ranges.front());
      ends->embed(ids, n, at<bf16>(saved[0].x_in));
    }
    for (std::size_t l = 0; l < layers.size(); ++l) {
      // The next range is gathered while this layer computes.
      const auto held = holds.hold(layer_ranges[l], l + 1 < layers.size() ? layer_ranges[l + 1] : tail_range);
      const LayerSlots s = recompute == Recompute::full  ? with_input(scratch, saved[l].x_in)
                           : recompute == Recompute::mlp ? with_mlp(saved[l], scratch)
                                                         : saved[l];
      bf16* next = l + 1 < layers.size() ? at<bf16>(saved[l + 1].x_in) : ends->x_final();
      layer_forward(l, s, next, batch, seq, timer);
    }
    const auto held = holds.hold(tail_range);
    const Scope phase(timer, "final_norm.fwd");
    ends->final_norm(n);
  }

  static LayerSlots with_input(LayerSlots s, std::size_t x_in) {
    s.x_in = x_in;
    return s;
  }
  static LayerSlots with_mlp(LayerSlots s, const LayerSlots& from) {
    s.gate_up = from.gate_up;
    s.act = from.act;
    return s;
  }

  // Gradients go to `sink` range by range: the final norm, then per layer its MLP and its
  // attention, then the vocabulary-sized tensors. With a sink of unlimited ranges (the slab) the
  // lm_head's gradient comes from the fused cross-entropy backward (token chunks, dW accumulated
  // over them). With a limited sink (staging for ZeRO-2 with sharded gradients) no whole [vocab,
  // dim] gradient may exist: the cross-entropy backward first gives the hidden gradient and each
  // token's logsumexp, and after the layers the lm_head (and embedding) gradient is produced in
  // row windows, each one final before the next (the logits are computed a second time for that).
  void backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                float grad_scale) {
    const std::int64_t n = batch * seq, d = c.hidden_size, qs = c.q_size(), kvs = c.kv_size(), qkv = c.qkv_size();
    const std::int64_t qk = qs + kvs, f = c.intermediate_size;
    optim::GradientSink& out = *sink;
    {
      // The tail holds the final norm and an untied head; a tied head is the embedding.
      const auto tail = holds.hold(tail_range);
      const auto tied = holds.hold(head == embed ? embed_range : optim::Range{}, layer_ranges.back());
      // The logits, the loss and their backward are one fused pass, with the final norm's backward.
      const Scope phase(timer, "lm_head+loss.fwd+bwd");
      ends->backward_head(out, targets, n, grad_scale, at<bf16>(dtmp), ws());
    }
    bf16* dx = ends->dx();
    const ops::AttentionShape shape{batch, seq, c.num_heads, c.num_kv_heads, c.head_dim};
    const std::int32_t* pos = at<std::int32_t>(positions);
    // The end of a residual branch's backward (from the gradient at its norm's output, dh): the
    // norm's backward into dtmp and its weight's gradient, the branch's range released, dtmp added
    // to the residual gradient dx.
    auto branch_norm_backward = [&](const bf16* x, int norm_weight, const float* rstd, float* range_grad,
                                    const optim::Range& range, const char* norm_phase) {
      {
        const Scope phase(timer, norm_phase);
        ops::rmsnorm_backward_cuda(at<bf16>(dh), x, w(norm_weight), rstd, n, d, at<bf16>(dtmp),
                                   grad_in(range_grad, range, norm_weight), at<char>(workspace), workspace_bytes,
                                   stream);
      }
      out.release(range);
      const Scope phase(timer, "residual.bwd");
      add_bf16(dx, at<bf16>(dtmp), dx, n * d, stream);
    };
    for (std::size_t l = layers.size(); l-- > 0;) {
      const auto held = holds.hold(layer_ranges[l], l > 0 ? layer_ranges[l - 1] : head_range());
      const LayerWeights& lw = layers[l];
      const LayerSlots s = slots_for_backward(l, batch, seq);
      // MLP: out = x_mid + down(swiglu(gate_up(norm(x_mid)))).
      const optim::Range mlp = groups[l].mlp;
      float* mlp_grad = out.acquire(mlp);
      {
        const Scope phase(timer, "mlp.down.bwd");
        linear.backward(dx, at<bf16>(s.act), w(lw.down), n, f, d, at<bf16>(dact), grad_in(mlp_grad, mlp, lw.down),
                        ws());
      }
      {
        const Scope phase(timer, "mlp.silu.bwd");
        ops::swiglu_backward_cuda(at<bf16>(dact), at<bf16>(s.gate_up), n, f, at<bf16>(dgate_up), stream);
      }
      {
        const Scope phase(timer, "mlp.gate_up.bwd");
        linear.backward(at<bf16>(dgate_up), at<bf16>(s.h2), w(lw.gate_up), n, d, 2 * f, at<bf16>(dh),
                        grad_in(mlp_grad, mlp, lw.gate_up), ws());
      }
      branch_norm_backward(at<bf16>(s.x_mid), lw.post_norm, at<float>(s.rstd_post), mlp_grad, mlp, "mlp.norm.bwd");
      // Attention: x_mid = x_in + o_proj(attention(rope(norm(q)), rope(norm(k)), v)).
      const optim::Range attention = groups[l].attention;
      float* att_grad = out.acquire(attention);
      {
        const Scope phase(timer, "attn.o_proj.bwd");
        linear.backward(dx, at<bf16>(s.att), w(lw.o_proj), n, qs, d, at<bf16>(datt),
                        grad_in(att_grad, attention, lw.o_proj), ws());
      }
      {
        const Scope phase(timer, "attn.core.bwd");
        ops::attention_backward_cuda(shape, {at<std::uint16_t>(s.qk), qk}, {at<std::uint16_t>(s.qk) + qs, qk},
                                     {at<std::uint16_t>(s.qkv) + qs + kvs, qkv}, at<std::uint16_t>(s.att),
                                     at<float>(s.lse), at<std::uint16_t>(datt), {at<std::uint16_t>(dqk), qk},
                                     {at<std::uint16_t>(dqk) + qs, qk}, {at<std::uint16_t>(dqkv) + qs + kvs, qkv},
                                     at<char>(workspace), workspace_bytes, stream);
      }
      {
        const Scope phase(timer, "attn.qk_norm_rope.bwd");
        if (fused_qk_norm_rope) {
          const ops::QkNormRopeShape qk_shape = qk_norm_rope_shape(n);
          ops::qk_norm_rope_backward_cuda(
              at<bf16>(dqk), qk, at<bf16>(s.qkv), qkv, w(lw.q_norm), w(lw.k_norm), at<float>(s.rstd_q),
              at<float>(s.rstd_k), pos, qk_shape, at<bf16>(dqkv), qkv, grad_in(att_grad, attention, lw.q_norm),
              grad_in(att_grad, attention, lw.k_norm), at<char>(workspace), workspace_bytes, stream);
        } else {
          ops::rope_backward_cuda(at<bf16>(dqk), qk, at<bf16>(dqk), qk, pos, n, c.num_heads, c.head_dim, c.rope_theta,
                                  stream);
          ops::rope_backward_cuda(at<bf16>(dqk) + qs, qk, at<bf16>(dqk) + qs, qk, pos, n, c.num_kv_heads, c.head_dim,
                                  c.rope_theta, stream);
          ops::head_rmsnorm_backward_cuda(at<bf16>(dqk), qk, at<bf16>(s.qkv), qkv, w(lw.q_norm), at<float>(s.rstd_q), n,
                                          c.num_heads, c.head_dim, at<bf16>(dqkv), qkv,
                                          grad_in(att_grad, attention, lw.q_norm), at<char>(workspace), workspace_bytes,
                                          stream);
          ops::head_rmsnorm_backward_cuda(at<bf16>(dqk) + qs, qk, at<bf16>(s.qkv) + qs, qkv, w(lw.k_norm),
                                          at<float>(s.rstd_k), n, c.num_kv_heads, c.head_dim, at<bf16>(dqkv) + qs, qkv,
                                          grad_in(att_grad, attention, lw.k_norm), at<char>(workspace), workspace_bytes,
                                          stream);
        }
      }
      {
        const Scope phase(timer, "attn.qkv.bwd");
        linear.backward(at<bf16>(dqkv), at<bf16>(s.h), w(lw.qkv), n, d, qkv, at<bf16>(dh),
                        grad_in(att_grad, attention, lw.qkv), ws());
      }
      branch_norm_backward(at<bf16>(s.x_in), lw.input_norm, at<float>(s.rstd_in), att_grad, attention, "attn.norm.bwd");
    }
    // Row windows recompute the logits from the head's weights.
    const auto held = holds.hold(head_range());
    const Scope phase(timer, "embedding.bwd");
    ends->backward_embedding(out, ids, targets, n, grad_scale, ws());
  }

  // The largest range the backward acquires from a limited sink: a layer's MLP or attention
  // span, the final norm, or one row of a vocabulary-sized tensor.
  std::int64_t largest_group() const {
    return Qwen3TensorIndex(c, slab.layout(), "Qwen3Cuda").largest_gradient_range(slab.layout(), c.hidden_size);
  }
};

Qwen3Cuda::Qwen3Cuda(const Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context,
                     std::int64_t max_tokens, Recompute recompute, optim::WeightSource* source)
    : impl_(std::make_unique<Impl>(config, slab, context, max_tokens, recompute, source)) {
  Impl& m = *impl_;
  validate(config, "qwen3 model");
  check_cuda_slab(slab, context, "Qwen3Cuda");
  if (max_tokens <= 0) throw core::Error("Qwen3Cuda: max_tokens must be > 0");
  if (config.head_dim != 64 && config.head_dim != 128) {
    throw core::InputError("Qwen3Cuda: head_dim " + std::to_string(config.head_dim) +
                           " not supported on cuda (64 or 128)");
  }
  const Qwen3TensorIndex index(config, slab.layout(), "Qwen3Cuda");
  m.embed = index.embed;
  m.final_norm = index.final_norm;
  m.head = index.head;
  m.layers = index.layers;
  for (std::size_t l = 0; l < m.layers.size(); ++l) {
    m.groups.push_back({index.mlp_range(slab.layout(), l), index.attention_range(slab.layout(), l)});
    m.layer_ranges.push_back(index.layer_range(slab.layout(), l));
  }
  m.embed_range = index.embed_range(slab.layout());
  m.tail_range = index.tail_range(slab.layout());

  m.ends = std::make_unique<LmEndsCuda>(
      context, slab,
      LmEndsSpec{m.embed, m.final_norm, m.head, config.vocab_size, config.hidden_size, config.rms_norm_eps},
      max_tokens);
  m.ends->set_weight_holds(&m.holds);
  m.memory = core::Buffer(context.device(), m.total);
  m.memory.fill_bytes(0, context.stream());
  activation_bytes_ = m.total + m.ends->bytes();
}

std::size_t Qwen3Cuda::planned_activation_bytes(const Qwen3Config& config, std::int64_t max_tokens,
                                                Recompute recompute) {
  return ActivationLayout(config, max_tokens, recompute).total +
         LmEndsCuda::memory_bytes(max_tokens, config.vocab_size, config.hidden_size);
}

Qwen3Cuda::~Qwen3Cuda() = default;

void Qwen3Cuda::forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                                 std::int64_t seq, float grad_scale) {
  impl_->forward(ids, batch, seq);
  impl_->backward(ids, targets, batch, seq, grad_scale);
}

void Qwen3Cuda::forward_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                             std::int64_t seq) {
  Impl& m = *impl_;
  m.forward(ids, batch, seq);
  const auto held = m.holds.hold(m.head_range());
  m.ends->loss(targets, batch * seq, m.ws());
}

void Qwen3Cuda::logits(const std::int32_t* ids, std::int64_t batch, std::int64_t seq, std::uint16_t* logits) {
  Impl& m = *impl_;
  m.forward(ids, batch, seq);
  const auto held = m.holds.hold(m.head_range());
  m.linear.forward(m.ends->x_norm(), m.w(m.head), batch * seq, m.c.hidden_size, m.c.vocab_size,
                   reinterpret_cast<bf16*>(logits), m.ws());
}

void Qwen3Cuda::set_gradient_sink(optim::GradientSink* sink) {
  Impl& m = *impl_;
  m.sink = checked_sink(sink, &m.slab_sink, m.largest_group(), "Qwen3Cuda");
}

std::int64_t Qwen3Cuda::largest_gradient_range() const { return impl_->largest_group(); }

void Qwen3Cuda::set_phase_timer(core::PhaseTimer* timer) { impl_->timer = timer; }

const float* Qwen3Cuda::loss() const { return impl_->ends->loss_value(); }
const float* Qwen3Cuda::token_losses() const { return impl_->ends->token_losses(); }
const std::int32_t* Qwen3Cuda::invalid_id_flag() const { return impl_->ends->invalid_id_flag(); }

}  // namespace models::qwen3
