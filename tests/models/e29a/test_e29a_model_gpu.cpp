// The E29a language model on the GPU (models/e29a/model_cuda.h) against the fp32 cpu model on the
// same weights (bf16 values, so both read identical weights): loss within 1e-2 relative and every
// tensor's gradient within 5e-2 normwise (the project's bf16 bounds: the GPU keeps the residual
// stream, the normed inputs and the activation gradients between ops in bf16); reruns are
// bit-identical; a limited gradient sink (ZeRO-2 staging) gets every gradient once, in ranges
// within its limit, equal to the slab path's; read range by range from a weight source (ZeRO-3)
// it gives the slab path's loss and gradients bit for bit, and each of its prefetch hints names
// the range it acquires next; the cuda decoder's logits match the cpu decoder's.
// Each for both residual kinds (pre_norm, normed_sum).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/half.h"
#include "models/e29a/model.h"
#include "models/e29a/model_cuda.h"
#include "optim/initialize.h"
#include "optim/weight_source.h"
#include "support/test_support.h"

namespace {

namespace e29a = models::e29a;

double normwise(const std::vector<float>& a, const std::vector<float>& b) {
  return test::normwise_error(a.data(), b.data(), a.size());
}

constexpr e29a::Residual kResiduals[] = {e29a::Residual::pre_norm, e29a::Residual::normed_sum};
const char* name_of(e29a::Residual residual) {
  return residual == e29a::Residual::pre_norm ? "pre_norm" : "normed_sum";
}

e29a::E29aConfig config_of(bool tied, e29a::Residual residual) {
  e29a::E29aConfig c;
  c.residual = residual;
  c.vocab_size = 37;
  c.hidden_size = 72;
  c.num_layers = 2;
  c.n_slots = 8;
  c.tie_word_embeddings = tied;
  c.tape_init_std = 1.0;
  return c;
}

// The same weights on a cpu slab and a gpu slab (bf16 values in both).
struct Pair {
  e29a::E29aConfig config;
  core::DeviceContext cpu{core::Device::cpu()};
  core::DeviceContext gpu{core::Device::cuda(0)};
  std::unique_ptr<optim::Slab> host, device;
  std::int64_t batch = 3, seq = 33;
  std::vector<std::int32_t> ids, targets;
  core::Buffer ids_d, targets_d;

  Pair(bool tied, e29a::Residual residual, std::mt19937_64& rng) : config(config_of(tied, residual)) {
    const optim::SlabLayout layout(e29a::parameter_specs(config), 1);
    host = std::make_unique<optim::Slab>(layout, cpu);
    optim::initialize_owned(*host, cpu, rng());
    float* w = host->master().as<float>();
    const auto noise = test::random_normal(rng, host->master().bytes() / 4, 0.05f);
    const auto& embed = layout.tensor("embed_tokens");
    for (std::size_t i = 0; i < noise.size(); ++i) {
      const bool in_embed =
          static_cast<std::int64_t>(i) >= embed.offset && static_cast<std::int64_t>(i) < embed.offset + embed.numel;
      const float v = (in_embed ? 25.0f * w[i] : w[i]) + noise[i];
      w[i] = core::bf16_to_float(core::float_to_bf16(v));
    }
    device = std::make_unique<optim::Slab>(layout, gpu);
    test::from_host(device->master(), test::to_host<float>(host->master()));
    device->write_mirror(gpu);
    gpu.synchronize();
    std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(config.vocab_size - 1));
    ids.resize(static_cast<std::size_t>(batch * seq));
    targets.resize(ids.size());
    for (auto& id : ids) id = pick(rng);
    for (auto& t : targets) t = pick(rng);
    targets[5] = -100;
    ids_d = core::Buffer(gpu.device(), ids.size() * 4);
    targets_d = core::Buffer(gpu.device(), targets.size() * 4);
    test::from_host(ids_d, ids);
    test::from_host(targets_d, targets);
  }

