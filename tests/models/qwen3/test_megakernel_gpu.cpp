// The Qwen3 decode megakernel (MegakernelDecoder) against the CPU decoder (fp32 on the same
// bf16-rounded weights) and the plain CUDA decoder (Qwen3CudaDecoder), teacher-forced, at every
// position. Tolerances, normwise relative over the vocabulary:
//   vs the CPU decoder 2e-2: the megakernel rounds its activations to bf16 where the plain CUDA
//     decoder does (the same bound as that decoder's against the CPU);
//   vs the plain CUDA decoder 3e-2: the same rounding points, but other summation orders, RoPE
//     from a table and a different attention split, so roundings differ here and there.
// Shapes: the committed fixtures (their sequence, 256 positions, and transformers' fp32 logits
// within 3e-2: its weights are not rounded to bf16), random
// shapes with head_dim 64 and 128, 1, 2, 4 and 8 query heads per kv head, hidden sizes not a
// multiple of 256, tied and untied heads, a 1-token prompt, contexts crossing attention split
// boundaries, several geometries (1 to 11 consumer warps, a 2-page ring, 3 blocks), one launch for
// a whole sequence and one launch per token, the batched prefill then the kernel; a random
// Qwen3-0.6B shape over 1,024 positions. The batched prefill equals the plain decoder's bit for bit.
// Greedy ids equal the plain decoder's wherever its top-2 margin exceeds twice the logits'
// difference; a stress run (four shapes and geometries, 1,500 greedy tokens each) gives the same
// ids and logits bit for bit in one launch and in launches of random lengths, each id the argmax
// of the teacher-forced logits; device sampling equals sample_cpu on the same logits and draws; a wait that never
// ends aborts at the deadline with an error. Suite MegakernelGpu needs only the megakernel and the
// CPU decoder; MegakernelGpuPlain also runs the plain CUDA decoder and models::generate.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/buffer.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "models/generation.h"
#include "models/ops/sampling.h"
#include "models/qwen3/decoder.h"
#include "models/qwen3/decoder_cuda.h"
#include "support/qwen3/hf_import.h"
#include "models/qwen3/megakernel_decoder.h"
#include "models/qwen3/model.h"
#include "models/safetensors.h"
#include "qwen3_gpu_test_model.h"
#include "support/test_support.h"

namespace {

namespace q3 = models::qwen3;

constexpr double kVsCpu = 2e-2;
constexpr double kVsPlain = 3e-2;

#define REQUIRE_CUDA()                                                                         \
  do {                                                                                         \
    if (::core::cuda_device_count() == 0) GTEST_SKIP() << "SKIPPED: no CUDA device available"; \
  } while (0)

std::vector<float> download(const float* device, std::size_t n) {
  std::vector<float> out(n);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(out.data(), device, n * 4, cudaMemcpyDeviceToHost));
  return out;
}

using Model = test::Qwen3GpuTestModel;

// CPU decoder: logits of every position of `ids` (one prefill).
std::vector<float> cpu_logits(Model& m, const std::vector<std::int32_t>& ids) {
  q3::Qwen3CpuDecoder decoder(m.config, *m.host, m.cpu, {.max_tokens = static_cast<std::int64_t>(ids.size())});
  std::vector<float> out(ids.size() * static_cast<std::size_t>(m.config.vocab_size));
  decoder.prefill(ids, out.data());
  return out;
}

// Plain CUDA decoder: prefill of ids[0], then one step per id (fp32 logits of each).
std::vector<float> plain_logits(Model& m, const std::vector<std::int32_t>& ids) {
  const auto v = static_cast<std::size_t>(m.config.vocab_size);
  q3::Qwen3CudaDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = static_cast<std::int64_t>(ids.size())});
  std::vector<float> out(ids.size() * v);
  decoder.prefill({ids.data(), 1});
  for (std::size_t t = 0; t < ids.size(); ++t) {
    if (t > 0) decoder.step(ids[t]);
    const auto row = download(decoder.logits(), v);
    std::copy(row.begin(), row.end(), out.begin() + static_cast<std::ptrdiff_t>(t * v));
  }
  return out;
}

using test::small_config;

std::vector<std::int32_t> random_ids(std::mt19937_64& rng, std::size_t n, std::int64_t vocab) {
  std::vector<std::int32_t> ids(n);
  for (auto& id : ids) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab));
  return ids;
}

std::vector<std::int32_t> fixture_ids(const std::string& name) {
  const models::SafetensorsFile expected(test::qwen3_fixture(name) + "/expected.safetensors");
  const auto ids64 = expected.read_i64("input_ids");
  const std::int64_t seq = expected.entry("input_ids").shape[1];
  return std::vector<std::int32_t>(ids64.begin(), ids64.begin() + seq);
}

