#include "models/qwen3/decoder.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"
#include "models/ops/attention.h"
#include "models/ops/embedding.h"
#include "models/ops/linear.h"
#include "models/ops/matmul_cpu.h"
#include "models/ops/rmsnorm.h"
#include "models/ops/rope.h"
#include "models/ops/swiglu.h"

namespace models::qwen3 {

namespace {

using Vec = std::vector<float>;
std::span<const float> in(const Vec& v) { return {v.data(), v.size()}; }
std::span<float> out(Vec& v) { return {v.data(), v.size()}; }

// Copies columns [col, col + width) of a [rows, stride] matrix into a dense [rows, width] one.
void copy_columns(const float* src, std::int64_t src_stride, float* dst, std::int64_t rows, std::int64_t width) {
  for (std::int64_t r = 0; r < rows; ++r)
    std::copy(src + r * src_stride, src + r * src_stride + width, dst + r * width);
}

// Causal GQA attention of `queries` new positions [start, start + queries) against the cache
// rows [0, start + queries): the rows of attention_forward_cpu (ops::attention_row_cpu), with the
// query at position start + i seeing keys 0..start + i.
void cached_attention(const float* q, const float* k_cache, const float* v_cache, std::int64_t start,
                      std::int64_t queries, std::int64_t q_heads, std::int64_t kv_heads, std::int64_t dim, float* att) {
  const std::int64_t group = q_heads / kv_heads, kv_stride = kv_heads * dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  const std::int64_t rows = queries * q_heads;
#pragma omp parallel
  {
    std::vector<double> weights(static_cast<std::size_t>(start + queries));
    std::vector<double> acc(static_cast<std::size_t>(dim));
#pragma omp for schedule(dynamic, 4)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t i = r / q_heads, h = r % q_heads, kv_head = h / group;
      ops::attention_row_cpu(q + (i * q_heads + h) * dim, k_cache + kv_head * dim, v_cache + kv_head * dim, kv_stride,
                             start + i, dim, scale, weights.data(), acc.data(), att + (i * q_heads + h) * dim);
    }
  }
}

}  // namespace

Qwen3CpuDecoder::Qwen3CpuDecoder(const Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context,
                                 const DecoderOptions& options)
    : config_(config), slab_(slab), full_weights_(options.full_weights) {
  capacity_ = options.max_tokens;
  validate(config_, "qwen3 decoder");
  if (context.is_cuda() || slab.device().is_cuda()) throw core::Error("Qwen3CpuDecoder: needs a cpu slab and context");
  if (full_weights_ == nullptr && !(slab.owned() == slab.full())) {
    throw core::Error(
        "Qwen3CpuDecoder: the slab's master weights must cover the whole model, or full_weights be given");
  }
  check_decoder_capacity(capacity_);
  const Qwen3TensorIndex index(config_, slab.layout(), "Qwen3CpuDecoder");
  embed_ = index.embed;
  final_norm_ = index.final_norm;
  head_ = index.head;
  layers_ = index.layers;
  check_decoder_state_fits(2.0 * 4.0 * static_cast<double>(config_.num_layers) * static_cast<double>(capacity_) *
                               static_cast<double>(config_.kv_size()),
                           capacity_, core::Device::cpu());
  k_cache_.assign(static_cast<std::size_t>(config_.num_layers) * cache_layer_elements(), 0.0f);
  v_cache_.assign(k_cache_.size(), 0.0f);
  logits_.assign(static_cast<std::size_t>(config_.vocab_size), 0.0f);
}

std::span<const float> Qwen3CpuDecoder::weight(int tensor) const {
  const optim::SlabTensor& t = slab_.layout().tensors()[static_cast<std::size_t>(tensor)];
  if (full_weights_ != nullptr) return {full_weights_ + t.offset, static_cast<std::size_t>(t.numel)};
  const float* master = static_cast<const float*>(slab_.master().data()) + (t.offset - slab_.owned().begin);
  return {master, static_cast<std::size_t>(t.numel)};
}

