// Shared by the GPU decoder tests (plain decoder and megakernel): a Qwen3 model whose fp32 host
// master holds bf16-representable values and whose GPU slab holds the same weights (bf16 mirror),
// from a committed fixture folder or initialised with noise on the norms (so they matter); and the
// check that a decoder reading a copy of the whole mirror (ZeRO-3) gives the slab's logits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/buffer.h"
#include "core/device.h"
#include "core/half.h"
#include "core/error.h"
#include "core/rng.h"
#include "models/model.h"
#include "models/qwen3/config.h"
#include "support/qwen3/hf_import.h"
#include "models/safetensors.h"
#include "optim/slab.h"

namespace test {

inline std::string qwen3_fixture(const std::string& name) {
  return std::string(LLMTRAIN_FIXTURES_DIR) + "/qwen3/" + name;
}

// A small Qwen3 shape; a short RoPE wavelength (theta 500) so positions matter at test lengths.
inline models::qwen3::Qwen3Config small_config(std::int64_t vocab, std::int64_t hidden, std::int64_t inter,
                                               std::int64_t layers, std::int64_t heads, std::int64_t kv_heads,
                                               std::int64_t head_dim, bool tied) {
  models::qwen3::Qwen3Config c;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.tie_word_embeddings = tied;
  c.rope_theta = 500.0;
  c.max_position_embeddings = 8192;
  return c;
}

struct Qwen3GpuTestModel {
  models::qwen3::Qwen3Config config;
  core::DeviceContext cpu{core::Device::cpu()};
  core::DeviceContext gpu{core::Device::cuda(0)};
  std::unique_ptr<optim::Slab> host, device;

  explicit Qwen3GpuTestModel(const models::qwen3::Qwen3Config& c) : config(c) {
    host = std::make_unique<optim::Slab>(optim::SlabLayout(models::qwen3::parameter_specs(config), 1), cpu);
  }

  // Rounds the host weights to bf16 and uploads them (master and mirror).
  void upload() {
    float* master = host->master().as<float>();
    const auto n = static_cast<std::int64_t>(host->master().bytes() / 4);
#pragma omp parallel for
    for (std::int64_t i = 0; i < n; ++i) master[i] = core::bf16_to_float(core::float_to_bf16(master[i]));
    device = std::make_unique<optim::Slab>(host->layout(), gpu);
    core::copy_bytes(device->master().data(), master, host->master().bytes(), gpu.stream());
    gpu.synchronize();
    device->write_mirror(gpu);
    gpu.synchronize();
  }

  static Qwen3GpuTestModel fixture_model(const std::string& name) {
    Qwen3GpuTestModel m(models::qwen3::read_hf_config(qwen3_fixture(name)));
    models::qwen3::load_hf_weights(qwen3_fixture(name), m.config, *m.host);
    m.upload();
    return m;
  }

  // Each tensor drawn as the model's initialisation does (its kind and std, seeded per tensor),
  // in parallel (0.6B-sized shapes take seconds), then noise on the norms.
  static Qwen3GpuTestModel random_model(const models::qwen3::Qwen3Config& config, std::uint64_t seed) {
    Qwen3GpuTestModel m(config);
    float* weights = m.host->master().as<float>();
    const auto& tensors = m.host->layout().tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const auto& spec = tensors[t].spec;
      const std::uint64_t tensor_seed = core::splitmix64(seed ^ core::splitmix64(t + 1));
      float* w = weights + tensors[t].offset;
#pragma omp parallel for
      for (std::int64_t i = 0; i < tensors[t].numel; ++i) {
        w[i] = spec.init == optim::InitKind::ones ? 1.0f
               : spec.init == optim::InitKind::zeros
                   ? 0.0f
                   : spec.init_std * core::normal01(tensor_seed, static_cast<std::uint64_t>(i));
      }
    }
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> noise(0.0f, 0.2f);
    for (const auto& t : tensors) {
      if (t.spec.name.find("norm") == std::string::npos) continue;
      for (std::int64_t i = 0; i < t.numel; ++i) weights[t.offset + i] += noise(rng);
    }
    m.upload();
    return m;
  }
};

// ZeRO-3's decode (models::DecoderOptions::whole_mirror): the decoder `make(options)` builds from
// `m` gives, after a 4-token prefill of `ids` and a step for each further id, the same logits bit
// for bit reading a copy of the whole mirror (the slab's own mirror then poisoned with NaN) as
// reading the slab.
template <typename MakeDecoder>
void expect_whole_mirror_gives_the_slabs_logits(Qwen3GpuTestModel& m, const std::vector<std::int32_t>& ids,
                                                MakeDecoder make) {
  const auto vocab = static_cast<std::size_t>(m.config.vocab_size);
  const auto decode = [&](const models::DecoderOptions& options) {
    const std::unique_ptr<models::Decoder> decoder = make(options);
    std::vector<std::vector<float>> rows;
    const auto keep_logits = [&] {
      rows.emplace_back(vocab);
      CUDA_CHECK(cudaDeviceSynchronize());
      CUDA_CHECK(cudaMemcpy(rows.back().data(), decoder->logits(), vocab * 4, cudaMemcpyDeviceToHost));
    };
    decoder->prefill({ids.data(), 4});
    keep_logits();
    for (std::size_t t = 4; t < ids.size(); ++t) {
      decoder->step(ids[t]);
      keep_logits();
    }
    return rows;
  };
  const auto max_tokens = static_cast<std::int64_t>(ids.size());
  const auto expected = decode({.max_tokens = max_tokens});
  core::Buffer whole(m.gpu.device(), m.device->mirror().bytes());
  core::copy_bytes(whole.data(), m.device->mirror().data(), whole.bytes(), m.gpu.stream());
  m.device->mirror().fill_bytes(0xFF, m.gpu.stream());
  EXPECT_EQ(decode({.max_tokens = max_tokens, .whole_mirror = whole.data()}), expected);
}

}  // namespace test