// How the megakernel is driven through a sequence: the kernel alone (one launch, one launch per
// token, launches of 7 tokens), or the batched prompt path (prefill) for ids[0, split) and the
// kernel after it (a launch per token, or one launch).
enum class Drive { one_launch, prefill_then_steps, chunks, steps, prefill_then_append };

// Megakernel logits of every position of ids, teacher-forced.
std::vector<float> mega_logits(q3::MegakernelDecoder& decoder, const std::vector<std::int32_t>& ids, Drive drive,
                               std::int64_t vocab, std::size_t split = 1) {
  const auto v = static_cast<std::size_t>(vocab);
  std::vector<float> rows(ids.size() * v);
  decoder.reset();
  core::Buffer all(core::Device::cuda(), ids.size() * v * 4);
  core::Buffer ids_d(core::Device::cuda(), ids.size() * 4);
  CUDA_CHECK(cudaMemcpy(ids_d.data(), ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());  // the decoder's stream does not wait for the legacy one
  if (drive == Drive::one_launch) {
    decoder.append(ids_d.as<std::int32_t>(), static_cast<std::int64_t>(ids.size()), all.as<float>());
    decoder.check();
    rows = download(all.as<float>(), ids.size() * v);
    // logits() holds the last row.
    EXPECT_EQ(download(decoder.logits(), v),
              std::vector<float>(rows.end() - static_cast<std::ptrdiff_t>(v), rows.end()));
  } else if (drive == Drive::steps) {
    for (std::size_t t = 0; t < ids.size(); ++t) {
      decoder.step(ids[t]);
      const auto row = download(decoder.logits(), v);
      std::copy(row.begin(), row.end(), rows.begin() + static_cast<std::ptrdiff_t>(t * v));
    }
    decoder.check();
  } else if (drive == Drive::prefill_then_append) {
    decoder.prefill({ids.data(), split}, all.as<float>());
    if (split < ids.size()) {
      decoder.append(ids_d.as<std::int32_t>() + split, static_cast<std::int64_t>(ids.size() - split),
                     all.as<float>() + split * v);
      decoder.check();
    }
    rows = download(all.as<float>(), ids.size() * v);
  } else if (drive == Drive::prefill_then_steps) {
    decoder.prefill({ids.data(), split}, all.as<float>());
    const auto first = download(all.as<float>(), split * v);
    std::copy(first.begin(), first.end(), rows.begin());
    for (std::size_t t = split; t < ids.size(); ++t) {
      decoder.step(ids[t]);
      const auto row = download(decoder.logits(), v);
      std::copy(row.begin(), row.end(), rows.begin() + static_cast<std::ptrdiff_t>(t * v));
    }
    decoder.check();
  } else {
    // Device ids appended 7 at a time (each launch several tokens).
    for (std::size_t t = 0; t < ids.size(); t += 7) {
      const std::size_t n = std::min<std::size_t>(7, ids.size() - t);
      decoder.append(ids_d.as<std::int32_t>() + t, static_cast<std::int64_t>(n), all.as<float>() + t * v);
    }
    decoder.check();
    rows = download(all.as<float>(), ids.size() * v);
  }
  EXPECT_EQ(decoder.position(), static_cast<std::int64_t>(ids.size()));
  return rows;
}

double worst_rows(const std::vector<float>& got, const std::vector<float>& expected, std::int64_t vocab,
                  std::size_t* at = nullptr) {
  const auto v = static_cast<std::size_t>(vocab);
  double worst = 0;
  for (std::size_t t = 0; t * v < got.size(); ++t) {
    const double e = test::normwise_error(&got[t * v], &expected[t * v], v);
    if (!(e <= worst)) {
      worst = e;
      if (at) *at = t;
    }
  }
  return worst;
}

// Every drive and the given geometries against the CPU decoder (and the plain CUDA decoder when
// `with_plain`: those checks live in the MegakernelGpuPlain suite).
void check_teacher_forcing(Model& m, const std::vector<std::int32_t>& ids, const std::string& what,
                           const std::vector<q3::MegakernelSettings>& geometries, bool with_plain = false) {
  const std::int64_t vocab = m.config.vocab_size;
  const auto n = static_cast<std::int64_t>(ids.size());
  const auto cpu = cpu_logits(m, ids);
  const auto plain = with_plain ? plain_logits(m, ids) : std::vector<float>();
  for (const auto& settings : geometries) {
    q3::MegakernelDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = n}, settings);
    for (Drive drive : {Drive::one_launch, Drive::prefill_then_steps, Drive::chunks, Drive::prefill_then_append}) {
      const auto rows = mega_logits(decoder, ids, drive, vocab, std::min<std::size_t>(3, ids.size()));
      std::size_t at_cpu = 0, at_plain = 0;
      const double vs_cpu = worst_rows(rows, cpu, vocab, &at_cpu);
      const double vs_plain = with_plain ? worst_rows(rows, plain, vocab, &at_plain) : 0.0;
      const std::string where = what + " [" + decoder.describe() + "] drive " + std::to_string(static_cast<int>(drive));
      EXPECT_LE(vs_cpu, kVsCpu) << where << ": vs the cpu decoder at position " << at_cpu;
      if (with_plain) {
        EXPECT_LE(vs_plain, kVsPlain) << where << ": vs the plain cuda decoder at position " << at_plain;
      }
      std::printf("[ mega     ] %s: %lld positions, worst normwise %.3g vs cpu%s\n", where.c_str(),
                  static_cast<long long>(n), vs_cpu,
                  with_plain ? (", " + std::to_string(vs_plain) + " vs plain cuda").c_str() : "");
      // Deterministic: a second pass gives the same bits.
      if (drive == Drive::one_launch) {
        EXPECT_TRUE(rows == mega_logits(decoder, ids, drive, vocab)) << where << ": replay differs";
      }
    }
  }
}

