// The E29a language model on the cpu (models/e29a/model.h) behind the model interface: the
// family's table, presets and Hugging Face names; the whole model's gradients against central
// finite differences of its loss (every tensor kind: embedding, norms, the layer's five, the final
// norm and an untied head); the recurrent decoder against the training forward (teacher-forced
// logits give the same loss) and against itself (a prompt prefilled in pieces or whole).
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/device.h"
#include "models/e29a/family.h"
#include "models/e29a/model.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "optim/initialize.h"
#include "optim/slab.h"
#include "support/test_support.h"

namespace {

namespace e29a = models::e29a;

e29a::E29aConfig small_config(bool tied) {
  e29a::E29aConfig c;
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.num_layers = 2;
  c.n_slots = 3;
  c.tie_word_embeddings = tied;
  c.tape_init_std = 1.0;
  return c;
}

// A cpu slab with the model's own initialisation, then every weight moved by a little noise (so
// b_h and the norms are not at their exactly-symmetric starting values).
std::unique_ptr<optim::Slab> make_slab(const e29a::E29aConfig& config, const core::DeviceContext& cpu,
                                       std::mt19937_64& rng) {
  auto slab = std::make_unique<optim::Slab>(optim::SlabLayout(e29a::parameter_specs(config), 1), cpu);
  optim::initialize_owned(*slab, cpu, rng());
  float* w = slab->master().as<float>();
  const auto noise = test::random_normal(rng, slab->master().bytes() / 4, 0.1f);
  for (std::size_t i = 0; i < noise.size(); ++i) w[i] += noise[i];
  // The embedding starts at std 0.02; make it large enough to matter through the norms.
  const auto& embed = slab->layout().tensor("embed_tokens");
  for (std::int64_t i = 0; i < embed.numel; ++i) w[embed.offset + i] *= 5.0f;
  return slab;
}

std::vector<std::int32_t> random_ids(std::mt19937_64& rng, std::size_t n, std::int64_t vocab) {
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(vocab - 1));
  std::vector<std::int32_t> ids(n);
  for (auto& id : ids) id = pick(rng);
  return ids;
}

TEST(E29aModelCpu, FamilyIsRegisteredWithPresetsAndNames) {
  const models::Family& family = models::family("e29a");
  EXPECT_EQ(family.hf_architecture(), "E29aForCausalLM");
  EXPECT_EQ(models::family_for_hf_architecture("E29aForCausalLM"), &family);
  for (const std::string& preset : family.presets()) {
    SCOPED_TRACE(preset);
    const models::Shape shape = models::base_shape(family, preset);
    models::check_shape(family, shape, "test");
    const auto spec = family.spec(shape);
    const e29a::E29aConfig config = e29a::config_from_shape(shape);
    EXPECT_EQ(spec->parameter_count(), config.parameter_count());
    EXPECT_TRUE(spec->streams_gradients());
    // Every parameter is named once in the Hugging Face folder (plus the tied head's copy).
    std::vector<int> seen(spec->parameters().size(), 0);
    for (const auto& t : spec->hf_tensors()) {
      if (!t.tied_copy) ++seen[static_cast<std::size_t>(t.param)];
    }
    for (int s : seen) EXPECT_EQ(s, 1);
  }
  const models::Shape upstream = models::base_shape(family, "e29a-d1024-l6-n16");
  EXPECT_EQ(upstream["hidden_size"], 1024);
  EXPECT_EQ(upstream["num_layers"], 6);
  EXPECT_EQ(upstream["n_slots"], 16);
  EXPECT_EQ(upstream["tape_init"], "learned");
  // config.json carries the shape and reads back to it.
  const auto spec = family.spec(upstream);
  const nlohmann::json hf = spec->hf_config(nlohmann::json::object());
  EXPECT_EQ(hf["architectures"][0], "E29aForCausalLM");
  const models::Shape back = models::shape_from_hf(family, hf, "config.json", upstream);
  EXPECT_EQ(models::weights_shape(family, back), models::weights_shape(family, upstream));
  // Upstream's initialisation.
  const auto& p = spec->parameters();
  for (const auto& s : p) {
    if (s.name == "layers.0.w_h") {
      EXPECT_EQ(s.init, optim::InitKind::orthogonal);
      EXPECT_FLOAT_EQ(s.init_gain, 0.9f);
    }
    if (s.name == "layers.0.w_xz" || s.name == "layers.0.w_write") EXPECT_EQ(s.init, optim::InitKind::xavier_uniform);
    if (s.name == "layers.0.b_h") EXPECT_EQ(s.init, optim::InitKind::zeros);
    if (s.name == "layers.0.tape0") EXPECT_EQ(s.init, optim::InitKind::normal);
  }
  models::Shape zeros = upstream;
  zeros["tape_init"] = "zeros";
  for (const auto& s : family.spec(zeros)->parameters()) {
    if (s.name == "layers.0.tape0") EXPECT_EQ(s.init, optim::InitKind::zeros);
  }
}

