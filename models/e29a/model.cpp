// The E29a language model on the cpu (model.h): embedding, layers x = x + E29a(RMSNorm(x)) (or
// its normed sum, residual.h) through the layer reference, final RMSNorm and the chunked
// cross-entropy; the decoder runs the same layers over the appended tokens from the state the
// previous call left.
#include "models/e29a/model.h"

#include <algorithm>
#include <optional>
#include <string>

#include "core/error.h"
#include "models/e29a/residual.h"
#include "models/ops/embedding.h"
#include "models/ops/linear.h"
#include "models/ops/rmsnorm.h"

namespace models::e29a {

namespace {

using Vec = std::vector<float>;
std::span<const float> in(const Vec& v) { return {v.data(), v.size()}; }
std::span<float> out(Vec& v) { return {v.data(), v.size()}; }

}  // namespace

TensorIndex::TensorIndex(const E29aConfig& config, const optim::SlabLayout& layout) {
  auto find = [&](const std::string& name) {
    const int i = layout.find(name);
    if (i < 0) throw core::Error("e29a: the slab has no tensor '" + name + "' (not laid out from parameter_specs)");
    return i;
  };
  embed = find("embed_tokens");
  final_norm = find("final_norm");
  head = config.tie_word_embeddings ? embed : find("lm_head");
  for (std::int64_t l = 0; l < config.num_layers; ++l) {
    const std::string p = layer_prefix(l);
    layers.push_back(
        {find(p + "norm"), find(p + "w_xz"), find(p + "w_h"), find(p + "b_h"), find(p + "w_write"), find(p + "tape0")});
  }
}

optim::Range TensorIndex::embed_range(const optim::SlabLayout& layout) const {
  return tensor_span(layout, embed, embed);
}

optim::Range TensorIndex::layer_range(const optim::SlabLayout& layout, std::size_t layer) const {
  return tensor_span(layout, layers[layer].norm, layers[layer].tape0);
}

optim::Range TensorIndex::tail_range(const optim::SlabLayout& layout) const {
  return tail_span(layout, final_norm, head, embed);
}

struct E29aCpu::LayerSaved {
  Vec x_in, normed, rstd;
  LayerActivations<float> acts;
  ResidualSaved residual;
};

E29aCpu::E29aCpu(const E29aConfig& config, optim::Slab& slab, const float* full_weights, optim::WeightSource* source)
    : config_(config),
      slab_(slab),
      weights_(slab, full_weights, source, "E29aCpu"),
      index_(config, slab.layout()),
      embed_range_(index_.embed_range(slab.layout())),
      tail_range_(index_.tail_range(slab.layout())) {
  for (std::size_t l = 0; l < index_.layers.size(); ++l) layer_ranges_.push_back(index_.layer_range(slab.layout(), l));
}

std::span<const float> E29aCpu::weight(int tensor) const { return weights_.of(tensor); }

std::span<float> E29aCpu::grad(int tensor) {
  const auto v = slab_.grad_view(tensor);
  return {v.as<float>(), static_cast<std::size_t>(v.numel())};
}

LayerWeights<float> E29aCpu::layer_weights(const LayerTensors& t) const {
  return {weight(t.w_xz), weight(t.w_h), weight(t.b_h), weight(t.w_write), weight(t.tape0)};
}

void E29aCpu::forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                               std::int64_t seq, float grad_scale) {
  loss_ = static_cast<float>(run(ids, targets, batch, seq, true, grad_scale).loss);
}

void E29aCpu::forward_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq) {
  loss_ = static_cast<float>(run(ids, targets, batch, seq, false, 0.0).loss);
}