q3::MegakernelSettings geometry(int warps, int page_kb, int pages, int splits, int min_chunk, int blocks = 0) {
  q3::MegakernelSettings s;
  s.consumer_warps = warps;
  s.page_bytes = page_kb * 1024;
  s.pages = pages;
  s.max_splits = splits;
  s.min_chunk = min_chunk;
  s.blocks = blocks;
  s.timeout_seconds = 10.0;
  // Under compute-sanitizer a launch runs orders of magnitude slower: the run sets a longer deadline.
  if (const char* seconds = std::getenv("MEGAKERNEL_TEST_TIMEOUT_S")) s.timeout_seconds = std::atof(seconds);
  return s;
}

// Small chunks and pages: attention splits change every few positions.
const std::vector<q3::MegakernelSettings> kGeometries = {
    geometry(8, 32, 0, 16, 128),     // the default
    geometry(4, 8, 3, 5, 16),        // many splits early: boundaries every 32-64 positions
    geometry(1, 16, 2, 3, 8, 3),     // one consumer warp, a 2-page ring, 3 blocks (multi-page units)
    geometry(11, 16, 0, 32, 1, 17),  // 11 warps (the most), one page per chunk
};

TEST(MegakernelGpu, TinyTeacherForcing) {
  // Also the shape compute-sanitizer runs on (.carry script): 2 layers, 2 blocks, 20 positions.
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  Model m = Model::random_model(small_config(61, 64, 96, 2, 4, 2, 64, false), rng());
  const auto ids = random_ids(rng, 20, m.config.vocab_size);
  check_teacher_forcing(m, ids, "tiny", {geometry(2, 8, 3, 2, 8, 2)});
}

TEST(MegakernelGpu, FixturesMatchCpuAndTransformers) {
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  for (const std::string name : {"tied", "untied"}) {
    Model m = Model::fixture_model(name);
    const auto ids = fixture_ids(name);
    check_teacher_forcing(m, ids, name, kGeometries);
    // transformers' fp32 logits of the same sequence.
    const models::SafetensorsFile expected(test::qwen3_fixture(name) + "/expected.safetensors");
    const auto hf = expected.read_f32("logits");
    q3::MegakernelDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = static_cast<std::int64_t>(ids.size())});
    const auto rows = mega_logits(decoder, ids, Drive::one_launch, m.config.vocab_size);
    const std::vector<float> first(hf.begin(), hf.begin() + static_cast<std::ptrdiff_t>(rows.size()));
    // Its fp32 weights against our bf16 ones: the plain decoder's tolerance.
    const double vs_hf = worst_rows(rows, first, m.config.vocab_size);
    EXPECT_LE(vs_hf, kVsPlain) << name << ": vs transformers";
    std::printf("[ mega     ] %s: worst normwise %.3g vs transformers (fp32 weights)\n", name.c_str(), vs_hf);
    // The fixture's weights to the model's maximum length.
    const auto longer =
        random_ids(rng, static_cast<std::size_t>(m.config.max_position_embeddings), m.config.vocab_size);
    check_teacher_forcing(m, longer, name + " random ids", {kGeometries[0], kGeometries[1]});
  }
}