  float gpu_step(e29a::E29aCuda& model) {
    device->grad().fill_bytes(0, gpu.stream());
    model.forward_backward(ids_d.as<std::int32_t>(), targets_d.as<std::int32_t>(), batch, seq, 1.0f);
    gpu.synchronize();
    float loss = 0;
    CUDA_CHECK(cudaMemcpy(&loss, model.loss(), 4, cudaMemcpyDeviceToHost));
    return loss;
  }
  // The evaluation loss of the same batch (no gradients).
  float gpu_eval(e29a::E29aCuda& model) {
    model.forward_loss(ids_d.as<std::int32_t>(), targets_d.as<std::int32_t>(), batch, seq);
    float loss = 0;
    CUDA_CHECK(cudaMemcpy(&loss, model.loss(), 4, cudaMemcpyDeviceToHost));
    return loss;
  }
};

// Tied and untied heads, each with both residual kinds.
std::vector<std::pair<bool, e29a::Residual>> cases() {
  std::vector<std::pair<bool, e29a::Residual>> all;
  for (const bool tied : {true, false}) {
    for (const e29a::Residual residual : kResiduals) all.emplace_back(tied, residual);
  }
  return all;
}

TEST(E29aModelGpu, MatchesCpuModel) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  for (const auto& [tied, residual] : cases()) {
    SCOPED_TRACE(std::string(tied ? "tied " : "untied ") + name_of(residual));
    Pair p(tied, residual, rng);
    e29a::E29aCpu cpu_model(p.config, *p.host, nullptr);
    p.host->grad().fill_bytes(0);
    cpu_model.forward_backward(p.ids.data(), p.targets.data(), p.batch, p.seq, 1.0f);
    const float cpu_loss = *cpu_model.loss();
    const auto cpu_grads = test::to_host<float>(p.host->grad());

    e29a::E29aCuda model(p.config, *p.device, p.gpu, p.batch * p.seq);
    const float loss = p.gpu_step(model);
    const auto grads = test::to_host<float>(p.device->grad());
    EXPECT_NEAR(loss, cpu_loss, 1e-2 * cpu_loss);
    double worst = 0;
    std::string worst_name;
    for (const auto& t : p.host->layout().tensors()) {
      const auto b = static_cast<std::ptrdiff_t>(t.offset), e = b + static_cast<std::ptrdiff_t>(t.numel);
      const double err = normwise(std::vector<float>(grads.begin() + b, grads.begin() + e),
                                  std::vector<float>(cpu_grads.begin() + b, cpu_grads.begin() + e));
      EXPECT_LE(err, 5e-2) << t.spec.name;
      if (err > worst) {
        worst = err;
        worst_name = t.spec.name;
      }
    }
    std::printf("[ parity   ] %s %s: loss %.6f vs cpu %.6f, worst gradient %.3g (%s)\n", tied ? "tied" : "untied",
                name_of(residual), loss, cpu_loss, worst, worst_name.c_str());

    // Reruns are bit-identical; evaluation gives the same loss as training.
    const float again = p.gpu_step(model);
    EXPECT_EQ(again, loss);
    const auto grads_again = test::to_host<float>(p.device->grad());
    EXPECT_EQ(std::memcmp(grads.data(), grads_again.data(), grads.size() * 4), 0);
    EXPECT_NEAR(p.gpu_eval(model), loss, 1e-6 * loss);
  }
}

// ZeRO-2 staging: zeroed buffers of at most `limit` elements, each released range collected.
struct StagingSink final : optim::GradientSink {
  std::int64_t limit;
  core::Buffer staging;
  std::vector<float> collected;
  std::vector<int> hits;
  StagingSink(std::int64_t elements, std::int64_t total)
      : limit(elements),
        staging(core::Device::cuda(), static_cast<std::size_t>(elements) * 4),
        collected(static_cast<std::size_t>(total), 0.0f),
        hits(static_cast<std::size_t>(total), 0) {}
  std::int64_t max_range_elements() const override { return limit; }
  optim::Range current{};
  float* acquire(optim::Range range) override {
    EXPECT_LE(range.size(), limit);
    current = range;
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemset(staging.data(), 0, staging.bytes()));
    return staging.as<float>();
  }
  void release(optim::Range range) override {
    EXPECT_EQ(range.begin, current.begin);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> part(static_cast<std::size_t>(range.size()));
    CUDA_CHECK(cudaMemcpy(part.data(), staging.data(), part.size() * 4, cudaMemcpyDeviceToHost));
    for (std::int64_t i = 0; i < range.size(); ++i) {
      collected[static_cast<std::size_t>(range.begin + i)] += part[static_cast<std::size_t>(i)];
      ++hits[static_cast<std::size_t>(range.begin + i)];
    }
  }
};