void Qwen3CpuDecoder::prefill(std::span<const std::int32_t> tokens, float* all_logits) {
  const Qwen3Config& c = config_;
  const auto n = static_cast<std::int64_t>(tokens.size());
  if (n == 0) throw core::InputError("decoder: prefill needs at least one token");
  check_decoder_prompt(tokens, position_, capacity_, c.vocab_size);
  const std::int64_t start = position_, d = c.hidden_size, qs = c.q_size(), kvs = c.kv_size(), f = c.intermediate_size;
  std::vector<std::int32_t> positions(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) positions[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(start + i);

  Vec x(static_cast<std::size_t>(n * d)), h(x.size()), rstd(static_cast<std::size_t>(n * c.num_heads));
  Vec qkv(static_cast<std::size_t>(n * c.qkv_size())), q(static_cast<std::size_t>(n * qs)),
      k(static_cast<std::size_t>(n * kvs));
  Vec qn(q.size()), kn(k.size()), att(q.size()), lse(static_cast<std::size_t>(c.num_heads * n)), o(x.size());
  Vec gate_up(static_cast<std::size_t>(n * 2 * f)), act(static_cast<std::size_t>(n * f));
  ops::embedding_forward_cpu<float>(tokens, weight(embed_), c.vocab_size, d, out(x));
  const std::span<float> row_rstd(rstd.data(), static_cast<std::size_t>(n));
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const LayerWeights& w = layers_[l];
    ops::rmsnorm_forward_cpu<float>(in(x), weight(w.input_norm), n, d, c.rms_norm_eps, out(h), row_rstd);
    ops::linear_forward_cpu<float>(in(h), weight(w.qkv), n, d, c.qkv_size(), out(qkv));
    copy_columns(qkv.data(), c.qkv_size(), q.data(), n, qs);
    copy_columns(qkv.data() + qs, c.qkv_size(), k.data(), n, kvs);
    ops::head_rmsnorm_forward_cpu<float>(in(q), weight(w.q_norm), n, c.num_heads, c.head_dim, c.rms_norm_eps, out(qn),
                                         out(rstd));
    ops::head_rmsnorm_forward_cpu<float>(in(k), weight(w.k_norm), n, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                                         out(kn), {rstd.data(), static_cast<std::size_t>(n * c.num_kv_heads)});
    // Rotated q in place of the raw one; rotated keys and the values straight into the cache.
    float* k_rows = layer_k(l) + start * kvs;
    float* v_rows = layer_v(l) + start * kvs;
    ops::rope_forward_cpu<float>(in(qn), positions, c.num_heads, c.head_dim, c.rope_theta, out(q));
    ops::rope_forward_cpu<float>(in(kn), positions, c.num_kv_heads, c.head_dim, c.rope_theta,
                                 {k_rows, static_cast<std::size_t>(n * kvs)});
    copy_columns(qkv.data() + qs + kvs, c.qkv_size(), v_rows, n, kvs);
    if (start == 0) {
      const ops::AttentionShape shape{1, n, c.num_heads, c.num_kv_heads, c.head_dim};
      const std::span<const float> keys(layer_k(l), static_cast<std::size_t>(n * kvs));
      const std::span<const float> values(layer_v(l), static_cast<std::size_t>(n * kvs));
      ops::attention_forward_cpu<float>(shape, in(q), keys, values, out(att), out(lse));
    } else {
      cached_attention(q.data(), layer_k(l), layer_v(l), start, n, c.num_heads, c.num_kv_heads, c.head_dim, att.data());
    }
    ops::linear_forward_cpu<float>(in(att), weight(w.o_proj), n, qs, d, out(o));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    ops::rmsnorm_forward_cpu<float>(in(x), weight(w.post_norm), n, d, c.rms_norm_eps, out(h), row_rstd);
    ops::linear_forward_cpu<float>(in(h), weight(w.gate_up), n, d, 2 * f, out(gate_up));
    ops::swiglu_forward_cpu<float>(in(gate_up), n, f, out(act));
    ops::linear_forward_cpu<float>(in(act), weight(w.down), n, f, d, out(o));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];
  }
  // The final norm and the head for every row when all logits are asked for, else the last row.
  const std::int64_t first = all_logits != nullptr ? 0 : n - 1, rows = n - first;
  const std::span<const float> last_x(x.data() + first * d, static_cast<std::size_t>(rows * d));
  const std::span<float> normed(h.data(), static_cast<std::size_t>(rows * d));
  ops::rmsnorm_forward_cpu<float>(last_x, weight(final_norm_), rows, d, c.rms_norm_eps, normed,
                                  {rstd.data(), static_cast<std::size_t>(rows)});
  const auto vocab = static_cast<std::size_t>(c.vocab_size);
  if (all_logits != nullptr) {
    ops::linear_forward_cpu<float>(normed, weight(head_), rows, d, c.vocab_size,
                                   {all_logits, static_cast<std::size_t>(rows) * vocab});
    std::copy(all_logits + (rows - 1) * c.vocab_size, all_logits + rows * c.vocab_size, logits_.begin());
  } else {
    ops::linear_forward_cpu<float>(normed, weight(head_), 1, d, c.vocab_size, out(logits_));
  }
  position_ += n;
}

void Qwen3CpuDecoder::step(std::int32_t token, const std::int32_t* device_token) {
  if (device_token != nullptr) token = *device_token;  // host memory on the cpu backend
  prefill(std::span<const std::int32_t>(&token, 1), nullptr);
}

}  // namespace models::qwen3
