// The E29a language model on the cpu (models/e29a/model.h) behind the model interface: the
// family's table, presets and Hugging Face names; the whole model's gradients against central
// finite differences of its loss (every tensor kind: embedding, norms, the layer's five, the final
// norm and an untied head); the recurrent decoder against the training forward (teacher-forced
// logits give the same loss) and against itself (a prompt prefilled in pieces or whole); both for
// the pre-norm residual and the normed sum (`residual`), whose config field is parsed, checked and
// carried through config.json.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/device.h"
#include "core/error.h"
#include "models/e29a/family.h"
#include "models/e29a/model.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "optim/initialize.h"
#include "optim/slab.h"
#include "support/test_support.h"

namespace {

namespace e29a = models::e29a;

e29a::E29aConfig small_config(bool tied, e29a::Residual residual = e29a::Residual::pre_norm) {
  e29a::E29aConfig c;
  c.residual = residual;
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
// the estimate) and the O(h^2) truncation, which the estimate at 2h shows (its own is 4x as large,
// so their spread bounds it); a wiring mistake (a missing residual, a wrong tensor, a gradient not
// accumulated) gives O(1) errors. Tolerance: 3e-2 of max(|fd|, rms of the gradient) plus that spread.
void expect_gradients_match_finite_differences(const e29a::E29aConfig& config, std::int64_t batch, std::int64_t seq,
                                               std::mt19937_64& rng) {
  core::DeviceContext cpu(core::Device::cpu());
  auto slab = make_slab(config, cpu, rng);
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
      auto central = [&](float h) {
        w[i] = saved + h;
        const double plus = loss_at();
        w[i] = saved - h;
        const double minus = loss_at();
        w[i] = saved;
        return (plus - minus) / (2.0 * static_cast<double>(h));
      };
      const double fd = central(1e-2f), spread = std::fabs(fd - central(2e-2f));
      EXPECT_NEAR(grads[i], fd, 3e-2 * std::max(std::fabs(fd), rms) + spread) << "element " << i - t.offset;
    }
  }
}

TEST(E29aModelCpu, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    expect_gradients_match_finite_differences(small_config(tied), 2, 5, rng);
  }
}

// The normed sum's backward on sizes that share no factor (D 5, N 3, 3 layers, V 7, 2 x 7 tokens).
TEST(E29aModelCpu, NormedSumGradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    e29a::E29aConfig config = small_config(tied, e29a::Residual::normed_sum);
    config.vocab_size = 7;
    config.hidden_size = 5;
    config.num_layers = 3;
    expect_gradients_match_finite_differences(config, 2, 7, rng);
    expect_gradients_match_finite_differences(small_config(tied, e29a::Residual::normed_sum), 2, 5, rng);
  }
}

// Teacher forcing through the decoder: its logits at every position give the training loss; the
// same prompt in pieces (prefills, then steps) ends at the same logits.
void expect_decoder_matches_training_forward(const e29a::E29aConfig& config, std::mt19937_64& rng) {
  core::DeviceContext cpu(core::Device::cpu());
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

TEST(E29aModelCpu, DecoderMatchesTrainingForward) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const e29a::Residual residual : {e29a::Residual::pre_norm, e29a::Residual::normed_sum}) {
    SCOPED_TRACE(residual == e29a::Residual::pre_norm ? "pre_norm" : "normed_sum");
    expect_decoder_matches_training_forward(small_config(false, residual), rng);
    e29a::E29aConfig odd = small_config(true, residual);
    odd.hidden_size = 5;
    odd.num_layers = 3;
    expect_decoder_matches_training_forward(odd, rng);
  }
}