TEST(E29aModelGpu, LimitedGradientSinkGetsEveryGradientOnce) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  for (const auto& [tied, residual] : cases()) {
    SCOPED_TRACE(std::string(tied ? "tied " : "untied ") + name_of(residual));
    Pair p(tied, residual, rng);
    e29a::E29aCuda model(p.config, *p.device, p.gpu, p.batch * p.seq);
    p.gpu_step(model);
    const auto reference = test::to_host<float>(p.device->grad());
    const std::int64_t limit = model.largest_gradient_range();
    StagingSink sink(limit, p.device->layout().total_elements());
    model.set_gradient_sink(&sink);
    p.gpu_step(model);
    model.set_gradient_sink(nullptr);
    for (const auto& t : p.device->layout().tensors()) {
      SCOPED_TRACE(t.spec.name);
      for (std::int64_t i = t.offset; i < t.offset + t.numel; ++i) {
        ASSERT_EQ(sink.hits[static_cast<std::size_t>(i)], 1) << "element " << i - t.offset;
      }
      const auto b = static_cast<std::ptrdiff_t>(t.offset), e = b + static_cast<std::ptrdiff_t>(t.numel);
      EXPECT_LE(normwise(std::vector<float>(sink.collected.begin() + b, sink.collected.begin() + e),
                         std::vector<float>(reference.begin() + b, reference.begin() + e)),
                1e-5);
    }
    StagingSink small(limit - 1, p.device->layout().total_elements());
    EXPECT_THROW(model.set_gradient_sink(&small), core::Error);
  }
}

// ZeRO-3's source on one GPU: two buffers of the largest range, each acquire copies its range
// from a separate copy of the weights on the stream, each release fills the buffer with NaN on
// the stream, so a read outside a held range (or after its release in stream order) shows in the
// loss. Records the acquires and, per hint, how many acquires came before it.
class PoisoningSource final : public optim::WeightSource {
 public:
  PoisoningSource(const core::Buffer& weights, std::int64_t largest, cudaStream_t stream)
      : weights_(weights),
        buffers_(core::Device::cuda(), static_cast<std::size_t>(2 * largest) * 2),
        largest_(largest),
        stream_(stream) {}
  const void* acquire(optim::Range range) override {
    EXPECT_LE(range.size(), largest_);
    int slot = held_[0].empty() ? 0 : 1;
    EXPECT_TRUE(held_[slot].empty()) << "more than two ranges held";
    held_[slot] = range;
    acquired.push_back(range);
    auto* to = buffers_.as<std::uint16_t>() + slot * largest_;
    CUDA_CHECK(cudaMemcpyAsync(to, weights_.as<std::uint16_t>() + range.begin,
                               static_cast<std::size_t>(range.size()) * 2, cudaMemcpyDeviceToDevice, stream_));
    return to;
  }
  void release(optim::Range range) override {
    const int slot = held_[0] == range ? 0 : 1;
    ASSERT_EQ(held_[slot], range);
    held_[slot] = {};
    CUDA_CHECK(cudaMemsetAsync(buffers_.as<std::uint16_t>() + slot * largest_, 0xff,
                               static_cast<std::size_t>(largest_) * 2, stream_));
  }
  void prefetch(optim::Range range) override { hints.emplace_back(acquired.size(), range); }
  std::vector<optim::Range> acquired;
  std::vector<std::pair<std::size_t, optim::Range>> hints;

 private:
  const core::Buffer& weights_;
  core::Buffer buffers_;
  std::int64_t largest_;
  cudaStream_t stream_;
  optim::Range held_[2] = {};
};

