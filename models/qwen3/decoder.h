// The Qwen3 decoder on the cpu backend in fp32: a KV cache per layer (keys after the q/k norm
// and RoPE, values as projected) sized for DecoderOptions::max_tokens. prefill() runs the
// appended tokens through the stack in one pass, writing their keys and values into the cache;
// step() is a prefill of one token, whose attention reads every cached position. The ops are the
// reference ops of the full forward (Qwen3Model), and every product is accumulated in double in
// a fixed order whatever the number of rows, so the logits of a position equal the full
// forward's up to the attention over the cache (the same double-precision softmax).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/device.h"
#include "models/model.h"
#include "models/qwen3/config.h"
#include "optim/slab.h"

namespace models::qwen3 {

class Qwen3CpuDecoder final : public HostDecoder {
 public:
  // `slab`: laid out from parameter_specs(config), on the cpu; the weights are its master (which
  // must cover the whole model) or options.full_weights. core::Error otherwise.
  Qwen3CpuDecoder(const Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context,
                  const DecoderOptions& options);

  void prefill(std::span<const std::int32_t> tokens, float* all_logits = nullptr) override;
  void step(std::int32_t token, const std::int32_t* device_token = nullptr) override;
  // Bytes of the KV cache.
  std::size_t cache_bytes() const { return (k_cache_.size() + v_cache_.size()) * sizeof(float); }

 private:
  using LayerWeights = Qwen3LayerTensors;
  std::span<const float> weight(int tensor) const;
  float* layer_k(std::size_t layer) { return k_cache_.data() + layer * cache_layer_elements(); }
  float* layer_v(std::size_t layer) { return v_cache_.data() + layer * cache_layer_elements(); }
  std::size_t cache_layer_elements() const { return static_cast<std::size_t>(capacity_ * config_.kv_size()); }

  Qwen3Config config_;
  optim::Slab& slab_;
  const float* full_weights_ = nullptr;
  int embed_ = 0, final_norm_ = 0, head_ = 0;
  std::vector<LayerWeights> layers_;
  std::vector<float> k_cache_, v_cache_;  // [layers, capacity, kv_heads, head_dim]
};

}  // namespace models::qwen3
