// The cpu Qwen3 model against transformers (tests/fixtures/qwen3, made by
// tests/fixtures/make_qwen3_fixture.py): logits, loss and every parameter gradient of a random
// 3-layer model, tied and untied. Tolerance: normwise relative error <= 1e-5 per tensor, and
// every element within 1e-5 of the tensor's largest magnitude. Also the presets, config.json
// reading and safetensors checks.
#include <cmath>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "core/error.h"
#include "support/qwen3/hf_import.h"
#include "models/qwen3/model.h"
#include "models/safetensors.h"
#include "optim/adamw.h"
#include "support/test_support.h"

namespace {

namespace q3 = models::qwen3;
namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return std::string(LLMTRAIN_FIXTURES_DIR) + "/qwen3/" + name; }

::testing::AssertionResult close_normwise(const std::vector<float>& a, const std::vector<float>& b, double tol) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "size " << a.size() << " vs " << b.size();
  double diff = 0, norm = 0, max_ref = 0, max_err = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    diff += d * d;
    norm += static_cast<double>(b[i]) * b[i];
    max_ref = std::max(max_ref, std::fabs(static_cast<double>(b[i])));
    max_err = std::max(max_err, std::fabs(d));
  }
  const double rel = std::sqrt(diff / std::max(norm, 1e-300));
  if (rel <= tol && max_err <= tol * max_ref) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "normwise relative error " << rel << ", max element error " << max_err
                                       << " (largest magnitude " << max_ref << ")";
}

void check_against_transformers(const std::string& name) {
  const std::string folder = fixture(name);
  const q3::Qwen3Config config = q3::read_hf_config(folder);
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(optim::SlabLayout(q3::parameter_specs(config), 1), cpu);
  q3::load_hf_weights(folder, config, slab);
  q3::Qwen3Model model(config, slab);

  const models::SafetensorsFile expected(folder + "/expected.safetensors");
  const auto ids64 = expected.read_i64("input_ids");
  const auto labels = expected.read_i64("labels");
  const auto& shape = expected.entry("input_ids").shape;
  const std::int64_t batch = shape[0], seq = shape[1];
  std::vector<std::int32_t> ids(ids64.begin(), ids64.end());
  // transformers shifts the labels: position t predicts label t + 1; the last one predicts nothing.
  std::vector<std::int32_t> targets(ids.size(), -100);
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t t = 0; t + 1 < seq; ++t) {
      targets[static_cast<std::size_t>(b * seq + t)] =
          static_cast<std::int32_t>(labels[static_cast<std::size_t>(b * seq + t + 1)]);
    }
  }

  std::vector<float> logits(static_cast<std::size_t>(batch * seq * config.vocab_size));
  model.logits(ids, batch, seq, logits);
  EXPECT_TRUE(close_normwise(logits, expected.read_f32("logits"), 1e-5)) << name << ": logits";

  const auto result = model.step(ids, targets, batch, seq, /*backward=*/true);
  const double hf_loss = expected.read_f32("loss")[0];
  EXPECT_NEAR(result.loss, hf_loss, 1e-5 * hf_loss) << name << ": loss";

  const auto& layout = slab.layout();
  for (const auto& [hf_name, loc] : q3::hf_tensor_map(config)) {
    const auto ref = expected.read_f32("grad." + hf_name);
    const auto view = slab.grad_view(layout.find(loc.name));
    const std::int64_t cols = view.rank() == 2 ? view.shape[1] : 1;
    const float* g = view.as<float>() + loc.row_offset * cols;
    const std::vector<float> ours(g, g + ref.size());
    EXPECT_TRUE(close_normwise(ours, ref, 1e-5)) << name << ": gradient of " << hf_name;
  }
}

TEST(Qwen3Cpu, MatchesTransformersTied) { check_against_transformers("tied"); }
TEST(Qwen3Cpu, MatchesTransformersUntied) { check_against_transformers("untied"); }