// The model's loss is a float computation: central differences with a step of 1e-2 on weights of
// order 0.1 to 1 see float rounding of the loss (about 1e-7 relative, i.e. 1e-5 / 1e-2 = 1e-3 in
// the estimate) and the O(h^2) truncation; a wiring mistake (a missing residual, a wrong tensor, a
// gradient not accumulated) gives O(1) errors. Tolerance: 3e-2 of max(|fd|, rms of the gradient).
TEST(E29aModelCpu, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext cpu(core::Device::cpu());
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const e29a::E29aConfig config = small_config(tied);
    auto slab = make_slab(config, cpu, rng);
    const std::int64_t batch = 2, seq = 5;
    const auto ids = random_ids(rng, batch * seq, config.vocab_size);
    auto targets = random_ids(rng, batch * seq, config.vocab_size);
    targets[3] = -100;
    e29a::E29aCpu model(config, *slab, nullptr);
    slab->grad().fill_bytes(0);
    model.forward_backward(ids.data(), targets.data(), batch, seq, 1.0f);
    const auto grads = test::to_host<float>(slab->grad());
    float* w = slab->master().as<float>();
    auto loss_at = [&]() {
      model.forward_loss(ids.data(), targets.data(), batch, seq);
      return static_cast<double>(*model.loss());
    };
    for (const auto& t : slab->layout().tensors()) {
      SCOPED_TRACE(t.spec.name);
      double rms = 0.0;
      for (std::int64_t i = 0; i < t.numel; ++i) rms += double(grads[t.offset + i]) * grads[t.offset + i];
      rms = std::sqrt(rms / static_cast<double>(t.numel));
      EXPECT_GT(rms, 0.0);
      std::uniform_int_distribution<std::int64_t> pick(0, t.numel - 1);
      for (int k = 0; k < 4; ++k) {
        const std::int64_t i = t.offset + pick(rng);
        const float saved = w[i];
        const float h = 1e-2f;
        w[i] = saved + h;
        const double plus = loss_at();
        w[i] = saved - h;
        const double minus = loss_at();
        w[i] = saved;
        const double fd = (plus - minus) / (2.0 * static_cast<double>(h));
        EXPECT_NEAR(grads[i], fd, 3e-2 * std::max(std::fabs(fd), rms)) << "element " << i - t.offset;
      }
    }
  }
}

// Teacher forcing through the decoder: its logits at every position give the training loss.
TEST(E29aModelCpu, DecoderMatchesTrainingForward) {
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext cpu(core::Device::cpu());
  const e29a::E29aConfig config = small_config(false);
  auto slab = make_slab(config, cpu, rng);
  const std::int64_t seq = 9;
  const auto ids = random_ids(rng, seq, config.vocab_size);
  const auto targets = random_ids(rng, seq, config.vocab_size);
  e29a::E29aCpu model(config, *slab, nullptr);
  model.forward_loss(ids.data(), targets.data(), 1, seq);
  const double training_loss = *model.loss();

  e29a::E29aCpuDecoder decoder(config, *slab, cpu, {.max_tokens = seq});
  std::vector<float> all(static_cast<std::size_t>(seq * config.vocab_size));
  decoder.prefill(ids, all.data());
  double loss = 0.0;
  for (std::int64_t t = 0; t < seq; ++t) {
    const float* row = all.data() + t * config.vocab_size;
    double top = -1e300, sum = 0.0;
    for (std::int64_t v = 0; v < config.vocab_size; ++v) top = std::max(top, double(row[v]));
    for (std::int64_t v = 0; v < config.vocab_size; ++v) sum += std::exp(double(row[v]) - top);
    loss += top + std::log(sum) - row[targets[static_cast<std::size_t>(t)]];
  }
  loss /= static_cast<double>(seq);
  EXPECT_NEAR(loss, training_loss, 1e-5 * training_loss);
  const std::vector<float> last(decoder.logits(), decoder.logits() + config.vocab_size);

  // The same prompt in pieces: 4 tokens, then 3, then one step at a time.
  decoder.reset();
  decoder.prefill(std::span<const std::int32_t>(ids.data(), 4));
  decoder.prefill(std::span<const std::int32_t>(ids.data() + 4, 3));
  decoder.step(ids[7]);
  decoder.step(ids[8]);
  EXPECT_EQ(decoder.position(), seq);
  EXPECT_TRUE(
      test::all_close(std::vector<float>(decoder.logits(), decoder.logits() + config.vocab_size), last, 1e-5, 1e-6));
  EXPECT_THROW(decoder.step(ids[0]), core::InputError);
}

}  // namespace
