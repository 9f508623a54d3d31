// ZeRO-3's model side on the cpu, for both families through the model interface: a model reading
// its weights range by range from a weight source gives the same loss and gradients, bit for bit,
// as the model reading the whole slab; it reads only inside ranges it holds (else core::Error),
// holds at most two at once, acquires each layer before its forward and again before its
// backward, releases everything it acquired, and each prefetch hint names the range it acquires
// next (a layer's hint lets ZeRO-3 gather the next layer under this one's compute).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "models/model_config.h"
#include "models/registry.h"
#include "optim/initialize.h"
#include "optim/slab.h"
#include "optim/weight_source.h"

namespace {

// Hands out the ranges of a whole fp32 copy and records what was asked.
class RecordingSource final : public optim::WeightSource {
 public:
  explicit RecordingSource(const float* weights) : weights_(weights) {}
  const void* acquire(optim::Range range) override {
    acquired.push_back(range);
    ++held;
    most_held = std::max(most_held, held);
    return weights_ + range.begin;
  }
  void release(optim::Range range) override {
    released.push_back(range);
    --held;
  }
  void prefetch(optim::Range range) override { hints.emplace_back(acquired.size(), range); }
  std::vector<optim::Range> acquired, released;
  std::vector<std::pair<std::size_t, optim::Range>> hints;  // acquires before the hint, range
  int held = 0, most_held = 0;

 private:
  const float* weights_;
};

struct Run {
  float loss = 0;
  std::vector<float> grads;
};

Run train_step(const models::ModelSpec& spec, optim::Slab& slab, optim::WeightSource* source) {
  const core::DeviceContext cpu(core::Device::cpu());
  const std::int64_t batch = 2, seq = 16;
  std::vector<std::int32_t> ids(batch * seq), targets(batch * seq);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<std::int32_t>((i * 37 + 11) % 200);
    targets[i] = static_cast<std::int32_t>((i * 53 + 5) % 200);
  }
  auto model = spec.trainable(slab, cpu, {.max_tokens = batch * seq, .weight_source = source});
  model->forward_backward(ids.data(), targets.data(), batch, seq, 1.0f);
  Run r;
  r.loss = *model->loss();
  const float* g = slab.grad().as<float>();
  r.grads.assign(g, g + slab.grad().bytes() / sizeof(float));
  return r;
}

void check_family(const std::string& family_name, const std::string& preset) {
  SCOPED_TRACE(family_name);
  const core::DeviceContext cpu(core::Device::cpu());
  const models::Family& family = models::family(family_name);
  const auto spec = family.spec(models::base_shape(family, preset));
  optim::Slab whole(optim::SlabLayout(spec->parameters(), 1), cpu, {.zero_stage = 0});
  optim::initialize_owned(whole, cpu, 7);
  optim::Slab sharded(optim::SlabLayout(spec->parameters(), 1), cpu, {.zero_stage = 3});
  optim::initialize_owned(sharded, cpu, 7);

  const Run reference = train_step(*spec, whole, nullptr);
  RecordingSource source(whole.master().as<float>());
  const Run gathered = train_step(*spec, sharded, &source);
  EXPECT_EQ(reference.loss, gathered.loss);
  EXPECT_EQ(reference.grads, gathered.grads);

  const std::vector<optim::Range> ranges = spec->weight_ranges(sharded.layout());
  ASSERT_GE(ranges.size(), 3u);
  const std::size_t layers = ranges.size() - 2;
  EXPECT_LE(source.most_held, 2);
  EXPECT_EQ(source.held, 0);
  EXPECT_EQ(source.acquired.size(), source.released.size());
  // Forward: the embedding, each layer in order, the tail; the backward then takes each layer
  // again, last first.
  ASSERT_GE(source.acquired.size(), 2 * layers + 2);
  EXPECT_EQ(source.acquired[0], ranges[0]);
  for (std::size_t l = 0; l < layers; ++l) EXPECT_EQ(source.acquired[1 + l], ranges[1 + l]);
  EXPECT_EQ(source.acquired[1 + layers], ranges.back());
  std::vector<optim::Range> backward_layers;
  for (std::size_t i = 2 + layers; i < source.acquired.size(); ++i) {
    for (std::size_t l = 0; l < layers; ++l) {
      if (source.acquired[i] == ranges[1 + l]) backward_layers.push_back(ranges[1 + l]);
    }
  }
  ASSERT_EQ(backward_layers.size(), layers);
  for (std::size_t l = 0; l < layers; ++l) EXPECT_EQ(backward_layers[l], ranges[layers - l]);
  // Every hint is right, and every layer but the backward's first is hinted in both passes.
  for (const auto& [before, range] : source.hints) {
    ASSERT_LT(before, source.acquired.size());
    EXPECT_EQ(source.acquired[before], range) << "hint after acquire " << before;
  }
  EXPECT_GE(source.hints.size(), 2 * layers + 1);
}

TEST(WeightSource, Qwen3ReadsLayerByLayerBitForBit) { check_family("qwen3", "qwen3-test"); }

TEST(WeightSource, E29aReadsLayerByLayerBitForBit) { check_family("e29a", "e29a-tiny"); }

}  // namespace
