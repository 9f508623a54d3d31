#include "models/qwen3/prefill_cuda.h"

#include <algorithm>

#include "core/error.h"
#include "models/lm_ends_cuda.h"
#include "models/ops/attention.h"
#include "models/ops/embedding.h"
#include "models/ops/rmsnorm.h"
#include "models/ops/rope.h"
#include "models/ops/swiglu.h"
#include "models/qwen3/model_kernels.h"

namespace models::qwen3 {

using decode::bf16;

Qwen3CudaPrefill::Qwen3CudaPrefill(const Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context,
                                   std::int64_t max_chunk, int splits, const void* whole_mirror)
    : c_(config),
      slab_(slab),
      whole_mirror_(whole_mirror),
      ctx_(context),
      stream_(context.stream()),
      chunk_(max_chunk),
      splits_(std::max(1, splits)),
      linear_(context),
      index_(config, slab.layout(), "Qwen3CudaPrefill") {
  if (max_chunk <= 0) throw core::Error("Qwen3CudaPrefill: max_chunk must be positive");
  matvec_blocks_ = 8 * std::max(1, context.multiprocessor_count());
  DeviceArena a;
  const auto n = static_cast<std::size_t>(chunk_), d = static_cast<std::size_t>(config.hidden_size);
  const auto f = static_cast<std::size_t>(config.intermediate_size), qs = static_cast<std::size_t>(config.q_size());
  x_ = a.reserve(n * d * 2);
  h_ = a.reserve(n * d * 2);
  qkv_ = a.reserve(n * static_cast<std::size_t>(config.qkv_size()) * 2);
  q_ = a.reserve(n * qs * 2);
  k_ = a.reserve(n * static_cast<std::size_t>(config.kv_size()) * 2);
  att_ = a.reserve(n * qs * 2);
  lse_ = a.reserve(n * static_cast<std::size_t>(config.num_heads) * 4);
  rstd_ = a.reserve(n * static_cast<std::size_t>(config.num_heads) * 4);
  tmp_ = a.reserve(n * d * 2);
  gate_up_ = a.reserve(n * 2 * f * 2);
  act_ = a.reserve(n * f * 2);
  ids_ = a.reserve(n * 4);
  positions_ = a.reserve(n * 4);
  const std::int64_t partial_floats =
      decode::attention_partial_floats(static_cast<int>(config.num_heads), static_cast<int>(config.head_dim),
                                       std::max<std::int64_t>(chunk_, splits_), 1);
  partial_ = a.reserve(static_cast<std::size_t>(partial_floats) * 4);
  start_ = a.reserve(4);
  invalid_ = a.reserve(4);
  workspace_bytes_ = ops::linear_workspace_bytes();
  workspace_ = a.reserve(workspace_bytes_);
  memory_ = core::Buffer(context.device(), a.size());
  memory_.fill_bytes(0, stream_);
}

const bf16* Qwen3CudaPrefill::w(int tensor) {
  return static_cast<const bf16*>(decoder_mirror_tensor(slab_, whole_mirror_, tensor));
}

// Tokens [start, start + n) already embedded in x: the layers, keys and values into the cache.
void Qwen3CudaPrefill::layers(std::int64_t start, std::int64_t n, const KvCacheView& cache) {
  const std::int64_t d = c_.hidden_size, qs = c_.q_size(), kvs = c_.kv_size(), qkv_size = c_.qkv_size();
  const std::int64_t f = c_.intermediate_size;
  const std::int32_t* pos = at<std::int32_t>(positions_);
  const ops::DeviceWorkspace ws{at<char>(workspace_), workspace_bytes_};
  // A cache with the rows of the chunk packed ([position, kv head, dim]) takes the keys and values
  // where they are made; any other layout gets them from a packed copy, stored in one pass.
  const bool packed = cache.at.position_stride == kvs && cache.at.head_stride == c_.head_dim;
  for (std::size_t l = 0; l < index_.layers.size(); ++l) {
    const Qwen3LayerTensors& lw = index_.layers[l];
    bf16* k_layer = cache.k + static_cast<std::int64_t>(l) * cache.layer_stride;
    bf16* v_layer = cache.v + static_cast<std::int64_t>(l) * cache.layer_stride;
    bf16* keys = packed ? k_layer + start * kvs : at<bf16>(k_);
    const bf16* values = packed ? v_layer + start * kvs : at<bf16>(qkv_) + qs + kvs;
    const std::int64_t values_stride = packed ? kvs : qkv_size;
    ops::rmsnorm_forward_cuda(at<bf16>(x_), w(lw.input_norm), n, d, c_.rms_norm_eps, at<bf16>(h_), at<float>(rstd_),
                              stream_);
    linear_.forward(at<bf16>(h_), w(lw.qkv), n, d, qkv_size, at<bf16>(qkv_), ws);
    ops::head_rmsnorm_forward_cuda(at<bf16>(qkv_), qkv_size, w(lw.q_norm), n, c_.num_heads, c_.head_dim,
                                   c_.rms_norm_eps, at<bf16>(q_), qs, at<float>(rstd_), stream_);
    ops::head_rmsnorm_forward_cuda(at<bf16>(qkv_) + qs, qkv_size, w(lw.k_norm), n, c_.num_kv_heads, c_.head_dim,
                                   c_.rms_norm_eps, keys, kvs, at<float>(rstd_), stream_);
    ops::rope_forward_cuda(at<bf16>(q_), qs, at<bf16>(q_), qs, pos, n, c_.num_heads, c_.head_dim, c_.rope_theta,
                           stream_);
    ops::rope_forward_cuda(keys, kvs, keys, kvs, pos, n, c_.num_kv_heads, c_.head_dim, c_.rope_theta, stream_);
    if (packed) {
      CUDA_CHECK(cudaMemcpy2DAsync(v_layer + start * kvs, static_cast<std::size_t>(kvs) * 2, at<bf16>(qkv_) + qs + kvs,
                                   static_cast<std::size_t>(qkv_size) * 2, static_cast<std::size_t>(kvs) * 2,
                                   static_cast<std::size_t>(n), cudaMemcpyDeviceToDevice, stream_));
    } else {
      decode::store_kv_rows(keys, kvs, values, values_stride, n, static_cast<int>(c_.num_kv_heads),
                            static_cast<int>(c_.head_dim), k_layer, v_layer, cache.at, start, stream_);
    }
    if (start == 0) {
      const ops::AttentionShape shape{1, n, c_.num_heads, c_.num_kv_heads, c_.head_dim};
      ops::attention_forward_cuda(shape, {reinterpret_cast<const std::uint16_t*>(at<bf16>(q_)), qs},
                                  {reinterpret_cast<const std::uint16_t*>(keys), kvs},
                                  {reinterpret_cast<const std::uint16_t*>(values), values_stride},
                                  at<std::uint16_t>(att_), at<float>(lse_), stream_);
    } else {
      // The device start says `start` here; fewer splits per query when many queries.
      const int s = std::max<int>(1, splits_ / static_cast<int>(std::min<std::int64_t>(n, splits_)));
      decode::cached_attention(at<bf16>(q_), qs, k_layer, v_layer, cache.at, static_cast<int>(c_.num_heads),
                               static_cast<int>(c_.num_kv_heads), static_cast<int>(c_.head_dim),
                               at<std::int32_t>(start_), n, s, at<float>(partial_), at<bf16>(att_), stream_);
    }
    linear_.forward(at<bf16>(att_), w(lw.o_proj), n, qs, d, at<bf16>(tmp_), ws);
    add_bf16(at<bf16>(x_), at<bf16>(tmp_), at<bf16>(x_), n * d, stream_);
    ops::rmsnorm_forward_cuda(at<bf16>(x_), w(lw.post_norm), n, d, c_.rms_norm_eps, at<bf16>(h_), at<float>(rstd_),
                              stream_);
    linear_.forward(at<bf16>(h_), w(lw.gate_up), n, d, 2 * f, at<bf16>(gate_up_), ws);
    ops::swiglu_forward_cuda(at<bf16>(gate_up_), n, f, at<bf16>(act_), stream_);
    linear_.forward(at<bf16>(act_), w(lw.down), n, f, d, at<bf16>(tmp_), ws);
    add_bf16(at<bf16>(x_), at<bf16>(tmp_), at<bf16>(x_), n * d, stream_);
  }
}

void Qwen3CudaPrefill::run(std::span<const std::int32_t> tokens, std::int64_t start, const KvCacheView& cache,
                           float* last_logits, float* all_logits) {
  const auto total = static_cast<std::int64_t>(tokens.size());
  const std::int64_t d = c_.hidden_size, vocab = c_.vocab_size;
  core::Buffer chunk_logits;  // bf16 lm_head rows for all_logits
  if (all_logits != nullptr) chunk_logits = core::Buffer(ctx_.device(), static_cast<std::size_t>(chunk_ * vocab) * 2);
  for (std::int64_t done = 0; done < total; done += chunk_) {
    const std::int64_t n = std::min(chunk_, total - done), first = start + done;
    core::copy_bytes(at<std::int32_t>(ids_), tokens.data() + done, static_cast<std::size_t>(n) * 4, stream_);
    decode::fill_positions(at<std::int32_t>(positions_), first, n, stream_);
    decode::set_int(at<std::int32_t>(start_), static_cast<std::int32_t>(first), stream_);
    ops::embedding_forward_cuda(at<std::int32_t>(ids_), n, w(index_.embed), vocab, d, at<bf16>(x_),
                                at<std::int32_t>(invalid_), stream_);
    layers(first, n, cache);
    if (all_logits != nullptr) {
      const ops::DeviceWorkspace ws{at<char>(workspace_), workspace_bytes_};
      ops::rmsnorm_forward_cuda(at<bf16>(x_), w(index_.final_norm), n, d, c_.rms_norm_eps, at<bf16>(h_),
                                at<float>(rstd_), stream_);
      linear_.forward(at<bf16>(h_), w(index_.head), n, d, vocab, chunk_logits.as<bf16>(), ws);
      decode::bf16_to_f32(chunk_logits.as<bf16>(), all_logits + done * vocab, n * vocab, stream_);
    }
    if (done + n == total) {
      decode::matvec({.weight = w(index_.head),
                      .rows = vocab,
                      .in = d,
                      .x = at<bf16>(x_) + (n - 1) * d,
                      .norm_weight = w(index_.final_norm),
                      .eps = static_cast<float>(c_.rms_norm_eps),
                      .out = last_logits},
                     decode::Epilogue::store_f32, matvec_blocks_, stream_);
    }
  }
  if (all_logits != nullptr) ctx_.synchronize();  // chunk_logits is freed on return
}

}  // namespace models::qwen3
