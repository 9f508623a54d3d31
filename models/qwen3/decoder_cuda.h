// The Qwen3 decoder on one GPU, batch 1: bf16 weights read from the slab's mirror, a bf16 KV
// cache per layer (keys after the q/k norm and RoPE) sized for DecoderOptions::max_tokens, fp32
// logits [vocab] on the device.
//
// prefill() runs the appended tokens through the batched ops of the training forward
// (Qwen3CudaPrefill, prefill_cuda.h), in chunks of at most max_prefill_chunk tokens, writing keys
// and values straight into the cache. step() is a few
// kernels per layer that read the position from device memory, so they are captured once into a
// CUDA graph and replayed:
//   (1) RMSNorm + qkv matrix-vector product (every block recomputes the norm of the 1-row input);
//   (2) per-head q/k RMSNorm + RoPE, k and v appended to the cache at the position;
//   (3) attention over the cache split into key ranges (flash-decoding), (4) their merge by
//       log-sum-exp;
//   (5) o_proj + residual; (6) RMSNorm + gate/up + SwiGLU; (7) down + residual;
// and after the last layer the final norm + lm_head into fp32 logits, which also advances the
// position. The token to embed is read by a kernel launched before the graph, from the host
// value or a device int32 (a sampler's output), so sampling never needs the host.
// Rounding follows the training forward: activations between ops are bf16 (the residual stream
// too), statistics and accumulation fp32, the logits fp32 (not rounded).
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "core/device.h"
#include "models/model.h"
#include "models/qwen3/config.h"
#include "optim/slab.h"

namespace models::qwen3 {

struct CudaDecoderSettings {
  bool cuda_graph = true;                 // replay step() as a captured graph (false: launch each kernel)
  std::int64_t max_prefill_chunk = 4096;  // tokens per prefill pass (bounds the activation memory)
  int attention_splits = 0;  // key ranges per (kv head, query) of a step's attention; 0: from the GPU's size
  int matvec_blocks = 0;     // grid bound of the step's matrix-vector products; 0: from the GPU's size
};

class Qwen3CudaDecoder final : public Decoder {
 public:
  // `slab`: laid out from parameter_specs(config), on the context's cuda device, bf16 mirror
  // spanning the whole model. head_dim 64 or 128 (core::InputError otherwise).
  Qwen3CudaDecoder(const Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context,
                   const DecoderOptions& options, CudaDecoderSettings settings = {});
  ~Qwen3CudaDecoder() override;

  void reset() override;
  // `all_logits`: device fp32 [tokens, vocab] (from bf16 lm_head products of the batched path).
  void prefill(std::span<const std::int32_t> tokens, float* all_logits = nullptr) override;
  void step(std::int32_t token, const std::int32_t* device_token = nullptr) override;
  const float* logits() const override;
  std::int64_t position() const override;
  std::int64_t capacity() const override;