TEST(MegakernelGpu, AwkwardShapes) {
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  struct Shape {
    std::int64_t vocab, hidden, inter, layers, heads, kv_heads, head_dim;
    bool tied;
  };
  const Shape shapes[] = {{301, 328, 200, 2, 4, 4, 64, true},    // GQA 1, hidden 328
                          {517, 64, 96, 3, 4, 2, 128, false},    // GQA 2, head_dim 128, untied
                          {1000, 136, 232, 2, 8, 2, 64, false},  // GQA 4
                          {257, 96, 64, 1, 8, 1, 128, true}};    // GQA 8, one kv head
  for (const Shape& s : shapes) {
    const auto config = small_config(s.vocab, s.hidden, s.inter, s.layers, s.heads, s.kv_heads, s.head_dim, s.tied);
    Model m = Model::random_model(config, rng());
    const std::string what = "vocab " + std::to_string(s.vocab) + " hidden " + std::to_string(s.hidden) + " heads " +
                             std::to_string(s.heads) + "/" + std::to_string(s.kv_heads) + " head_dim " +
                             std::to_string(s.head_dim) + (s.tied ? " tied" : " untied");
    check_teacher_forcing(m, random_ids(rng, 150, s.vocab), what, kGeometries);
    // A 1-token prompt.
    check_teacher_forcing(m, random_ids(rng, 1, s.vocab), what + ", 1 token", {kGeometries[0], kGeometries[2]});
  }
}

TEST(MegakernelGpu, LongContextCrossesSplits) {
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  // Default geometry: one chunk per kv head up to 128 positions, then up to 16 chunks (12 here).
  Model m = Model::random_model(small_config(64, 64, 64, 1, 2, 1, 64, true), rng());
  const auto ids = random_ids(rng, 4300, m.config.vocab_size);
  const auto cpu = cpu_logits(m, ids);
  q3::MegakernelDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = 4300});
  const auto rows = mega_logits(decoder, ids, Drive::prefill_then_steps, m.config.vocab_size, 4000);
  std::size_t at = 0;
  const double worst = worst_rows(rows, cpu, m.config.vocab_size, &at);
  EXPECT_LE(worst, kVsCpu) << "at position " << at;
  std::printf("[ mega     ] 4.3K context: worst normwise %.3g vs cpu (position %zu)\n", worst, at);
}

// A random Qwen3-0.6B shape: 1,024 positions in one launch equal one launch per position bit for
// bit (the launches' boundaries change nothing), and the first 48 match the CPU decoder.
TEST(MegakernelGpu, Qwen3_06BShapeOneLaunchEqualsSteps) {
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  Model m = Model::random_model(q3::preset("qwen3-0.6b"), rng());
  const std::int64_t vocab = m.config.vocab_size;
  const auto v = static_cast<std::size_t>(vocab);
  const auto ids = random_ids(rng, 1024, vocab);
  q3::MegakernelDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = 1024});
  const auto one = mega_logits(decoder, ids, Drive::one_launch, vocab);
  const auto steps = mega_logits(decoder, ids, Drive::steps, vocab);
  std::size_t differ = 0;
  for (std::size_t t = 0; t < ids.size(); ++t) {
    if (!std::equal(one.begin() + static_cast<std::ptrdiff_t>(t * v),
                    one.begin() + static_cast<std::ptrdiff_t>((t + 1) * v),
                    steps.begin() + static_cast<std::ptrdiff_t>(t * v))) {
      ++differ;
    }
  }
  EXPECT_EQ(differ, 0u) << "positions whose logits differ between one launch and a launch per step";
  const std::vector<std::int32_t> head(ids.begin(), ids.begin() + 48);
  const double vs_cpu = worst_rows(std::vector<float>(one.begin(), one.begin() + static_cast<std::ptrdiff_t>(48 * v)),
                                   cpu_logits(m, head), vocab);
  EXPECT_LE(vs_cpu, kVsCpu);
  std::printf(
      "[ mega     ] qwen3-0.6b shape: 1024 positions, one launch vs per step: %zu differ; 48 positions %.3g vs cpu\n",
      differ, vs_cpu);
}

