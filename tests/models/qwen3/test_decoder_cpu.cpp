// The cpu Qwen3 decoder (KV cache) against the full forward (Qwen3Model::logits): teacher-forced
// logits of every position, from one prefill, from a prefill continued in pieces and from single
// steps, within 1e-5 normwise relative (the same double-accumulated ops: in practice identical),
// for the committed transformers fixtures (tied and untied) and random-weight shapes with awkward
// sizes; greedy generation equal to transformers' generate(do_sample=False) ids for the fixtures
// (tests/fixtures/qwen3/*/generate.json, made by make_generate_fixture.py); cache sizing, overflow
// and id errors; reset and reuse.
#include <cmath>
#include <fstream>
#include <random>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "models/generation.h"
#include "models/qwen3/decoder.h"
#include "models/qwen3/family.h"
#include "support/qwen3/hf_import.h"
#include "models/qwen3/model.h"
#include "models/safetensors.h"
#include "support/test_support.h"

namespace {

namespace q3 = models::qwen3;

std::string fixture(const std::string& name) { return std::string(LLMTRAIN_FIXTURES_DIR) + "/qwen3/" + name; }

struct Model {
  q3::Qwen3Config config;
  core::DeviceContext cpu{core::Device::cpu()};
  std::unique_ptr<optim::Slab> slab;

  explicit Model(const q3::Qwen3Config& c) : config(c) {
    slab = std::make_unique<optim::Slab>(optim::SlabLayout(q3::parameter_specs(config), 1), cpu);
  }
  static Model fixture_model(const std::string& name) {
    Model m(q3::read_hf_config(fixture(name)));
    q3::load_hf_weights(fixture(name), m.config, *m.slab);
    return m;
  }
  // Random weights, with the norm weights away from 1 so that they matter.
  static Model random_model(const q3::Qwen3Config& config, std::uint64_t seed) {
    Model m(config);
    q3::Qwen3Model(config, *m.slab).initialize(seed);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> noise(0.0f, 0.2f);
    const auto& tensors = m.slab->layout().tensors();
    float* master = m.slab->master().as<float>();
    for (const auto& t : tensors) {
      if (t.spec.name.find("norm") == std::string::npos) continue;
      for (std::int64_t i = 0; i < t.numel; ++i) master[t.offset + i] += noise(rng);
    }
    return m;
  }
  std::vector<float> full_logits(const std::vector<std::int32_t>& ids) {
    q3::Qwen3Model model(config, *slab);
    std::vector<float> out(ids.size() * static_cast<std::size_t>(config.vocab_size));
    model.logits(ids, 1, static_cast<std::int64_t>(ids.size()), out);
    return out;
  }
};

// Teacher forcing: the decoder's logits after prefill(ids[0, split)) (all rows) and then one
// step per remaining id equal the full forward's rows.
void check_teacher_forcing(Model& m, const std::vector<std::int32_t>& ids, std::size_t split, const std::string& what) {
  const auto vocab = static_cast<std::size_t>(m.config.vocab_size);
  const std::vector<float> full = m.full_logits(ids);
  q3::Qwen3CpuDecoder decoder(m.config, *m.slab, m.cpu, {.max_tokens = static_cast<std::int64_t>(ids.size())});
  std::vector<float> prefilled(split * vocab);
  decoder.prefill({ids.data(), split}, prefilled.data());
  double worst = 0;
  for (std::size_t t = 0; t < split; ++t)
    worst = std::max(worst, test::normwise_error(&prefilled[t * vocab], &full[t * vocab], vocab));
  worst = std::max(worst, test::normwise_error(decoder.logits(), &full[(split - 1) * vocab], vocab));
  for (std::size_t t = split; t < ids.size(); ++t) {
    decoder.step(ids[t]);
    ASSERT_EQ(decoder.position(), static_cast<std::int64_t>(t + 1));
    const double e = test::normwise_error(decoder.logits(), &full[t * vocab], vocab);
    EXPECT_LE(e, 1e-5) << what << ": step at position " << t;
    worst = std::max(worst, e);
  }
  EXPECT_LE(worst, 1e-5) << what;
  std::printf("[ decoder  ] %s: prefill %zu + %zu steps, worst normwise error %.3g\n", what.c_str(), split,
              ids.size() - split, worst);
}

std::vector<std::int32_t> fixture_ids(const std::string& name) {
  const models::SafetensorsFile expected(fixture(name) + "/expected.safetensors");
  const auto ids64 = expected.read_i64("input_ids");
  const std::int64_t seq = expected.entry("input_ids").shape[1];
  return std::vector<std::int32_t>(ids64.begin(), ids64.begin() + seq);  // the first sequence
}

TEST(DecoderCpu, TeacherForcingMatchesFullForwardOnFixtures) {
  for (const std::string name : {"tied", "untied"}) {
    Model m = Model::fixture_model(name);
    const auto ids = fixture_ids(name);
    for (std::size_t split : {std::size_t{1}, std::size_t{5}, ids.size()}) {
      check_teacher_forcing(m, ids, split, name + " split " + std::to_string(split));
    }
    // And the decoder's prefill logits against transformers' logits of that sequence.
    const models::SafetensorsFile expected(fixture(name) + "/expected.safetensors");
    const auto hf = expected.read_f32("logits");
    q3::Qwen3CpuDecoder decoder(m.config, *m.slab, m.cpu, {.max_tokens = static_cast<std::int64_t>(ids.size())});
    std::vector<float> ours(ids.size() * static_cast<std::size_t>(m.config.vocab_size));
    decoder.prefill(ids, ours.data());
    EXPECT_LE(test::normwise_error(ours.data(), hf.data(), ours.size()), 1e-5) << name << ": vs transformers";
  }
}

TEST(DecoderCpu, TeacherForcingMatchesFullForwardOnRandomShapes) {
  const std::uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  struct Shape {
    std::int64_t vocab, hidden, inter, layers, heads, kv_heads, head_dim;
    bool tied;
  };
  const Shape shapes[] = {{37, 24, 36, 2, 3, 1, 8, true},     // odd vocabulary, 3 query heads on 1 kv head
                          {101, 40, 52, 3, 4, 4, 10, false},  // no grouping, head_dim 10
                          {64, 32, 33, 1, 6, 2, 6, false},    // odd intermediate
                          {300, 64, 96, 2, 8, 2, 16, true}};
  for (const Shape& s : shapes) {
    q3::Qwen3Config c;
    c.vocab_size = s.vocab;
    c.hidden_size = s.hidden;
    c.intermediate_size = s.inter;
    c.num_layers = s.layers;
    c.num_heads = s.heads;
    c.num_kv_heads = s.kv_heads;
    c.head_dim = s.head_dim;
    c.tie_word_embeddings = s.tied;
    c.rope_theta = 500.0;  // short wavelengths: positions matter at these lengths
    c.max_position_embeddings = 128;
    Model m = Model::random_model(c, rng());
    std::vector<std::int32_t> ids(23);
    for (auto& id : ids) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(s.vocab));
    const std::string what = "vocab " + std::to_string(s.vocab) + " hidden " + std::to_string(s.hidden) + " heads " +
                             std::to_string(s.heads) + "/" + std::to_string(s.kv_heads);
    check_teacher_forcing(m, ids, 1, what);
    check_teacher_forcing(m, ids, 9, what);
    // A prefill continued in pieces (several new tokens over a filled cache).
    const auto vocab = static_cast<std::size_t>(c.vocab_size);
    const std::vector<float> full = m.full_logits(ids);
    q3::Qwen3CpuDecoder decoder(c, *m.slab, m.cpu, {.max_tokens = 23});
    std::vector<float> rows(ids.size() * vocab);
    std::size_t done = 0;
    for (std::size_t piece : {4, 7, 1, 11}) {
      decoder.prefill({ids.data() + done, piece}, rows.data() + done * vocab);
      done += piece;
    }
    EXPECT_LE(test::normwise_error(rows.data(), full.data(), rows.size()), 1e-5) << what << ": prefill in pieces";
  }
}

