#include "models/qwen3/model.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/error.h"
#include "core/rng.h"
#include "models/ops/attention.h"
#include "models/ops/embedding.h"
#include "models/ops/linear.h"
#include "models/ops/rmsnorm.h"
#include "models/ops/rope.h"
#include "models/ops/swiglu.h"

namespace models::qwen3 {

namespace {

using Vec = std::vector<float>;
std::span<const float> in(const Vec& v) { return {v.data(), v.size()}; }
std::span<float> out(Vec& v) { return {v.data(), v.size()}; }

// Copies columns [col, col + width) of a [rows, stride] matrix into a [rows, width] one, or back.
void copy_columns(const float* src, std::int64_t src_stride, float* dst, std::int64_t dst_stride, std::int64_t rows,
                  std::int64_t width) {
  for (std::int64_t r = 0; r < rows; ++r)
    std::copy(src + r * src_stride, src + r * src_stride + width, dst + r * dst_stride);
}

}  // namespace

struct Qwen3Model::LayerActivations {
  Vec x_in, rstd_in, h, q, k, v, rstd_q, rstd_k, q_rot, k_rot, att, lse, x_mid, rstd_post, h2, gate_up, act;
};

Qwen3Model::Qwen3Model(const Qwen3Config& config, optim::Slab& slab, float* full_weights, optim::WeightSource* source)
    : config_(config), slab_(slab), weights_(slab, full_weights, source, "Qwen3Model") {
  validate(config_, "qwen3 model");
  const Qwen3TensorIndex index(config_, slab.layout(), "Qwen3Model");
  embed_ = index.embed;
  final_norm_ = index.final_norm;
  head_ = index.head;
  layers_ = index.layers;
  embed_range_ = index.embed_range(slab.layout());
  tail_range_ = index.tail_range(slab.layout());
  for (std::size_t l = 0; l < layers_.size(); ++l) layer_ranges_.push_back(index.layer_range(slab.layout(), l));
}

std::span<float> Qwen3Model::weight(int tensor) { return weights_.of(tensor); }

std::span<float> Qwen3Model::grad(int tensor) {
  const auto v = slab_.grad_view(tensor);
  return {v.as<float>(), static_cast<std::size_t>(v.numel())};
}

void Qwen3Model::initialize(std::uint64_t seed) {
  const auto& tensors = slab_.layout().tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const auto& spec = tensors[t].spec;
    auto w = weight(static_cast<int>(t));
    const std::uint64_t tensor_seed = core::splitmix64(seed ^ core::splitmix64(t + 1));
    for (std::size_t i = 0; i < w.size(); ++i) {
      switch (spec.init) {
        case optim::InitKind::normal: w[i] = spec.init_std * core::normal01(tensor_seed, i); break;
        case optim::InitKind::zeros: w[i] = 0.0f; break;
        case optim::InitKind::ones: w[i] = 1.0f; break;
        default: throw core::Error("Qwen3Model::initialize: unsupported init kind of " + spec.name);
      }
    }
  }
}