// The cross-block protocol under load (racecheck sees only shared memory): random shapes, seeds,
// geometries and prompts; 1,500 greedy tokens in one launch and again in launches of random
// lengths must agree bit for bit (ids and the last logits: a lost or early hand-off would change
// some value), and every id must be the argmax of the logits it follows.
TEST(MegakernelGpu, StressLaunchPartitionsAgreeBitForBit) {
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  struct Case {
    std::int64_t hidden, inter, heads, kv_heads, head_dim;
    q3::MegakernelSettings geometry;
  };
  const std::vector<Case> cases = {
      {128, 192, 4, 2, 64, geometry(2, 8, 3, 4, 8, 3)},      // 3 blocks: many units each, a 3-page ring
      {256, 384, 8, 2, 128, geometry(8, 32, 0, 16, 16)},     // the default ring, splits from 16 positions
      {128, 256, 4, 4, 64, geometry(4, 8, 0, 32, 1)},        // a chunk per page: merges every token
      {256, 512, 8, 1, 128, geometry(11, 16, 0, 8, 64, 17)}  // 8 query heads per kv head, 11 warps
  };
  constexpr std::int64_t kNew = 1500;
  for (const Case& c : cases) {
    const q3::Qwen3Config config =
        small_config(301, c.hidden, c.inter, 3, c.heads, c.kv_heads, c.head_dim, (rng() & 1) != 0);
    Model m = Model::random_model(config, rng());
    const std::int64_t vocab = m.config.vocab_size;
    const auto v = static_cast<std::size_t>(vocab);
    const auto prompt = random_ids(rng, 1 + rng() % 40, vocab);
    const std::int64_t total = static_cast<std::int64_t>(prompt.size()) + kNew;
    core::Buffer one_d(core::Device::cuda(), kNew * 4), parts_d(core::Device::cuda(), kNew * 4);

    q3::MegakernelDecoder one(m.config, *m.device, m.gpu, {.max_tokens = total}, c.geometry);
    one.prefill(prompt);
    const auto after_prompt = download(one.logits(), v);
    one.greedy(kNew - 1, one_d.as<std::int32_t>());
    one.check();
    const auto one_last = download(one.logits(), v);

    q3::MegakernelDecoder parts(m.config, *m.device, m.gpu, {.max_tokens = total}, c.geometry);
    parts.prefill(prompt);
    int launches = 0;
    for (std::int64_t fed = 0; fed < kNew - 1; ++launches) {
      const std::int64_t k = std::min<std::int64_t>(kNew - 1 - fed, 1 + static_cast<std::int64_t>(rng() % 200));
      parts.greedy(k, parts_d.as<std::int32_t>() + fed);
      parts.check();
      fed += k;
    }
    const auto parts_last = download(parts.logits(), v);
    std::vector<std::int32_t> ids_one(kNew - 1), ids_parts(kNew - 1);
    CUDA_CHECK(cudaMemcpy(ids_one.data(), one_d.data(), ids_one.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(ids_parts.data(), parts_d.data(), ids_parts.size() * 4, cudaMemcpyDeviceToHost));
    const std::string what = "hidden " + std::to_string(c.hidden) + " heads " + std::to_string(c.heads) + "/" +
                             std::to_string(c.kv_heads) + " [" + one.describe() + "]";
    EXPECT_EQ(ids_one, ids_parts) << what << ": one launch vs " << launches << " launches";
    EXPECT_EQ(one_last, parts_last) << what << ": last logits, one launch vs " << launches << " launches";

    // Teacher forcing the same sequence (the same prompt path, then the kernel in one launch): its
    // logits pick every greedy id after the first. The first is the argmax of the prompt's last
    // logits; the forced run asks the prompt pass for every position's logits, a product of
    // another shape whose rounding may differ (an exact tie in one and not the other was seen).
    std::int64_t wrong = models::ops::sample_cpu({after_prompt.data(), v}, {}, 0.0f) != ids_one[0] ? 1 : 0;
    std::vector<std::int32_t> sequence = prompt;
    sequence.insert(sequence.end(), ids_one.begin(), ids_one.end());
    q3::MegakernelDecoder forced(m.config, *m.device, m.gpu, {.max_tokens = total}, c.geometry);
    const auto rows = mega_logits(forced, sequence, Drive::prefill_then_append, vocab, prompt.size());
    for (std::size_t t = 1; t < ids_one.size(); ++t) {
      const float* row = &rows[(prompt.size() - 1 + t) * v];
      if (models::ops::sample_cpu({row, v}, {}, 0.0f) != ids_one[t]) ++wrong;
    }
    EXPECT_EQ(wrong, 0) << what << ": greedy ids that are not the argmax of the teacher-forced logits";
    std::printf("[ mega     ] stress %s: %lld greedy tokens, one launch = %d launches bit for bit, %lld ids off\n",
                what.c_str(), static_cast<long long>(kNew), launches, static_cast<long long>(wrong));
  }
}

// MegakernelGpuPlain: the checks that run other components too (the plain CUDA decoder,
// models::generate), in their own suite so that a fault there cannot stall the others.

// The fixtures and two awkward shapes against the plain CUDA decoder too.
TEST(MegakernelGpuPlain, TeacherForcingMatchesPlainDecoder) {
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  for (const std::string name : {"tied", "untied"}) {
    Model m = Model::fixture_model(name);
    check_teacher_forcing(m, random_ids(rng, 100, m.config.vocab_size), name, {kGeometries[0], kGeometries[1]}, true);
  }
  for (const auto& config :
       {small_config(301, 328, 200, 2, 4, 4, 64, true), small_config(1000, 136, 232, 2, 8, 2, 64, false)}) {
    Model m = Model::random_model(config, rng());
    check_teacher_forcing(m, random_ids(rng, 100, config.vocab_size), "hidden " + std::to_string(config.hidden_size),
                          {kGeometries[0], kGeometries[1]}, true);
  }
}

TEST(MegakernelGpuPlain, Qwen3_06BShapeOver1024Positions) {
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  auto config = q3::preset("qwen3-0.6b");
  Model m = Model::random_model(config, rng());
  const std::int64_t vocab = config.vocab_size;
  const auto v = static_cast<std::size_t>(vocab);
  const auto ids = random_ids(rng, 1024, vocab);
  q3::MegakernelDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = 1024});
  const auto rows = mega_logits(decoder, ids, Drive::one_launch, vocab);
  const auto plain = plain_logits(m, ids);
  std::size_t at = 0;
  const double vs_plain = worst_rows(rows, plain, vocab, &at);
  EXPECT_LE(vs_plain, kVsPlain) << "at position " << at;
  // The CPU decoder over the first 48 positions (it is slow at this size).
  const std::vector<std::int32_t> head(ids.begin(), ids.begin() + 48);
  const auto cpu = cpu_logits(m, head);
  const double vs_cpu =
      worst_rows(std::vector<float>(rows.begin(), rows.begin() + static_cast<std::ptrdiff_t>(48 * v)), cpu, vocab);
  EXPECT_LE(vs_cpu, kVsCpu);
  std::printf(
      "[ mega     ] qwen3-0.6b shape: 1024 positions worst normwise %.3g vs plain cuda (position %zu), "
      "48 positions %.3g vs cpu\n",
      vs_plain, at, vs_cpu);
}