TEST(Qwen3Cpu, PresetsHaveTheirParameterCounts) {
  const auto small = q3::preset("qwen3-0.6b");
  EXPECT_EQ(small.parameter_count(), 596049920);
  EXPECT_EQ(optim::SlabLayout(q3::parameter_specs(small), 1).parameter_count(), 596049920);
  EXPECT_EQ(q3::preset("qwen3-1.7b").parameter_count(), 1720574976);  // tied; 1.4B without the embedding
  // Hugging Face's published totals: 4.02B (tied) and 8.19B (untied).
  EXPECT_EQ(q3::preset("qwen3-4b").parameter_count(), 4022468096);
  EXPECT_EQ(q3::preset("qwen3-8b").parameter_count(), 8190735360);
  EXPECT_FALSE(q3::preset("qwen3-8b").tie_word_embeddings);
  EXPECT_EQ(q3::preset("qwen3-8b").num_layers, 36);
  EXPECT_THROW(q3::preset("qwen3-7b"), core::InputError);
  for (const auto& name : q3::preset_names()) EXPECT_NO_THROW(q3::validate(q3::preset(name), name));
}

TEST(Qwen3Cpu, TrainingStepsLowerTheLoss) {
  const auto config = q3::preset("qwen3-test");
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(optim::SlabLayout(q3::parameter_specs(config), 1), cpu);
  q3::Qwen3Model model(config, slab);
  model.initialize(7);
  std::vector<std::int32_t> ids(2 * 16), targets(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 37) % 50);
  for (std::size_t i = 0; i < ids.size(); ++i) targets[i] = ids[(i + 1) % ids.size()];
  const double first = model.step(ids, targets, 2, 16, false).loss;
  EXPECT_NEAR(first, std::log(1000.0), 0.3);  // a fresh model predicts about uniformly
  optim::OptimizerConfig oc;
  oc.lr = 1e-2;
  oc.weight_decay = 0.0;
  optim::AdamW adamw(oc, slab, cpu);  // the slab's gradients start at 0 and the step zeroes them
  for (int s = 0; s < 10; ++s) {
    model.step(ids, targets, 2, 16, true);
    adamw.step(oc.lr);
  }
  EXPECT_LT(model.step(ids, targets, 2, 16, false).loss, first - 2.0);
}

TEST(Qwen3Cpu, ConfigAndWeightErrorsNameTheFile) {
  const fs::path dir = fs::temp_directory_path() / ("qwen3_bad_" + std::to_string(test::fresh_seed()));
  fs::create_directories(dir);
  { std::ofstream(dir / "config.json") << R"({"vocab_size": 10, "hidden_size": 8})"; }
  try {
    q3::read_hf_config(dir.string());
    FAIL() << "expected an error";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("config.json: missing key 'intermediate_size'"), std::string::npos)
        << e.what();
  }
  // A weights file with a wrong shape.
  const auto config = q3::read_hf_config(fixture("tied"));
  const std::vector<float> wrong(7, 1.0f);
  models::write_safetensors((dir / "model.safetensors").string(),
                            {{"model.embed_tokens.weight", "F32", {7}, wrong.data()}});
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(optim::SlabLayout(q3::parameter_specs(config), 1), cpu);
  try {
    q3::load_hf_weights(dir.string(), config, slab);
    FAIL() << "expected an error";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "model.safetensors: tensor 'model.embed_tokens.weight' has shape [7], expected [1000, 64]"),
              std::string::npos)
        << e.what();
  }
  // A truncated file.
  const fs::path truncated = dir / "truncated.safetensors";
  fs::copy_file(fixture("tied") + "/model.safetensors", truncated);
  fs::resize_file(truncated, 1000);
  EXPECT_THROW(models::SafetensorsFile(truncated.string()), core::InputError);
  fs::remove_all(dir);
}

TEST(Safetensors, WriteReadRoundTrip) {
  const fs::path path =
      fs::temp_directory_path() / ("roundtrip_" + std::to_string(test::fresh_seed()) + ".safetensors");
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -1e-3f};
  const std::vector<std::int64_t> b = {1, -2, 1LL << 40};
  const std::vector<std::uint16_t> c = {0x3F80, 0xC000};  // bf16 1, -2
  models::write_safetensors(
      path.string(), {{"a", "F32", {2, 3}, a.data()}, {"b", "I64", {3}, b.data()}, {"c", "BF16", {2}, c.data()}});
  const models::SafetensorsFile f(path.string());
  EXPECT_EQ(f.entry("a").shape, (core::Shape{2, 3}));
  EXPECT_EQ(f.read_f32("a"), a);
  EXPECT_EQ(f.read_i64("b"), b);
  EXPECT_EQ(f.read_f32("c"), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_THROW(f.read_f32("b"), core::InputError);
  EXPECT_THROW(f.entry("zz"), core::InputError);
  fs::remove(path);
}

}  // namespace