ops::CrossEntropyResult E29aCpu::run(const std::int32_t* ids_ptr, const std::int32_t* targets_ptr, std::int64_t batch,
                                     std::int64_t seq, bool backward, double grad_scale) {
  const E29aConfig& c = config_;
  const std::int64_t n = batch * seq, d = c.hidden_size;
  const std::span<const std::int32_t> ids(ids_ptr, static_cast<std::size_t>(n));
  const std::span<const std::int32_t> targets(targets_ptr, static_cast<std::size_t>(n));
  const LayerShape shape{batch, seq, d, c.n_slots};

  Vec x(static_cast<std::size_t>(n * d));
  {
    const auto held = weights_.hold(embed_range_, layer_ranges_.front());
    ops::embedding_forward_cpu<float>(ids, weight(index_.embed), c.vocab_size, d, out(x));
  }
  std::vector<LayerSaved> saved(index_.layers.size());
  Vec y(x.size());
  for (std::size_t l = 0; l < index_.layers.size(); ++l) {
    const auto held =
        weights_.hold(layer_ranges_[l], l + 1 < layer_ranges_.size() ? layer_ranges_[l + 1] : tail_range_);
    const LayerTensors& t = index_.layers[l];
    LayerSaved& s = saved[l];
    s.x_in = x;
    s.normed.resize(x.size());
    s.rstd.resize(static_cast<std::size_t>(n));
    ops::rmsnorm_forward_cpu<float>(in(s.x_in), weight(t.norm), n, d, c.rms_norm_eps, out(s.normed), out(s.rstd));
    layer_forward_cpu<float>(shape, layer_weights(t), in(s.normed), out(y), backward ? &s.acts : nullptr);
    residual_forward_cpu(c.residual, in(y), n, d, c.rms_norm_eps, out(x), backward ? &s.residual : nullptr);
    if (!backward) s = LayerSaved{};
  }
  Vec final_out(x.size()), final_rstd(static_cast<std::size_t>(n));
  // The tail holds the final norm and an untied head; a tied head is the embedding.
  const bool tied = index_.head == index_.embed;
  std::optional<WeightHolds::Hold> tail(std::in_place, weights_.holds(), tail_range_);
  std::optional<WeightHolds::Hold> head(std::in_place, weights_.holds(), tied ? embed_range_ : optim::Range{},
                                        backward ? layer_ranges_.back() : optim::Range{});
  ops::rmsnorm_forward_cpu<float>(in(x), weight(index_.final_norm), n, d, c.rms_norm_eps, out(final_out),
                                  out(final_rstd));
  if (!backward) {
    token_losses_.resize(static_cast<std::size_t>(n));
    return ops::cross_entropy_forward_cpu<float>(in(final_out), weight(index_.head), targets, d, c.vocab_size, 0,
                                                 out(token_losses_));
  }

  Vec dfinal(final_out.size());
  const ops::CrossEntropyResult result = ops::cross_entropy_backward_cpu<float>(
      in(final_out), weight(index_.head), targets, d, c.vocab_size, out(dfinal), grad(index_.head), grad_scale);
  Vec dx(x.size()), du(x.size()), dtmp(x.size());
  if (traces_ != nullptr) traces_->resize(index_.layers.size());
  ops::rmsnorm_backward_cpu<float>(in(dfinal), in(x), weight(index_.final_norm), in(final_rstd), n, d, out(dx),
                                   grad(index_.final_norm));
  head.reset();
  tail.reset();
  for (std::size_t l = index_.layers.size(); l-- > 0;) {
    const auto held = weights_.hold(layer_ranges_[l], l > 0 ? layer_ranges_[l - 1] : optim::Range{});
    const LayerTensors& t = index_.layers[l];
    const LayerSaved& s = saved[l];
    residual_backward_cpu(c.residual, s.residual, n, d, out(dx));  // dx: dL/dx_{l+1} to dL/d(x_l + y_l)
    layer_backward_cpu<float>(layer_weights(t), s.acts, in(s.normed), in(dx), out(du),
                              {grad(t.w_xz), grad(t.w_h), grad(t.b_h), grad(t.w_write), grad(t.tape0)},
                              traces_ != nullptr ? &(*traces_)[l] : nullptr, c.backward);
    ops::rmsnorm_backward_cpu<float>(in(du), in(s.x_in), weight(t.norm), in(s.rstd), n, d, out(dtmp), grad(t.norm));
    for (std::size_t i = 0; i < dx.size(); ++i) dx[i] += dtmp[i];
  }
  ops::embedding_backward_cpu<float>(ids, in(dx), c.vocab_size, d, grad(index_.embed));
  return result;
}

// ---- decoder ----

E29aCpuDecoder::E29aCpuDecoder(const E29aConfig& config, optim::Slab& slab, const core::DeviceContext& context,
                               const DecoderOptions& options)
    : config_(config),
      slab_(slab),
      weights_(slab, options.full_weights, nullptr, "E29aCpuDecoder"),
      index_(config, slab.layout()) {
  capacity_ = options.max_tokens;
  if (context.is_cuda()) throw core::Error("E29aCpuDecoder: needs a cpu context");
  check_decoder_capacity(capacity_);
  state_.resize(index_.layers.size());
  logits_.assign(static_cast<std::size_t>(config.vocab_size), 0.0f);
}

std::span<const float> E29aCpuDecoder::weight(int tensor) const { return weights_.of(tensor); }

void E29aCpuDecoder::prefill(std::span<const std::int32_t> tokens, float* all_logits) {
  const E29aConfig& c = config_;
  const auto count = static_cast<std::int64_t>(tokens.size());
  if (count == 0) return;
  check_decoder_prompt(tokens, position_, capacity_, c.vocab_size);
  const std::int64_t d = c.hidden_size;
  const LayerShape shape{1, count, d, c.n_slots};
  Vec x(static_cast<std::size_t>(count * d)), normed(x.size()), rstd(static_cast<std::size_t>(count)), y(x.size());
  ops::embedding_forward_cpu<float>(tokens, weight(index_.embed), c.vocab_size, d, out(x));
  for (std::size_t l = 0; l < index_.layers.size(); ++l) {
    const LayerTensors& t = index_.layers[l];
    ops::rmsnorm_forward_cpu<float>(in(x), weight(t.norm), count, d, c.rms_norm_eps, out(normed), out(rstd));
    const LayerWeights<float> w{weight(t.w_xz), weight(t.w_h), weight(t.b_h), weight(t.w_write), weight(t.tape0)};
    LayerState<float> next;
    layer_forward_cpu<float>(shape, w, in(normed), out(y), nullptr, position_ > 0 ? &state_[l] : nullptr, &next);
    state_[l] = std::move(next);
    residual_forward_cpu(c.residual, in(y), count, d, c.rms_norm_eps, out(x), nullptr);
  }
  ops::rmsnorm_forward_cpu<float>(in(x), weight(index_.final_norm), count, d, c.rms_norm_eps, out(normed), out(rstd));
  const std::span<const float> last(normed.data() + (count - 1) * d, static_cast<std::size_t>(d));
  ops::linear_forward_cpu<float>(last, weight(index_.head), 1, d, c.vocab_size, out(logits_));
  if (all_logits != nullptr) {
    ops::linear_forward_cpu<float>(in(normed), weight(index_.head), count, d, c.vocab_size,
                                   {all_logits, static_cast<std::size_t>(count * c.vocab_size)});
  }
  position_ += count;
}

void E29aCpuDecoder::step(std::int32_t token, const std::int32_t* /*device_token*/) {
  prefill(std::span<const std::int32_t>(&token, 1));
}

}  // namespace models::e29a