// Greedy ids of the plain decoder (host argmax per step) and of the megakernel (one launch).
TEST(MegakernelGpuPlain, GreedyMatchesPlainDecoderWhereMarginsAllow) {
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  for (const std::string name : {"tied", "untied"}) {
    Model m = Model::fixture_model(name);
    const std::int64_t vocab = m.config.vocab_size, new_tokens = 200;
    const auto v = static_cast<std::size_t>(vocab);
    const auto prompt = random_ids(rng, 5, vocab);
    const std::int64_t total = static_cast<std::int64_t>(prompt.size()) + new_tokens;
    // Plain: logits before each new token and its argmax.
    q3::Qwen3CudaDecoder plain(m.config, *m.device, m.gpu, {.max_tokens = total});
    plain.prefill(prompt);
    std::vector<std::int32_t> expected;
    std::vector<std::vector<float>> plain_rows;
    for (std::int64_t t = 0; t < new_tokens; ++t) {
      plain_rows.push_back(download(plain.logits(), v));
      expected.push_back(models::ops::sample_cpu(plain_rows.back(), {}, 0.0f));
      if (t + 1 < new_tokens) plain.step(expected.back());
    }
    // Megakernel: prefill, then greedy() feeds new_tokens - 1 ids in one launch.
    q3::MegakernelDecoder mega(m.config, *m.device, m.gpu, {.max_tokens = total});
    core::Buffer ids_d(core::Device::cuda(), static_cast<std::size_t>(new_tokens) * 4);
    mega.prefill(prompt);
    const auto first = download(mega.logits(), v);
    mega.greedy(new_tokens - 1, ids_d.as<std::int32_t>());
    mega.check();
    // The fed ids: the argmax after the prompt, then after each fed id; the last one's argmax
    // follows from logits().
    std::vector<std::int32_t> got(static_cast<std::size_t>(new_tokens - 1));
    CUDA_CHECK(cudaMemcpy(got.data(), ids_d.data(), got.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(got[0], models::ops::sample_cpu(first, {}, 0.0f));
    got.push_back(models::ops::sample_cpu(download(mega.logits(), v), {}, 0.0f));
    // The megakernel's own logits on the plain decoder's sequence, to judge the margins.
    std::vector<std::int32_t> sequence = prompt;
    sequence.insert(sequence.end(), expected.begin(), expected.end() - 1);
    q3::MegakernelDecoder forced(m.config, *m.device, m.gpu, {.max_tokens = total});
    const auto rows = mega_logits(forced, sequence, Drive::prefill_then_append, vocab, prompt.size());
    std::int64_t agreed = 0;
    for (std::int64_t t = 0; t < new_tokens; ++t) {
      const auto& p = plain_rows[static_cast<std::size_t>(t)];
      const float* mk = &rows[(prompt.size() + static_cast<std::size_t>(t) - 1) * v];
      std::vector<float> sorted(p);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      double diff = 0;
      for (std::size_t i = 0; i < v; ++i) diff = std::max(diff, std::fabs(static_cast<double>(mk[i]) - p[i]));
      if (got[static_cast<std::size_t>(t)] != expected[static_cast<std::size_t>(t)]) {
        EXPECT_LE(sorted[0] - sorted[1], 2 * diff) << name << ": greedy ids differ at new token " << t
                                                   << " although the top-2 margin exceeds twice the logits' difference";
        break;  // the sequences part here
      }
      // The kernel's argmax is the argmax of its own logits.
      EXPECT_EQ(got[static_cast<std::size_t>(t)], models::ops::sample_cpu({mk, v}, {}, 0.0f)) << name << " token " << t;
      ++agreed;
    }
    std::printf("[ mega     ] %s: greedy ids agree with the plain decoder for %lld of %lld new tokens\n", name.c_str(),
                static_cast<long long>(agreed), static_cast<long long>(new_tokens));
    EXPECT_GE(agreed, 1);
  }
}

TEST(MegakernelGpuPlain, DeviceSamplingEqualsHostReference) {  // through models::generate
  REQUIRE_CUDA();
  Model m = Model::fixture_model("tied");
  const std::vector<std::int32_t> prompt = {5, 17, 300, 999, 0};
  const std::int64_t new_tokens = 40, vocab = m.config.vocab_size;
  for (const models::ops::SamplingParams params :
       {models::ops::SamplingParams{}, models::ops::SamplingParams{.temperature = 1.3f, .top_k = 50, .top_p = 0.95f}}) {
    q3::MegakernelDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = 50});
    models::GenerationOptions options;
    options.max_new_tokens = new_tokens;
    options.sampling = params;
    options.seed = 77;
    const auto result = models::generate(decoder, m.gpu, vocab, prompt, options);
    decoder.check();
    q3::MegakernelDecoder host_driven(m.config, *m.device, m.gpu, {.max_tokens = 50});
    host_driven.prefill(prompt);
    std::vector<std::int32_t> expected;
    for (std::int64_t t = 0; t < new_tokens; ++t) {
      const auto logits = download(host_driven.logits(), static_cast<std::size_t>(vocab));
      expected.push_back(
          models::ops::sample_cpu(logits, params, models::ops::sampling_uniform(77, static_cast<std::uint64_t>(t))));
      if (t + 1 < new_tokens) host_driven.step(expected.back());
    }
    EXPECT_EQ(result.ids, expected) << "temperature " << params.temperature;
  }
}