  // Device memory held: the KV cache, and the rest (activations, workspaces, logits).
  std::size_t cache_bytes() const;
  std::size_t scratch_bytes() const;
  // Device int32 set to 1 when a device token was outside the vocabulary (it is clamped).
  const std::int32_t* invalid_id_flag() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The step's kernels (decoder_cuda.cu), asynchronous on `stream`; exposed for their tests.
namespace decode {

using bf16 = __nv_bfloat16;

enum class Epilogue {
  store_bf16,   // out[r] = bf16(y[r])
  add_bf16,     // out[r] = bf16(out[r] + bf16(y[r]))  (residual, in place)
  swiglu_bf16,  // weight rows [0, R) gate, [R, 2R) up: out[r] = bf16(silu(bf16 g) * bf16 u)
  store_f32,    // out[r] = y[r] in fp32
};

// y = W x for one token: W bf16 [rows, in] row-major (2 * rows for swiglu), x bf16 [in]. With
// `norm_weight`, x is first replaced by bf16(x * rstd * norm_weight) with rstd = 1/sqrt(mean(x^2)
// + eps), recomputed by every block. `advance` (may be null): incremented by one once the kernel
// ran (the step's position). `max_blocks`: the grid's bound (the rows are a grid-stride loop).
struct MatvecArgs {
  const bf16* weight = nullptr;
  std::int64_t rows = 0;
  std::int64_t in = 0;
  const bf16* x = nullptr;
  const bf16* norm_weight = nullptr;
  float eps = 0.0f;
  void* out = nullptr;
  std::int32_t* advance = nullptr;
};
void matvec(const MatvecArgs& args, Epilogue epilogue, int max_blocks, cudaStream_t stream);

// Per-head RMSNorm (weights [head_dim]) and RoPE at position *position of q and k from one packed
// qkv row [(heads + 2 kv_heads) * head_dim]; q goes to q_out [heads * head_dim], k and v to row
// *position of the caches [capacity, kv_heads * head_dim]. inv_freq: device double [head_dim / 2].
void qk_norm_rope_append(const bf16* qkv, const bf16* q_norm, const bf16* k_norm, int heads, int kv_heads, int head_dim,
                         float eps, const double* inv_freq, const std::int32_t* position, bf16* q_out, bf16* k_cache,
                         bf16* v_cache, cudaStream_t stream);

// Where one layer's cache keeps kv head h's row at position j: element i at
// j * position_stride + h * head_stride + i (both multiples of 8). The plain decoder's layout is
// packed(): [position, kv head, dim]; the megakernel's is [kv head, position, dim].
struct KvLayout {
  std::int64_t position_stride = 0;
  std::int64_t head_stride = 0;
  static KvLayout packed(int kv_heads, int head_dim) {
    return {static_cast<std::int64_t>(kv_heads) * head_dim, head_dim};
  }
};

// Causal attention of `queries` new positions start + i, start = *position, over cache rows
// [0, start + i] (the caches, laid out as `layout` says, already hold them): q [queries, heads *
// head_dim] with rows q_stride apart, att dense bf16 [queries, heads * head_dim]. Each (kv head,
// query) is split into at most `splits` key ranges of at least 32 keys, merged by log-sum-exp;
// `partial` holds attention_partial_floats(...) floats.
std::int64_t attention_partial_floats(int heads, int head_dim, std::int64_t queries, int splits);
// The splits of a step's attention by default: enough (kv head, key range) blocks to fill the GPU
// about four times over at long contexts.
int default_attention_splits(int multiprocessors, std::int64_t kv_heads);
void cached_attention(const bf16* q, std::int64_t q_stride, const bf16* k_cache, const bf16* v_cache, KvLayout layout,
                      int heads, int kv_heads, int head_dim, const std::int32_t* position, std::int64_t queries,
                      int splits, float* partial, bf16* att, cudaStream_t stream);

// Rows i < n of keys [n, kv_heads * head_dim] (rows k_stride apart) and values (v_stride) into
// positions start + i of one layer's caches laid out as `layout` says (16-byte aligned rows).
void store_kv_rows(const bf16* keys, std::int64_t k_stride, const bf16* values, std::int64_t v_stride, std::int64_t n,
                   int kv_heads, int head_dim, bf16* k_cache, bf16* v_cache, KvLayout layout, std::int64_t start,
                   cudaStream_t stream);

// x [dim] = table[token], token = *device_token when given, else `token`; ids outside
// [0, vocab) are clamped and raise *invalid_flag.
void embed_token(const std::int32_t* device_token, std::int32_t token, const bf16* table, std::int64_t vocab,
                 std::int64_t dim, bf16* x, std::int32_t* invalid_flag, cudaStream_t stream);

// values[i] = start + i for i < count; *target = value; fp32 out[i] = bf16 in[i].
void fill_positions(std::int32_t* values, std::int64_t start, std::int64_t count, cudaStream_t stream);
void set_int(std::int32_t* target, std::int32_t value, cudaStream_t stream);
void bf16_to_f32(const bf16* in, float* out, std::int64_t count, cudaStream_t stream);

}  // namespace decode

}  // namespace models::qwen3
