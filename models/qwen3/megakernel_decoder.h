// The Qwen3 decoder on one GPU at batch 1 through the decode megakernel (decode_megakernel.cu):
// one persistent launch decodes one token (step) or many (prefill, teacher forcing; greedy(),
// each token the argmax of the previous one's logits, ids collected on the device).
//
// Weights are streamed straight from the slab's bf16 mirror: each unit reads a contiguous row
// range of one row-major matrix (q/k/v and gate/up are contiguous there already), so
// construction re-lays nothing out (zero bytes, zero time) and the decoder sees the trainer's
// latest weights. The KV cache is bf16 [layers, kv_heads, capacity, head_dim] (keys after q/k
// norm and RoPE), sized by DecoderOptions::max_tokens. prefill() runs a prompt through the plain
// decoder's batched path (Qwen3CudaPrefill: products over many positions, flash attention),
// which writes this layout, so a long prompt is a few dozen launches, not one pass per token;
// append() feeds tokens through the kernel instead (teacher forcing, one launch).
// Activations between units are bf16 where the plain decoder rounds them; the logits are fp32.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "core/device.h"
#include "models/model.h"
#include "models/qwen3/config.h"
#include "optim/slab.h"

namespace models::qwen3 {

// How the kernel is laid over the GPU (bench/megakernel_bench sweeps these).
struct MegakernelSettings {
  int consumer_warps = 8;                 // computing warps per block (one more streams weights)
  int page_bytes = 0;                     // shared-memory page of the weight/cache ring; 0: by the model
  int inflight_pages = 1;                 // copies a block has in flight (0: as many as free pages)
  int pages = 0;                          // pages in the ring; 0: as many as fit
  int max_splits = 16;                    // attention chunks per kv head at long contexts
  int min_chunk = 64;                     // positions per attention chunk, at least
  int blocks = 0;                         // persistent blocks; 0: one per multiprocessor
  bool evict_first = true;                // stream weights and cache with an L2 evict-first hint
  double timeout_seconds = 5.0;           // a spin longer than this aborts the launch (core::Error)
  std::int64_t max_prefill_chunk = 4096;  // prompt tokens per batched pass (bounds its activations)
};

class MegakernelDecoder final : public Decoder {
 public:
  // `slab`: laid out from parameter_specs(config), on the context's cuda device, bf16 mirror
  // spanning the whole model. A Hopper or later GPU, head_dim 64 or 128, at most 8 query heads
  // per kv head, hidden and intermediate sizes multiples of 8 (core::InputError otherwise).
  MegakernelDecoder(const Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context,
                    const DecoderOptions& options, MegakernelSettings settings = {});
  ~MegakernelDecoder() override;

  void reset() override;
  // The batched path (see the top); `all_logits`: device fp32 [tokens, vocab] from bf16 lm_head
  // products, as the plain decoder's. logits() then holds the last token's fp32 logits and the
  // next greedy() starts from their argmax.
  void prefill(std::span<const std::int32_t> tokens, float* all_logits = nullptr) override;
  void step(std::int32_t token, const std::int32_t* device_token = nullptr) override;
  const float* logits() const override;
  std::int64_t position() const override;
  std::int64_t capacity() const override;

  // Teacher forcing through the kernel in one launch: appends device ids [count]; every
  // position's logits into all_logits (device fp32 [count, vocab]) when given.
  void append(const std::int32_t* device_ids, std::int64_t count, float* all_logits = nullptr);
  // Appends `count` tokens in one launch, each the argmax of the logits before it (the first:
  // of logits(), which a prefill, step or greedy call must have produced); the appended ids go
  // to device int32 ids_out[count] when given. logits() then holds the last token's logits.
  void greedy(std::int64_t count, std::int32_t* ids_out = nullptr);
  // greedy(), then check() (so it waits for the launch).
  bool append_greedy(std::int64_t count, std::int32_t* ids_out) override;
  std::string kind() const override { return "megakernel"; }
  // Throws core::Error naming the wait that passed its deadline, if a launch aborted
  // (synchronises the stream). prefill() checks by itself; greedy() and step() do not wait.
  void check() const;

  // Benchmarks: `position` tokens in the cache (random rows, as if decoded) without running them.
  void fake_context(std::int64_t position, std::uint64_t seed);
  // Diagnostics: greedy(count) with every unit's start and end recorded, summarised per phase
  // kind over the tokens and layers: the time each phase adds to the token's critical path, and
  // how long its units took once their inputs were complete (median and slowest). Synchronises.
  // With `trace_path`, also writes every unit's raw marks of up to 8 tokens after the first two
  // (text, one unit a line: token, unit, block, kind, layer, a, b, then the trace words in ns;
  // bench/megakernel_trace.py reads it).
  std::string profile_greedy(std::int64_t count, const std::string& trace_path = "");
  // Tests: the next launch waits on a word that nothing writes (it must abort at the deadline).
  void stall_next_launch();

  std::size_t cache_bytes() const;    // the KV cache
  std::size_t scratch_bytes() const;  // everything else the decoder allocated (the prompt path too)
  // Bytes one token streams: every weight matrix and the head (norms and the embedding row aside).
  std::size_t weight_bytes_per_token() const;
  // Cache bytes the token at `position` reads (keys and values of positions [0, position)).
  std::size_t cache_bytes_read(std::int64_t position) const;
  // "blocks x (consumer warps + 1) warps, pages x page KB, splits, min chunk".
  std::string describe() const;
  int blocks() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace models::qwen3