// The batched prompt path: the megakernel's prefill runs the plain decoder's (Qwen3CudaPrefill)
// into its own cache layout, so its logits equal the plain decoder's bit for bit, in one chunk or
// many (later chunks attend over the cache in each layout) and after earlier tokens; the kernel
// then continues from that cache (teacher-forced steps within the usual tolerance of the plain
// decoder's steps) and greedy() starts from the argmax of the prompt's logits.
TEST(MegakernelGpuPlain, BatchedPrefillEqualsPlainDecoder) {
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  std::vector<Model> models;
  models.push_back(Model::fixture_model("untied"));
  models.push_back(Model::random_model(small_config(1000, 136, 232, 2, 8, 2, 64, false), rng()));
  models.push_back(Model::random_model(small_config(257, 96, 64, 2, 8, 1, 128, true), rng()));
  models.push_back(Model::random_model(small_config(517, 64, 96, 3, 4, 2, 128, false), rng()));
  for (Model& m : models) {
    const std::int64_t vocab = m.config.vocab_size;
    const auto v = static_cast<std::size_t>(vocab);
    for (const std::int64_t chunk : {std::int64_t{4096}, std::int64_t{16}}) {
      for (const std::size_t length : {std::size_t{1}, std::size_t{37}, std::size_t{150}}) {
        const auto prompt = random_ids(rng, length, vocab);
        const auto more = random_ids(rng, 20, vocab);
        const auto later = random_ids(rng, 9, vocab);
        const std::int64_t total = static_cast<std::int64_t>(length + more.size() + later.size() + 1);
        q3::CudaDecoderSettings plain_settings;
        plain_settings.max_prefill_chunk = chunk;
        q3::MegakernelSettings mega_settings = geometry(8, 32, 0, 16, 128);
        mega_settings.max_prefill_chunk = chunk;
        q3::Qwen3CudaDecoder plain(m.config, *m.device, m.gpu, {.max_tokens = total}, plain_settings);
        q3::MegakernelDecoder mega(m.config, *m.device, m.gpu, {.max_tokens = total}, mega_settings);
        const std::string what = "hidden " + std::to_string(m.config.hidden_size) + " heads " +
                                 std::to_string(m.config.num_heads) + "/" + std::to_string(m.config.num_kv_heads) +
                                 " prompt " + std::to_string(length) + " chunk " + std::to_string(chunk);
        core::Buffer plain_all(core::Device::cuda(), length * v * 4), mega_all(core::Device::cuda(), length * v * 4);
        plain.prefill(prompt, plain_all.as<float>());
        mega.prefill(prompt, mega_all.as<float>());
        EXPECT_EQ(download(plain_all.as<float>(), length * v), download(mega_all.as<float>(), length * v)) << what;
        const auto last = download(mega.logits(), v);
        EXPECT_EQ(download(plain.logits(), v), last) << what << ": last logits";
        // Teacher-forced steps on each cache.
        std::vector<float> plain_rows, mega_rows;
        for (const std::int32_t id : more) {
          plain.step(id);
          mega.step(id);
          const auto p = download(plain.logits(), v), k = download(mega.logits(), v);
          plain_rows.insert(plain_rows.end(), p.begin(), p.end());
          mega_rows.insert(mega_rows.end(), k.begin(), k.end());
        }
        mega.check();
        EXPECT_LE(worst_rows(mega_rows, plain_rows, vocab), kVsPlain) << what << ": steps after the prompt";
        // A second prompt after those tokens: attends over both earlier parts, in each layout.
        plain.prefill(later);
        mega.prefill(later);
        const auto second = download(mega.logits(), v);
        EXPECT_LE(test::normwise_error(second.data(), download(plain.logits(), v).data(), v), kVsPlain)
            << what << ": a prompt after earlier tokens";
        // greedy() starts from the prompt's argmax.
        core::Buffer id_d(core::Device::cuda(), 4);
        mega.greedy(1, id_d.as<std::int32_t>());
        mega.check();
        std::int32_t id = -1;
        CUDA_CHECK(cudaMemcpy(&id, id_d.data(), 4, cudaMemcpyDeviceToHost));
        EXPECT_EQ(id, models::ops::sample_cpu(second, {}, 0.0f)) << what << ": the first greedy id";
        EXPECT_EQ(mega.position(), total);  // the greedy token appended too
      }
    }
  }
}