void Qwen3Model::forward(std::span<const std::int32_t> ids, std::int64_t batch, std::int64_t seq,
                         std::vector<LayerActivations>& saved, Vec& final_in, Vec& final_out, Vec& final_rstd) {
  const Qwen3Config& c = config_;
  const std::int64_t n = batch * seq, d = c.hidden_size, qs = c.q_size(), kvs = c.kv_size(), f = c.intermediate_size;
  if (static_cast<std::int64_t>(ids.size()) != n) throw core::Error("Qwen3Model: ids must hold batch * seq tokens");
  std::vector<std::int32_t> positions(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) positions[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i % seq);
  const ops::AttentionShape shape{batch, seq, c.num_heads, c.num_kv_heads, c.head_dim};

  Vec x(static_cast<std::size_t>(n * d));
  {
    const auto held = weights_.hold(embed_range_, layer_ranges_.front());
    ops::embedding_forward_cpu<float>(ids, weight(embed_), c.vocab_size, d, out(x));
  }
  saved.resize(layers_.size());
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const auto held = weights_.hold(layer_ranges_[l], l + 1 < layers_.size() ? layer_ranges_[l + 1] : tail_range_);
    const LayerWeights& w = layers_[l];
    LayerActivations& a = saved[l];
    a.x_in = x;
    a.rstd_in.resize(static_cast<std::size_t>(n));
    a.h.resize(x.size());
    ops::rmsnorm_forward_cpu<float>(in(a.x_in), weight(w.input_norm), n, d, c.rms_norm_eps, out(a.h), out(a.rstd_in));
    Vec qkv(static_cast<std::size_t>(n * c.qkv_size()));
    ops::linear_forward_cpu<float>(in(a.h), weight(w.qkv), n, d, c.qkv_size(), out(qkv));
    Vec q_raw(static_cast<std::size_t>(n * qs)), k_raw(static_cast<std::size_t>(n * kvs));
    a.v.resize(static_cast<std::size_t>(n * kvs));
    copy_columns(qkv.data(), c.qkv_size(), q_raw.data(), qs, n, qs);
    copy_columns(qkv.data() + qs, c.qkv_size(), k_raw.data(), kvs, n, kvs);
    copy_columns(qkv.data() + qs + kvs, c.qkv_size(), a.v.data(), kvs, n, kvs);
    a.q = std::move(q_raw);
    a.k = std::move(k_raw);
    Vec qn(a.q.size()), kn(a.k.size());
    a.rstd_q.resize(static_cast<std::size_t>(n * c.num_heads));
    a.rstd_k.resize(static_cast<std::size_t>(n * c.num_kv_heads));
    ops::head_rmsnorm_forward_cpu<float>(in(a.q), weight(w.q_norm), n, c.num_heads, c.head_dim, c.rms_norm_eps, out(qn),
                                         out(a.rstd_q));
    ops::head_rmsnorm_forward_cpu<float>(in(a.k), weight(w.k_norm), n, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                                         out(kn), out(a.rstd_k));
    a.q_rot.resize(qn.size());
    a.k_rot.resize(kn.size());
    ops::rope_forward_cpu<float>(in(qn), positions, c.num_heads, c.head_dim, c.rope_theta, out(a.q_rot));
    ops::rope_forward_cpu<float>(in(kn), positions, c.num_kv_heads, c.head_dim, c.rope_theta, out(a.k_rot));
    a.att.resize(static_cast<std::size_t>(n * qs));
    a.lse.resize(static_cast<std::size_t>(batch * c.num_heads * seq));
    ops::attention_forward_cpu<float>(shape, in(a.q_rot), in(a.k_rot), in(a.v), out(a.att), out(a.lse));
    Vec o(x.size());
    ops::linear_forward_cpu<float>(in(a.att), weight(w.o_proj), n, qs, d, out(o));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    a.x_mid = x;
    a.rstd_post.resize(static_cast<std::size_t>(n));
    a.h2.resize(x.size());
    ops::rmsnorm_forward_cpu<float>(in(a.x_mid), weight(w.post_norm), n, d, c.rms_norm_eps, out(a.h2),
                                    out(a.rstd_post));
    a.gate_up.resize(static_cast<std::size_t>(n * 2 * f));
    ops::linear_forward_cpu<float>(in(a.h2), weight(w.gate_up), n, d, 2 * f, out(a.gate_up));
    a.act.resize(static_cast<std::size_t>(n * f));
    ops::swiglu_forward_cpu<float>(in(a.gate_up), n, f, out(a.act));
    Vec down(x.size());
    ops::linear_forward_cpu<float>(in(a.act), weight(w.down), n, f, d, out(down));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += down[i];
  }
  final_in = std::move(x);
  const auto held = weights_.hold(tail_range_);
  final_out.resize(final_in.size());
  final_rstd.resize(static_cast<std::size_t>(n));
  ops::rmsnorm_forward_cpu<float>(in(final_in), weight(final_norm_), n, d, c.rms_norm_eps, out(final_out),
                                  out(final_rstd));
}