TEST(DecoderCpu, CacheSizedByMaxTokensAndOverflowRefused) {
  Model m = Model::fixture_model("tied");
  const auto ids = fixture_ids("tied");
  q3::Qwen3CpuDecoder decoder(m.config, *m.slab, m.cpu, {.max_tokens = 7});
  EXPECT_EQ(decoder.capacity(), 7);
  EXPECT_EQ(decoder.cache_bytes(), 2u * 3 * 7 * (2 * 64) * sizeof(float));  // k and v, 3 layers, 2 kv heads of 64
  EXPECT_THROW(decoder.prefill({ids.data(), 8}), core::InputError);
  EXPECT_EQ(decoder.position(), 0);
  decoder.prefill({ids.data(), 6});
  decoder.step(ids[6]);
  EXPECT_EQ(decoder.position(), 7);
  try {
    decoder.step(ids[7]);
    FAIL() << "expected an error";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("exceed its capacity of 7"), std::string::npos) << e.what();
  }
  const std::vector<float> last(decoder.logits(), decoder.logits() + m.config.vocab_size);
  // reset keeps the capacity; the same tokens give the same logits.
  decoder.reset();
  EXPECT_EQ(decoder.position(), 0);
  decoder.prefill({ids.data(), 3});
  for (int t = 3; t < 7; ++t) decoder.step(ids[t]);
  EXPECT_EQ(std::vector<float>(decoder.logits(), decoder.logits() + m.config.vocab_size), last);
  // Ids outside the vocabulary, an empty prefill, no capacity.
  decoder.reset();
  const std::vector<std::int32_t> bad = {1, 1000};
  EXPECT_THROW(decoder.prefill(bad), core::InputError);
  EXPECT_THROW(decoder.prefill({}), core::InputError);
  EXPECT_THROW(q3::Qwen3CpuDecoder(m.config, *m.slab, m.cpu, {.max_tokens = 0}), core::InputError);
}