// model.residual: pre_norm unless set; anything but its two values is refused naming the key, the
// value and both accepted values, in a YAML shape and in a config.json.
TEST(E29aModelCpu, ResidualFieldParsesAndRejects) {
  const models::Family& family = models::family("e29a");
  models::Shape shape = models::base_shape(family, "e29a-tiny");
  EXPECT_EQ(shape["residual"], "pre_norm");
  EXPECT_EQ(e29a::config_from_shape(shape).residual, e29a::Residual::pre_norm);
  shape["residual"] = "normed_sum";
  models::check_shape(family, shape, "test");
  EXPECT_EQ(e29a::config_from_shape(shape).residual, e29a::Residual::normed_sum);
  EXPECT_EQ(e29a::shape_from_config(e29a::config_from_shape(shape))["residual"], "normed_sum");
  // The run option choosing the CUDA recurrence's kernels.
  EXPECT_EQ(shape["recurrence_kernel"], "automatic");
  for (const auto& [name, kernel] : {std::pair{"hybrid", e29a::RecurrenceKernel::hybrid},
                                     std::pair{"persistent", e29a::RecurrenceKernel::persistent}}) {
    models::Shape chosen = shape;
    chosen["recurrence_kernel"] = name;
    models::check_shape(family, chosen, "test");
    EXPECT_EQ(e29a::config_from_shape(chosen).recurrence_kernel, kernel);
    EXPECT_EQ(e29a::shape_from_config(e29a::config_from_shape(chosen))["recurrence_kernel"], name);
  }
  {
    models::Shape wrong = shape;
    wrong["recurrence_kernel"] = "fused";
    try {
      models::check_shape(family, wrong, "test");
      ADD_FAILURE() << "recurrence_kernel fused should be refused";
    } catch (const core::InputError& e) {
      EXPECT_NE(std::string(e.what()).find("recurrence_kernel"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("persistent"), std::string::npos) << e.what();
    }
  }
  // A shape written before the field existed is a pre-norm model.
  models::Shape older = shape;
  older.erase("residual");
  EXPECT_EQ(e29a::config_from_shape(older).residual, e29a::Residual::pre_norm);

  auto refusal = [](const auto& call) {
    try {
      call();
    } catch (const core::InputError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  for (const nlohmann::json& bad : {nlohmann::json("post_norm"), nlohmann::json(1), nlohmann::json("")}) {
    SCOPED_TRACE(bad.dump());
    models::Shape wrong = shape;
    wrong["residual"] = bad;
    const std::string message = refusal([&] { models::check_shape(family, wrong, "test"); });
    EXPECT_NE(message.find("model.residual"), std::string::npos) << message;
    EXPECT_NE(message.find("pre_norm"), std::string::npos) << message;
    EXPECT_NE(message.find("normed_sum"), std::string::npos) << message;
    if (bad.is_string() && !bad.get<std::string>().empty()) {
      EXPECT_NE(message.find(bad.get<std::string>()), std::string::npos) << message;
    }
    nlohmann::json hf = family.spec(shape)->hf_config(nlohmann::json::object());
    hf["residual"] = bad;
    const std::string hf_message =
        refusal([&] { models::shape_from_hf(family, hf, "config.json", models::base_shape(family, "")); });
    EXPECT_NE(hf_message.find("residual"), std::string::npos) << hf_message;
    EXPECT_NE(hf_message.find("normed_sum"), std::string::npos) << hf_message;
  }
}

// config.json carries the residual and reads back to it; a folder without the key (written before
// the field existed) is a pre-norm model.
TEST(E29aModelCpu, ResidualRoundTripsThroughConfigJson) {
  const models::Family& family = models::family("e29a");
  for (const std::string residual : {"pre_norm", "normed_sum"}) {
    SCOPED_TRACE(residual);
    models::Shape shape = models::base_shape(family, "e29a-tiny");
    shape["residual"] = residual;
    const nlohmann::json hf = family.spec(shape)->hf_config(nlohmann::json::object());
    EXPECT_EQ(hf["residual"], residual);
    const models::Shape back = models::shape_from_hf(family, hf, "config.json", models::base_shape(family, ""));
    EXPECT_EQ(back["residual"], residual);
    EXPECT_EQ(models::weights_shape(family, back), models::weights_shape(family, shape));
    // Both kinds have the same tensors.
    EXPECT_EQ(family.spec(back)->parameters().size(),
              family.spec(models::base_shape(family, "e29a-tiny"))->parameters().size());
  }
  nlohmann::json older = family.spec(models::base_shape(family, "e29a-tiny"))->hf_config(nlohmann::json::object());
  older.erase("residual");
  models::Shape base = models::base_shape(family, "");
  base["residual"] = "normed_sum";
  EXPECT_EQ(models::shape_from_hf(family, older, "config.json", base)["residual"], "pre_norm");
}

// The field reaches the model: the same weights give another loss with the normed sum.
TEST(E29aModelCpu, NormedSumChangesTheModel) {
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext cpu(core::Device::cpu());
  const e29a::E29aConfig pre = small_config(true);
  const e29a::E29aConfig normed = small_config(true, e29a::Residual::normed_sum);
  auto slab = make_slab(pre, cpu, rng);
  const auto ids = random_ids(rng, 10, pre.vocab_size);
  const auto targets = random_ids(rng, 10, pre.vocab_size);
  e29a::E29aCpu a(pre, *slab, nullptr), b(normed, *slab, nullptr);
  a.forward_loss(ids.data(), targets.data(), 2, 5);
  b.forward_loss(ids.data(), targets.data(), 2, 5);
  EXPECT_GT(std::fabs(*a.loss() - *b.loss()), 1e-4f);
}

}  // namespace