ops::CrossEntropyResult Qwen3Model::step(std::span<const std::int32_t> ids, std::span<const std::int32_t> targets,
                                         std::int64_t batch, std::int64_t seq, bool backward, double grad_scale,
                                         std::span<float> token_losses) {
  const Qwen3Config& c = config_;
  const std::int64_t n = batch * seq, d = c.hidden_size, qs = c.q_size(), kvs = c.kv_size(), f = c.intermediate_size;
  if (static_cast<std::int64_t>(targets.size()) != n)
    throw core::Error("Qwen3Model: targets must hold batch * seq tokens");
  std::vector<LayerActivations> saved;
  Vec final_in, final_out, final_rstd;
  forward(ids, batch, seq, saved, final_in, final_out, final_rstd);
  if (!backward) {
    const auto head = weights_.hold(head_range());
    return ops::cross_entropy_forward_cpu<float>(in(final_out), weight(head_), targets, d, c.vocab_size, 0,
                                                 token_losses);
  }

  Vec dfinal(final_out.size());
  Vec dx(final_in.size());
  ops::CrossEntropyResult result;
  {
    // The tail holds the final norm and an untied head; a tied head is the embedding.
    const auto tail = weights_.hold(tail_range_);
    const auto tied = weights_.hold(head_ == embed_ ? embed_range_ : optim::Range{}, layer_ranges_.back());
    result = ops::cross_entropy_backward_cpu<float>(in(final_out), weight(head_), targets, d, c.vocab_size, out(dfinal),
                                                    grad(head_), grad_scale);
    ops::rmsnorm_backward_cpu<float>(in(dfinal), in(final_in), weight(final_norm_), in(final_rstd), n, d, out(dx),
                                     grad(final_norm_));
  }

  std::vector<std::int32_t> positions(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) positions[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i % seq);
  const ops::AttentionShape shape{batch, seq, c.num_heads, c.num_kv_heads, c.head_dim};
  Vec tmp(dx.size());
  for (std::size_t l = layers_.size(); l-- > 0;) {
    const auto held = weights_.hold(layer_ranges_[l], l > 0 ? layer_ranges_[l - 1] : optim::Range{});
    const LayerWeights& w = layers_[l];
    const LayerActivations& a = saved[l];
    // MLP branch: x_out = x_mid + down(swiglu(gate_up(norm(x_mid)))).
    Vec dact(a.act.size()), dgate_up(a.gate_up.size()), dh2(a.h2.size());
    ops::linear_backward_cpu<float>(in(dx), in(a.act), weight(w.down), n, f, d, out(dact), grad(w.down));
    ops::swiglu_backward_cpu<float>(in(dact), in(a.gate_up), n, f, out(dgate_up));
    ops::linear_backward_cpu<float>(in(dgate_up), in(a.h2), weight(w.gate_up), n, d, 2 * f, out(dh2), grad(w.gate_up));
    ops::rmsnorm_backward_cpu<float>(in(dh2), in(a.x_mid), weight(w.post_norm), in(a.rstd_post), n, d, out(tmp),
                                     grad(w.post_norm));
    for (std::size_t i = 0; i < dx.size(); ++i) dx[i] += tmp[i];
    // Attention branch: x_mid = x_in + o_proj(attention(rope(norm(q)), rope(norm(k)), v)).
    Vec datt(a.att.size());
    ops::linear_backward_cpu<float>(in(dx), in(a.att), weight(w.o_proj), n, qs, d, out(datt), grad(w.o_proj));
    Vec dq_rot(a.q_rot.size()), dk_rot(a.k_rot.size()), dv(a.v.size());
    ops::attention_backward_cpu<float>(shape, in(a.q_rot), in(a.k_rot), in(a.v), in(a.att), in(a.lse), in(datt),
                                       out(dq_rot), out(dk_rot), out(dv));
    Vec dqn(dq_rot.size()), dkn(dk_rot.size());
    ops::rope_backward_cpu<float>(in(dq_rot), positions, c.num_heads, c.head_dim, c.rope_theta, out(dqn));
    ops::rope_backward_cpu<float>(in(dk_rot), positions, c.num_kv_heads, c.head_dim, c.rope_theta, out(dkn));
    Vec dq(a.q.size()), dk(a.k.size());
    ops::head_rmsnorm_backward_cpu<float>(in(dqn), in(a.q), weight(w.q_norm), in(a.rstd_q), n, c.num_heads, c.head_dim,
                                          out(dq), grad(w.q_norm));
    ops::head_rmsnorm_backward_cpu<float>(in(dkn), in(a.k), weight(w.k_norm), in(a.rstd_k), n, c.num_kv_heads,
                                          c.head_dim, out(dk), grad(w.k_norm));
    Vec dqkv(static_cast<std::size_t>(n * c.qkv_size()));
    copy_columns(dq.data(), qs, dqkv.data(), c.qkv_size(), n, qs);
    copy_columns(dk.data(), kvs, dqkv.data() + qs, c.qkv_size(), n, kvs);
    copy_columns(dv.data(), kvs, dqkv.data() + qs + kvs, c.qkv_size(), n, kvs);
    Vec dh(a.h.size());
    ops::linear_backward_cpu<float>(in(dqkv), in(a.h), weight(w.qkv), n, d, c.qkv_size(), out(dh), grad(w.qkv));
    ops::rmsnorm_backward_cpu<float>(in(dh), in(a.x_in), weight(w.input_norm), in(a.rstd_in), n, d, out(tmp),
                                     grad(w.input_norm));
    for (std::size_t i = 0; i < dx.size(); ++i) dx[i] += tmp[i];
  }
  ops::embedding_backward_cpu<float>(ids, in(dx), c.vocab_size, d, grad(embed_));
  return result;
}

void Qwen3Model::logits(std::span<const std::int32_t> ids, std::int64_t batch, std::int64_t seq,
                        std::span<float> result) {
  std::vector<LayerActivations> saved;
  Vec final_in, final_out, final_rstd;
  forward(ids, batch, seq, saved, final_in, final_out, final_rstd);
  const auto head = weights_.hold(head_range());
  ops::linear_forward_cpu<float>(in(final_out), weight(head_), batch * seq, config_.hidden_size, config_.vocab_size,
                                 result);
}

}  // namespace models::qwen3
