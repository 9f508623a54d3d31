// A Qwen3 prompt on one GPU through the batched ops of the training forward (cuBLASLt products,
// the flash attention kernel when the cache is empty, the decode attention over the cache
// otherwise), in chunks of at most `max_chunk` tokens. Keys (after the q/k norm and RoPE) and
// values go into a decoder's KV cache in that decoder's layout, so both CUDA decoders share it:
// the plain decoder's [layers, capacity, kv_heads, head_dim] and the megakernel's
// [layers, kv_heads, capacity, head_dim]. Rounding follows the training forward: bf16 activations
// (the residual stream too), fp32 statistics and accumulation.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/buffer.h"
#include "core/device.h"
#include "models/ops/linear.h"
#include "models/qwen3/config.h"
#include "models/qwen3/decoder_cuda.h"
#include "optim/slab.h"

namespace models::qwen3 {

// A decoder's KV cache: key (value) element i of kv head h at position j of layer l is
// k[l * layer_stride + j * at.position_stride + h * at.head_stride + i] (v alike).
struct KvCacheView {
  decode::bf16* k = nullptr;
  decode::bf16* v = nullptr;
  std::int64_t layer_stride = 0;
  decode::KvLayout at;
};

class Qwen3CudaPrefill {
 public:
  // `splits`: key ranges per query of the decode attention (a chunk after the first divides them).
  // `whole_mirror`: DecoderOptions::whole_mirror (the weights there when given, else the slab's).
  Qwen3CudaPrefill(const Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context,
                   std::int64_t max_chunk, int splits, const void* whole_mirror);

  // Appends `tokens` (valid ids, checked by the caller) at positions [start, start + size): their
  // keys and values into `cache`; the last token's fp32 logits (final norm and lm_head as the
  // decode step computes them) into `last_logits` [vocab]; with `all_logits`, every token's logits
  // from bf16 lm_head products into it (fp32 [size, vocab]). Asynchronous on the context's stream
  // unless all_logits is given.
  void run(std::span<const std::int32_t> tokens, std::int64_t start, const KvCacheView& cache, float* last_logits,
           float* all_logits);

  std::int64_t max_chunk() const { return chunk_; }
  std::size_t scratch_bytes() const { return memory_.bytes(); }

 private:
  void layers(std::int64_t start, std::int64_t n, const KvCacheView& cache);
  template <typename T>
  T* at(std::size_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(memory_.data()) + offset);
  }
  const decode::bf16* w(int tensor);

  Qwen3Config c_;
  optim::Slab& slab_;
  const void* whole_mirror_;
  const core::DeviceContext& ctx_;
  cudaStream_t stream_;
  std::int64_t chunk_ = 0;
  int splits_ = 1, matvec_blocks_ = 1;
  ops::LinearPlan linear_;
  Qwen3TensorIndex index_;
  core::Buffer memory_;
  std::size_t x_ = 0, h_ = 0, qkv_ = 0, q_ = 0, k_ = 0, att_ = 0, lse_ = 0, rstd_ = 0, tmp_ = 0, gate_up_ = 0, act_ = 0;
  std::size_t ids_ = 0, positions_ = 0, partial_ = 0, start_ = 0, invalid_ = 0, workspace_ = 0, workspace_bytes_ = 0;
};

}  // namespace models::qwen3