TEST(MegakernelGpu, WholeMirrorGivesTheSlabsLogits) {  // ZeRO-3's decode
  REQUIRE_CUDA();
  std::mt19937_64 rng(test::fresh_seed());
  Model m = Model::fixture_model("tied");
  test::expect_whole_mirror_gives_the_slabs_logits(m, random_ids(rng, 12, m.config.vocab_size), [&](auto options) {
    return std::make_unique<q3::MegakernelDecoder>(m.config, *m.device, m.gpu, options);
  });
}

TEST(MegakernelGpu, StalledWaitAbortsAtTheDeadline) {
  REQUIRE_CUDA();
  Model m = Model::fixture_model("untied");
  const auto ids = fixture_ids("untied");
  q3::MegakernelSettings settings;
  settings.timeout_seconds = 0.05;
  q3::MegakernelDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = 64}, settings);
  decoder.prefill({ids.data(), 4});
  const auto before = download(decoder.logits(), static_cast<std::size_t>(m.config.vocab_size));
  decoder.stall_next_launch();
  decoder.greedy(3);
  try {
    decoder.check();
    FAIL() << "expected the launch to abort";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("waited"), std::string::npos) << e.what();
    std::printf("[ mega     ] %s\n", e.what());
  }
  // Later launches leave at once until a reset; after it the decoder works again.
  decoder.reset();
  decoder.prefill({ids.data(), 4});
  EXPECT_EQ(download(decoder.logits(), static_cast<std::size_t>(m.config.vocab_size)), before);
}

TEST(MegakernelGpu, CapacityAndErrors) {
  REQUIRE_CUDA();
  Model m = Model::fixture_model("tied");
  const auto ids = fixture_ids("tied");
  q3::MegakernelDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = 7});
  EXPECT_EQ(decoder.capacity(), 7);
  EXPECT_EQ(decoder.cache_bytes(), 2u * 3 * 7 * (2 * 64) * 2);
  EXPECT_THROW(decoder.greedy(2), core::InputError);  // no logits yet
  EXPECT_THROW(decoder.prefill({ids.data(), 8}), core::InputError);
  EXPECT_THROW(decoder.prefill({}), core::InputError);
  const std::vector<std::int32_t> bad = {1, 1000};
  EXPECT_THROW(decoder.prefill(bad), core::InputError);
  decoder.prefill({ids.data(), 1});
  for (int t = 1; t < 7; ++t) decoder.step(ids[t]);
  EXPECT_EQ(decoder.position(), 7);
  EXPECT_THROW(decoder.step(ids[7]), core::InputError);
  EXPECT_THROW(q3::MegakernelDecoder(m.config, *m.device, m.gpu, {.max_tokens = 0}), core::InputError);
  const auto odd = small_config(50, 64, 64, 1, 2, 1, 96, true);
  optim::Slab odd_slab(optim::SlabLayout(q3::parameter_specs(odd), 1), m.gpu);
  EXPECT_THROW(q3::MegakernelDecoder(odd, odd_slab, m.gpu, {.max_tokens = 4}), core::InputError);
  const auto wide = small_config(50, 64, 64, 1, 12, 1, 64, true);  // 12 query heads per kv head
  optim::Slab wide_slab(optim::SlabLayout(q3::parameter_specs(wide), 1), m.gpu);
  EXPECT_THROW(q3::MegakernelDecoder(wide, wide_slab, m.gpu, {.max_tokens = 4}), core::InputError);
}

}  // namespace