TEST(DecoderCpu, GreedyIdsEqualTransformersGenerate) {
  for (const std::string name : {"tied", "untied"}) {
    std::ifstream file(fixture(name) + "/generate.json");
    ASSERT_TRUE(file) << "missing " << fixture(name) << "/generate.json (tests/fixtures/make_generate_fixture.py)";
    const auto expected = nlohmann::json::parse(file);
    const auto prompt = expected.at("prompt_ids").get<std::vector<std::int32_t>>();
    const auto ids = expected.at("ids").get<std::vector<std::int32_t>>();
    const std::int64_t max_length = expected.at("max_length").get<std::int64_t>();
    Model m = Model::fixture_model(name);
    ASSERT_EQ(max_length, m.config.max_position_embeddings);
    q3::Qwen3CpuDecoder decoder(m.config, *m.slab, m.cpu, {.max_tokens = max_length});
    models::GenerationOptions options;
    options.max_new_tokens = max_length - static_cast<std::int64_t>(prompt.size());
    const auto result = models::generate(decoder, m.cpu, m.config.vocab_size, prompt, options);
    std::vector<std::int32_t> ours = prompt;
    ours.insert(ours.end(), result.ids.begin(), result.ids.end());
    ASSERT_EQ(ours.size(), ids.size());
    std::size_t first = 0;
    while (first < ids.size() && ours[first] == ids[first]) ++first;
    EXPECT_EQ(ours, ids) << name << ": first difference at position " << first;
    std::printf("[ generate ] %s: %zu greedy tokens equal transformers', prefill %.2f ms, decode %.1f tok/s\n",
                name.c_str(), result.ids.size(), result.prefill_seconds * 1e3,
                static_cast<double>(result.ids.size()) / result.decode_seconds);
  }
}

TEST(DecoderCpu, GenerationIsSeededAndStopsOnStopIds) {
  Model m = Model::fixture_model("untied");
  q3::Qwen3CpuDecoder decoder(m.config, *m.slab, m.cpu, {.max_tokens = 40});
  const std::vector<std::int32_t> prompt = {5, 17, 300};
  models::GenerationOptions options;
  options.max_new_tokens = 30;
  options.sampling = {.temperature = 1.5f, .top_k = 50, .top_p = 0.95f};
  options.seed = 1234;
  const auto a = models::generate(decoder, m.cpu, m.config.vocab_size, prompt, options);
  const auto b = models::generate(decoder, m.cpu, m.config.vocab_size, prompt, options);
  EXPECT_EQ(a.ids.size(), 30u);
  EXPECT_EQ(a.ids, b.ids);
  options.seed = 1235;
  EXPECT_NE(models::generate(decoder, m.cpu, m.config.vocab_size, prompt, options).ids, a.ids);
  // Stop at the first occurrence of the 5th token: the output ends with it.
  options.seed = 1234;
  options.stop_ids = {a.ids[4]};
  const auto stopped = models::generate(decoder, m.cpu, m.config.vocab_size, prompt, options);
  EXPECT_TRUE(stopped.stopped);
  EXPECT_LE(stopped.ids.size(), 5u);
  EXPECT_EQ(stopped.ids.back(), a.ids[4]);
  EXPECT_EQ(stopped.ids, std::vector<std::int32_t>(a.ids.begin(), a.ids.begin() + stopped.ids.size()));
  // More than the capacity is refused before any work.
  options.max_new_tokens = 38;
  EXPECT_THROW(models::generate(decoder, m.cpu, m.config.vocab_size, prompt, options), core::InputError);
}

TEST(DecoderCpu, FamilyHookGivesTheKvCacheDecoder) {
  Model m = Model::fixture_model("untied");
  const auto spec = q3::qwen3_family().spec(q3::shape_from_config(m.config));
  const auto decoder = spec->decoder(*m.slab, m.cpu, {.max_tokens = 9});
  ASSERT_NE(dynamic_cast<q3::Qwen3CpuDecoder*>(decoder.get()), nullptr);
  EXPECT_EQ(decoder->capacity(), 9);
  // The hook's decoder gives the full forward's logits.
  const auto ids = fixture_ids("untied");
  const std::vector<std::int32_t> prompt(ids.begin(), ids.begin() + 9);
  const auto full = m.full_logits(prompt);
  decoder->prefill({prompt.data(), 4});
  for (std::size_t t = 4; t < prompt.size(); ++t) decoder->step(prompt[t]);
  const auto vocab = static_cast<std::size_t>(m.config.vocab_size);
  EXPECT_LE(test::normwise_error(decoder->logits(), &full[8 * vocab], vocab), 1e-5);
}

}  // namespace