TEST(E29aModelGpu, WeightSourceGivesTheSlabsResultsBitForBit) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  for (const auto& [tied, residual] : cases()) {
    SCOPED_TRACE(std::string(tied ? "tied " : "untied ") + name_of(residual));
    Pair p(tied, residual, rng);
    float reference_loss = 0;
    std::vector<float> reference;
    {
      e29a::E29aCuda model(p.config, *p.device, p.gpu, p.batch * p.seq);
      reference_loss = p.gpu_step(model);
      reference = test::to_host<float>(p.device->grad());
    }
    // The weights only in the source's copy: the model's own mirror is zeroed.
    core::Buffer weights(p.gpu.device(), p.device->mirror().bytes());
    CUDA_CHECK(cudaMemcpy(weights.data(), p.device->mirror().data(), weights.bytes(), cudaMemcpyDeviceToDevice));
    p.device->mirror().fill_bytes(0, p.gpu.stream());
    std::int64_t largest = 0;
    const e29a::TensorIndex index(p.config, p.device->layout());
    std::vector<optim::Range> ranges = {index.embed_range(p.device->layout())};
    for (std::size_t l = 0; l < index.layers.size(); ++l) ranges.push_back(index.layer_range(p.device->layout(), l));
    ranges.push_back(index.tail_range(p.device->layout()));
    for (const optim::Range& r : ranges) largest = std::max(largest, r.size());
    PoisoningSource source(weights, largest, p.gpu.stream());
    e29a::E29aCuda model(p.config, *p.device, p.gpu, p.batch * p.seq, &source);
    const float loss = p.gpu_step(model);
    const auto grads = test::to_host<float>(p.device->grad());
    EXPECT_EQ(loss, reference_loss);
    EXPECT_EQ(std::memcmp(grads.data(), reference.data(), grads.size() * 4), 0);
    // Forward: embedding, layers, tail; backward: tail (+ tied embedding), layers last first, head.
    const std::size_t layers = index.layers.size();
    EXPECT_EQ(source.acquired.size(), 2 * layers + 4 + (tied ? 1 : 0));
    EXPECT_EQ(source.hints.size(), 2 * layers + 2);
    for (const auto& [before, range] : source.hints) {
      ASSERT_LT(before, source.acquired.size());
      EXPECT_EQ(source.acquired[before], range) << "hint after acquire " << before;
    }
    // Evaluation reads through the source too.
    EXPECT_NEAR(p.gpu_eval(model), loss, 1e-6 * loss);
  }
}

// The cuda decoder against the cpu decoder on the same weights: the prompt's logits, then steps
// (host and device tokens), the capacity, reset.
void expect_decoder_matches_cpu_decoder(Pair& p) {
  const std::int64_t prompt = 20, steps = 6;
  e29a::E29aCpuDecoder cpu_decoder(p.config, *p.host, p.cpu, {.max_tokens = prompt + steps});
  e29a::E29aCudaDecoder decoder(p.config, *p.device, p.gpu, {.max_tokens = prompt + steps});
  const std::span<const std::int32_t> tokens(p.ids.data(), static_cast<std::size_t>(prompt));
  core::Buffer all(p.gpu.device(), static_cast<std::size_t>(prompt * p.config.vocab_size) * 4);
  std::vector<float> cpu_all(static_cast<std::size_t>(prompt * p.config.vocab_size));
  cpu_decoder.prefill(tokens, cpu_all.data());
  decoder.prefill(tokens, all.as<float>());
  p.gpu.synchronize();
  EXPECT_LE(normwise(test::to_host<float>(all), cpu_all), 3e-2);
  core::Buffer device_token(p.gpu.device(), 4);
  for (std::int64_t s = 0; s < steps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    const std::int32_t token = p.ids[static_cast<std::size_t>(prompt + s)];
    cpu_decoder.step(token);
    if (s % 2 == 0) {
      decoder.step(token);
    } else {
      test::from_host(device_token, std::vector<std::int32_t>{token});
      decoder.step(-1, device_token.as<std::int32_t>());
    }
    p.gpu.synchronize();
    std::vector<float> logits(static_cast<std::size_t>(p.config.vocab_size));
    CUDA_CHECK(cudaMemcpy(logits.data(), decoder.logits(), logits.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT_LE(normwise(logits, std::vector<float>(cpu_decoder.logits(), cpu_decoder.logits() + p.config.vocab_size)),
              3e-2);
  }
  EXPECT_EQ(decoder.position(), prompt + steps);
  EXPECT_THROW(decoder.step(0), core::InputError);
  decoder.reset();
  EXPECT_EQ(decoder.position(), 0);
}

TEST(E29aModelGpu, DecoderMatchesCpuDecoder) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  for (const e29a::Residual residual : kResiduals) {
    SCOPED_TRACE(name_of(residual));
    Pair p(false, residual, rng);
    expect_decoder_matches_cpu_decoder(p);
  }
}

}  // namespace
