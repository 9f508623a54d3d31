// The CUDA Qwen3 decoder (Qwen3CudaDecoder) and its step kernels.
// - Teacher forcing: the logits of a prefill (every row) and of each following step equal the
//   full forward's (the CPU fp32 model on the same bf16-rounded weights, and the CUDA bf16 full
//   forward) within 2e-2 normwise relative, for the committed fixtures (splits 1, 5 and all) and
//   random shapes with odd vocabularies and 1, 3, 5 and 12 query heads per kv head, over contexts
//   crossing the attention's split boundaries (32 keys, and 34 at a 4.3K context), a 1-token
//   prompt and prefills split into chunks.
// - The graph-captured step and the launched one give bit-identical logits; reset and replay too;
//   a device-resident token gives the same logits as the host one.
// - generate() on cuda (ids sampled on the device, never on the host) equals a host loop that
//   samples the same logits with sample_cpu and the same draws.
// - Each decode:: kernel against a plain CPU reference on awkward sizes (see the tolerances at
//   each check: bf16 outputs within their rounding plus fp32 accumulation).
// - Capacity and id errors, and the cache sized by max_tokens.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/buffer.h"
#include "core/error.h"
#include "core/half.h"
#include "models/generation.h"
#include "models/ops/sampling.h"
#include "models/qwen3/decoder_cuda.h"
#include "models/qwen3/family.h"
#include "support/qwen3/hf_import.h"
#include "models/qwen3/model.h"
#include "models/qwen3/model_cuda.h"
#include "models/safetensors.h"
#include "support/gpu_watchdog.h"
#include "qwen3_gpu_test_model.h"
#include "support/test_support.h"

namespace {

namespace q3 = models::qwen3;
namespace decode = models::qwen3::decode;
using decode::bf16;
using Bits = std::vector<std::uint16_t>;

constexpr double kLogitsTolerance = 2e-2;  // bf16 activations, normwise relative
constexpr double kHalfUlp = 1.0 / 256;     // bf16 rounding, relative (half of 2^-7)
constexpr std::uint16_t kPoison = 0xFFFF;  // a bf16 NaN

float round_bf16(double v) { return core::bf16_to_float(core::float_to_bf16(static_cast<float>(v))); }

Bits to_bits(const std::vector<float>& v) {
  Bits out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = core::float_to_bf16(v[i]);
  return out;
}
std::vector<float> to_floats(const Bits& bits) {
  std::vector<float> out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) out[i] = core::bf16_to_float(bits[i]);
  return out;
}

template <typename T>
core::Buffer device_copy(const std::vector<T>& values) {
  core::Buffer buffer(core::Device::cuda(), std::max<std::size_t>(values.size(), 1) * sizeof(T));
  if (!values.empty()) test::from_host(buffer, values);
  return buffer;
}
template <typename T>
T* ptr(core::Buffer& b) {
  return static_cast<T*>(b.data());
}

using Model = test::Qwen3GpuTestModel;

// CPU fp32 full forward of `ids` (every position).
std::vector<float> cpu_logits(Model& m, const std::vector<std::int32_t>& ids) {
  q3::Qwen3Model model(m.config, *m.host);
  std::vector<float> out(ids.size() * static_cast<std::size_t>(m.config.vocab_size));
  model.logits(ids, 1, static_cast<std::int64_t>(ids.size()), out);
  return out;
}

// CUDA bf16 full forward of `ids`.
std::vector<float> cuda_logits(Model& m, const std::vector<std::int32_t>& ids) {
  const auto n = static_cast<std::int64_t>(ids.size());
  q3::Qwen3Cuda model(m.config, *m.device, m.gpu, n, q3::Recompute::none);
  core::Buffer ids_d = device_copy(ids);
  core::Buffer out(m.gpu.device(), static_cast<std::size_t>(n * m.config.vocab_size) * 2);
  model.logits(ptr<std::int32_t>(ids_d), 1, n, ptr<std::uint16_t>(out));
  m.gpu.synchronize();
  return to_floats(test::to_host<std::uint16_t>(out));
}

using test::small_config;

std::vector<float> host_logits(const models::Decoder& decoder, std::int64_t vocab) {
  std::vector<float> out(static_cast<std::size_t>(vocab));
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(out.data(), decoder.logits(), out.size() * 4, cudaMemcpyDeviceToHost));
  return out;
}

// Teacher forcing through `decoder`: prefill ids[0, split) with all rows, then a step per
// remaining id. Returns the logits of every position [ids, vocab].
std::vector<float> teacher_forced(q3::Qwen3CudaDecoder& decoder, const std::vector<std::int32_t>& ids,
                                  std::size_t split, std::int64_t vocab) {
  const auto v = static_cast<std::size_t>(vocab);
  std::vector<float> rows(ids.size() * v);
  core::Buffer prefilled(core::Device::cuda(), split * v * 4);
  decoder.reset();
  decoder.prefill({ids.data(), split}, ptr<float>(prefilled));
  const auto first = test::to_host<float>(prefilled);
  std::copy(first.begin(), first.end(), rows.begin());
  // The last prefill row is the decoder's logits (from the matrix-vector head, not the GEMM).
  const auto last = host_logits(decoder, vocab);
  EXPECT_LE(test::normwise_error(last.data(), &rows[(split - 1) * v], v), kLogitsTolerance) << "prefill's last row";
  for (std::size_t t = split; t < ids.size(); ++t) {
    decoder.step(ids[t]);
    EXPECT_EQ(decoder.position(), static_cast<std::int64_t>(t + 1));
    const auto step = host_logits(decoder, vocab);
    std::copy(step.begin(), step.end(), rows.begin() + static_cast<std::ptrdiff_t>(t * v));
  }
  return rows;
}

// Worst normwise error of rows [from, to) of `got` against `expected`.
double worst_rows(const std::vector<float>& got, const std::vector<float>& expected, std::int64_t vocab,
                  std::size_t from, std::size_t to, std::size_t* at = nullptr) {
  const auto v = static_cast<std::size_t>(vocab);
  double worst = 0;
  for (std::size_t t = from; t < to; ++t) {
    const double e = test::normwise_error(&got[t * v], &expected[t * v], v);
    if (e > worst) {
      worst = e;
      if (at) *at = t;
    }
  }
  return worst;
}

void check_teacher_forcing(Model& m, const std::vector<std::int32_t>& ids, const std::vector<std::size_t>& splits,
                           const std::string& what, q3::CudaDecoderSettings settings = {}) {
  const std::int64_t vocab = m.config.vocab_size;
  const auto cpu = cpu_logits(m, ids);
  const auto cuda = cuda_logits(m, ids);
  const auto n = static_cast<std::int64_t>(ids.size());
  q3::Qwen3CudaDecoder graphed(m.config, *m.device, m.gpu, {.max_tokens = n}, settings);
  settings.cuda_graph = false;
  q3::Qwen3CudaDecoder launched(m.config, *m.device, m.gpu, {.max_tokens = n}, settings);
  for (std::size_t split : splits) {
    const auto rows = teacher_forced(graphed, ids, split, vocab);
    std::size_t at_cpu = 0, at_cuda = 0;
    const double vs_cpu = worst_rows(rows, cpu, vocab, 0, ids.size(), &at_cpu);
    const double vs_cuda = worst_rows(rows, cuda, vocab, 0, ids.size(), &at_cuda);
    EXPECT_LE(vs_cpu, kLogitsTolerance) << what << " split " << split << ": vs the cpu forward at position " << at_cpu;
    EXPECT_LE(vs_cuda, kLogitsTolerance) << what << " split " << split << ": vs the cuda forward at position "
                                         << at_cuda;
    // The graph replays exactly what the launched kernels compute.
    const auto plain = teacher_forced(launched, ids, split, vocab);
    EXPECT_TRUE(plain == rows) << what << " split " << split << ": graph and launched steps differ";
    std::printf(
        "[ decoder  ] %s: prefill %zu + %zu steps, worst normwise error %.3g vs cpu fp32, %.3g vs cuda forward\n",
        what.c_str(), split, ids.size() - split, vs_cpu, vs_cuda);
  }
  // A second pass after reset gives the same logits bit for bit.
  const auto again = teacher_forced(graphed, ids, splits.back(), vocab);
  EXPECT_TRUE(again == teacher_forced(graphed, ids, splits.back(), vocab)) << what << ": reset and replay differ";
}

std::vector<std::int32_t> fixture_ids(const std::string& name) {
  const models::SafetensorsFile expected(test::qwen3_fixture(name) + "/expected.safetensors");
  const auto ids64 = expected.read_i64("input_ids");
  const std::int64_t seq = expected.entry("input_ids").shape[1];
  return std::vector<std::int32_t>(ids64.begin(), ids64.begin() + seq);
}

std::vector<std::int32_t> random_ids(std::mt19937_64& rng, std::size_t n, std::int64_t vocab) {
  std::vector<std::int32_t> ids(n);
  for (auto& id : ids) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(vocab));
  return ids;
}

TEST(DecoderGpu, TeacherForcingMatchesFullForwardOnFixtures) {
  REQUIRE_GPU();
  for (const std::string name : {"tied", "untied"}) {
    Model m = Model::fixture_model(name);
    const auto ids = fixture_ids(name);
    check_teacher_forcing(m, ids, {1, 5, ids.size()}, name);
    // And against transformers' fp32 logits of the same sequence.
    const models::SafetensorsFile expected(test::qwen3_fixture(name) + "/expected.safetensors");
    const auto hf = expected.read_f32("logits");
    q3::Qwen3CudaDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = static_cast<std::int64_t>(ids.size())});
    const auto rows = teacher_forced(decoder, ids, 1, m.config.vocab_size);
    EXPECT_LE(worst_rows(rows, hf, m.config.vocab_size, 0, ids.size()), kLogitsTolerance)
        << name << ": vs transformers";
  }
}

TEST(DecoderGpu, TeacherForcingMatchesFullForwardOnRandomShapes) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  struct Shape {
    std::int64_t vocab, hidden, inter, layers, heads, kv_heads, head_dim;
    bool tied;
  };
  const Shape shapes[] = {{37, 40, 104, 2, 3, 1, 64, true},      // odd vocabulary, 3 query heads on one kv head
                          {301, 64, 96, 2, 12, 1, 64, false},    // 12 per kv head: two blocks of 6
                          {256, 128, 200, 1, 2, 2, 128, false},  // no grouping, head_dim 128
                          {500, 96, 64, 2, 10, 2, 64, true}};    // 5 per kv head
  for (const Shape& s : shapes) {
    const auto config = small_config(s.vocab, s.hidden, s.inter, s.layers, s.heads, s.kv_heads, s.head_dim, s.tied);
    Model m = Model::random_model(config, rng());
    const std::string what = "vocab " + std::to_string(s.vocab) + " hidden " + std::to_string(s.hidden) + " heads " +
                             std::to_string(s.heads) + "/" + std::to_string(s.kv_heads) + " head_dim " +
                             std::to_string(s.head_dim);
    // 100 positions: steps cross the 32-key split boundaries at 32, 64 and 96.
    const auto ids = random_ids(rng, 100, s.vocab);
    check_teacher_forcing(m, ids, {1, 37, 100}, what);
    // A prefill in chunks of 16 (the later chunks attend over the cache, 16 queries at a time).
    check_teacher_forcing(m, ids, {70}, what + ", prefill chunks of 16", {.cuda_graph = true, .max_prefill_chunk = 16});
  }
}

TEST(DecoderGpu, LongContextCrossesWiderSplits) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  // One kv head: 128 splits, so past 4096 keys each split holds more than 32 (34 here).
  const auto config = small_config(64, 64, 64, 1, 2, 1, 64, true);
  Model m = Model::random_model(config, rng());
  const auto ids = random_ids(rng, 4310, config.vocab_size);
  const auto cpu = cpu_logits(m, ids);
  q3::Qwen3CudaDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = 4310});
  decoder.prefill({ids.data(), 4300});
  const auto v = static_cast<std::size_t>(config.vocab_size);
  auto logits = host_logits(decoder, config.vocab_size);
  EXPECT_LE(test::normwise_error(logits.data(), &cpu[4299 * v], v), kLogitsTolerance) << "after a 4300-token prefill";
  double worst = 0;
  for (std::size_t t = 4300; t < ids.size(); ++t) {
    decoder.step(ids[t]);
    logits = host_logits(decoder, config.vocab_size);
    const double e = test::normwise_error(logits.data(), &cpu[t * v], v);
    EXPECT_LE(e, kLogitsTolerance) << "step at position " << t;
    worst = std::max(worst, e);
  }
  std::printf("[ decoder  ] 4.3K context: worst normwise error %.3g vs cpu fp32\n", worst);
}

TEST(DecoderGpu, DeviceTokenEqualsHostTokenAndBadIdsAreFlagged) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  Model m = Model::fixture_model("untied");
  const auto ids = random_ids(rng, 12, m.config.vocab_size);
  q3::Qwen3CudaDecoder a(m.config, *m.device, m.gpu, {.max_tokens = 12});
  q3::Qwen3CudaDecoder b(m.config, *m.device, m.gpu, {.max_tokens = 12});
  core::Buffer token(m.gpu.device(), 4);
  a.prefill({ids.data(), 4});
  b.prefill({ids.data(), 4});
  for (std::size_t t = 4; t < ids.size(); ++t) {
    a.step(ids[t]);
    test::from_host(token, std::vector<std::int32_t>{ids[t]});
    b.step(-12345, ptr<std::int32_t>(token));  // the host value is ignored
    ASSERT_EQ(host_logits(a, m.config.vocab_size), host_logits(b, m.config.vocab_size)) << "position " << t;
  }
  std::int32_t flag = -1;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(&flag, b.invalid_id_flag(), 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(flag, 0);
  // A device token outside the vocabulary is clamped and raises the flag.
  b.reset();
  b.prefill({ids.data(), 2});
  test::from_host(token, std::vector<std::int32_t>{static_cast<std::int32_t>(m.config.vocab_size) + 5});
  b.step(0, ptr<std::int32_t>(token));
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(&flag, b.invalid_id_flag(), 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(flag, 1);
}

TEST(DecoderGpu, WholeMirrorGivesTheSlabsLogits) {  // ZeRO-3's decode
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  Model m = Model::fixture_model("untied");
  test::expect_whole_mirror_gives_the_slabs_logits(m, random_ids(rng, 12, m.config.vocab_size), [&](auto options) {
    return std::make_unique<q3::Qwen3CudaDecoder>(m.config, *m.device, m.gpu, options);
  });
}

TEST(DecoderGpu, GenerateSamplesOnTheDeviceAsTheHostReferenceWould) {
  REQUIRE_GPU();
  Model m = Model::fixture_model("tied");
  const std::vector<std::int32_t> prompt = {5, 17, 300, 999, 0};
  const std::int64_t new_tokens = 60, vocab = m.config.vocab_size;
  for (const models::ops::SamplingParams params :
       {models::ops::SamplingParams{}, models::ops::SamplingParams{.temperature = 1.3f, .top_k = 50, .top_p = 0.95f},
        models::ops::SamplingParams{.temperature = 0.8f}}) {
    q3::Qwen3CudaDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = 70});
    models::GenerationOptions options;
    options.max_new_tokens = new_tokens;
    options.sampling = params;
    options.seed = 77;
    const auto result = models::generate(decoder, m.gpu, vocab, prompt, options);
    ASSERT_EQ(result.ids.size(), static_cast<std::size_t>(new_tokens));
    // The host loop: the same decoder, logits to the host, sample_cpu with the same draws.
    q3::Qwen3CudaDecoder host_driven(m.config, *m.device, m.gpu, {.max_tokens = 70});
    host_driven.prefill(prompt);
    std::vector<std::int32_t> expected;
    for (std::int64_t t = 0; t < new_tokens; ++t) {
      const auto logits = host_logits(host_driven, vocab);
      expected.push_back(
          models::ops::sample_cpu(logits, params, models::ops::sampling_uniform(77, static_cast<std::uint64_t>(t))));
      if (t + 1 < new_tokens) host_driven.step(expected.back());
    }
    EXPECT_EQ(result.ids, expected) << "temperature " << params.temperature;
    // Stop ids end the generation with the stop token.
    options.stop_ids = {expected[10]};
    const auto stopped = models::generate(decoder, m.gpu, vocab, prompt, options);
    EXPECT_TRUE(stopped.stopped);
    EXPECT_EQ(stopped.ids.back(), expected[10]);
    EXPECT_EQ(stopped.ids, std::vector<std::int32_t>(expected.begin(), expected.begin() + stopped.ids.size()));
  }
}

TEST(DecoderGpu, CapacityAndErrors) {
  REQUIRE_GPU();
  Model m = Model::fixture_model("tied");
  const auto ids = fixture_ids("tied");
  q3::Qwen3CudaDecoder decoder(m.config, *m.device, m.gpu, {.max_tokens = 7});
  EXPECT_EQ(decoder.capacity(), 7);
  // k and v, 3 layers, 7 positions, 2 kv heads of 64, bf16.
  EXPECT_EQ(decoder.cache_bytes(), 2u * 3 * 7 * (2 * 64) * 2);
  EXPECT_THROW(decoder.prefill({ids.data(), 8}), core::InputError);
  EXPECT_EQ(decoder.position(), 0);
  EXPECT_THROW(decoder.prefill({}), core::InputError);
  const std::vector<std::int32_t> bad = {1, 1000};
  EXPECT_THROW(decoder.prefill(bad), core::InputError);
  EXPECT_THROW(decoder.step(-1), core::InputError);
  // A 1-token prompt, then steps up to the capacity.
  decoder.prefill({ids.data(), 1});
  for (int t = 1; t < 7; ++t) decoder.step(ids[t]);
  EXPECT_EQ(decoder.position(), 7);
  try {
    decoder.step(ids[7]);
    FAIL() << "expected an error";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("exceed its capacity of 7"), std::string::npos) << e.what();
  }
  EXPECT_THROW(q3::Qwen3CudaDecoder(m.config, *m.device, m.gpu, {.max_tokens = 0}), core::InputError);
  // head_dim other than 64 or 128 is refused by name.
  const auto odd = small_config(50, 64, 64, 1, 2, 1, 96, true);
  optim::Slab odd_slab(optim::SlabLayout(q3::parameter_specs(odd), 1), m.gpu);
  EXPECT_THROW(q3::Qwen3CudaDecoder(odd, odd_slab, m.gpu, {.max_tokens = 4}), core::InputError);
  // The family's decoder hook gives this decoder on cuda.
  const auto spec = q3::qwen3_family().spec(q3::shape_from_config(m.config, q3::Recompute::none));
  const auto hooked = spec->decoder(*m.device, m.gpu, {.max_tokens = 5});
  EXPECT_NE(dynamic_cast<q3::Qwen3CudaDecoder*>(hooked.get()), nullptr);
}

// ---- the step kernels against CPU references ----

struct Weights {
  Bits w, x, norm, out;
};

void check_matvec(std::mt19937_64& rng, std::int64_t rows, std::int64_t in, bool norm, decode::Epilogue epilogue,
                  int max_blocks, bool misaligned) {
  const bool swiglu = epilogue == decode::Epilogue::swiglu_bf16;
  const std::int64_t weight_rows = swiglu ? 2 * rows : rows;
  const std::size_t shift = misaligned ? 1 : 0;  // one element: the rows lose their 16-byte alignment
  const auto w_values =
      to_floats(to_bits(test::random_normal(rng, static_cast<std::size_t>(weight_rows * in) + shift, 0.5f)));
  const auto x_values = to_floats(to_bits(test::random_normal(rng, static_cast<std::size_t>(in), 2.0f)));
  const auto nw_values = to_floats(to_bits(test::random_normal(rng, static_cast<std::size_t>(in), 1.0f)));
  const auto old_values = to_floats(to_bits(test::random_normal(rng, static_cast<std::size_t>(rows), 1.0f)));
  const float eps = 1e-6f;

  // Reference input of the product: x, or bf16(x * rstd * w_norm).
  std::vector<double> xs(static_cast<std::size_t>(in));
  double sum_sq = 0;
  for (float v : x_values) sum_sq += static_cast<double>(v) * v;
  const double rstd = 1.0 / std::sqrt(sum_sq / static_cast<double>(in) + eps);
  for (std::int64_t k = 0; k < in; ++k) {
    xs[k] = norm ? round_bf16(x_values[k] * rstd * nw_values[k]) : x_values[k];
  }
  // y, and its error bound: fp32 accumulation, plus one bf16 ulp where a normalised x_k rounds
  // the other way (fp32 rstd on the device).
  auto product = [&](std::int64_t r, double& bound) {
    double y = 0, mag = 0, big = 0;
    for (std::int64_t k = 0; k < in; ++k) {
      const double term = static_cast<double>(w_values[shift + r * in + k]) * xs[k];
      y += term;
      mag += std::fabs(term);
      big = std::max(big, std::fabs(term));
    }
    bound = 1e-5 * mag + (norm ? 4 * 2 * kHalfUlp * big : 0.0) + 1e-30;
    return y;
  };

  core::Buffer w_d = device_copy(to_bits(w_values)), x_d = device_copy(to_bits(x_values));
  core::Buffer nw_d = device_copy(to_bits(nw_values));
  const bool f32 = epilogue == decode::Epilogue::store_f32;
  core::Buffer out_d(core::Device::cuda(), static_cast<std::size_t>(rows) * (f32 ? 4 : 2));
  if (epilogue == decode::Epilogue::add_bf16) {
    test::from_host(out_d, to_bits(old_values));
  } else {
    out_d.fill_bytes(0xFF);
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  core::Buffer counter = device_copy(std::vector<std::int32_t>{41});
  decode::MatvecArgs a;
  a.weight = ptr<bf16>(w_d) + shift;
  a.rows = rows;
  a.in = in;
  a.x = ptr<bf16>(x_d);
  a.norm_weight = norm ? ptr<bf16>(nw_d) : nullptr;
  a.eps = eps;
  a.out = out_d.data();
  a.advance = ptr<std::int32_t>(counter);
  const core::DeviceContext gpu(core::Device::cuda(0));
  decode::matvec(a, epilogue, max_blocks, gpu.stream());
  gpu.synchronize();
  EXPECT_EQ(test::to_host<std::int32_t>(counter)[0], 42) << "advance";

  std::vector<float> got;
  if (f32) {
    got = test::to_host<float>(out_d);
  } else {
    got = to_floats(test::to_host<std::uint16_t>(out_d));
  }
  const std::string what = "matvec rows " + std::to_string(rows) + " in " + std::to_string(in) + " norm " +
                           std::to_string(norm) + " epilogue " + std::to_string(static_cast<int>(epilogue)) +
                           " blocks " + std::to_string(max_blocks) + (misaligned ? " misaligned" : "");
  int failures = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double bound = 0;
    const double y = product(r, bound);
    double expected = y, tolerance = 0;
    switch (epilogue) {
      case decode::Epilogue::store_f32:  // fp32 out: the accumulation only
        tolerance = bound;
        break;
      case decode::Epilogue::store_bf16:  // bf16(y)
        tolerance = kHalfUlp * std::fabs(y) + 1.01 * bound;
        break;
      case decode::Epilogue::add_bf16:  // bf16(old + bf16(y))
        expected = old_values[r] + y;
        tolerance = kHalfUlp * (std::fabs(y) + std::fabs(expected)) + 1.01 * bound;
        break;
      case decode::Epilogue::swiglu_bf16: {  // bf16(silu(bf16 g) * bf16 u)
        double up_bound = 0;
        const double u = product(r + rows, up_bound);
        const double silu = y / (1 + std::exp(-y));
        expected = silu * u;
        const double dg = kHalfUlp * std::fabs(y) + bound, du = kHalfUlp * std::fabs(u) + up_bound;
        tolerance = 1.1 * std::fabs(u) * dg + (std::fabs(silu) + 1.1 * dg) * du + kHalfUlp * std::fabs(expected) * 1.01;
        break;
      }
    }
    if (!(std::fabs(got[r] - expected) <= tolerance) && failures++ < 5) {
      ADD_FAILURE() << what << ": row " << r << " got " << got[r] << " expected " << expected << " (tolerance "
                    << tolerance << ")";
    }
  }
}

TEST(DecodeKernels, MatvecEveryEpilogueOnAwkwardSizes) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const decode::Epilogue epilogues[] = {decode::Epilogue::store_bf16, decode::Epilogue::add_bf16,
                                        decode::Epilogue::swiglu_bf16, decode::Epilogue::store_f32};
  const std::int64_t sizes[][2] = {{1, 1}, {7, 8}, {37, 40}, {1000, 1027}, {3, 2048}, {300, 64}, {9, 3}};
  for (const auto& size : sizes) {
    for (const auto e : epilogues) {
      for (bool norm : {false, true}) {
        check_matvec(rng, size[0], size[1], norm, e, 1000, false);
      }
    }
    check_matvec(rng, size[0], size[1], true, decode::Epilogue::store_bf16, 2, false);  // a grid-stride over rows
    check_matvec(rng, size[0], size[1], false, decode::Epilogue::store_f32, 1000, true);
  }
  // Wide inputs take more than 48 KiB of shared memory.
  check_matvec(rng, 5, 30000, true, decode::Epilogue::store_bf16, 4, false);
  EXPECT_THROW(decode::matvec({}, decode::Epilogue::store_bf16, 1, nullptr), core::Error);
}

TEST(DecodeKernels, QkNormRopeAppend) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const core::DeviceContext gpu(core::Device::cuda(0));
  struct Case {
    int heads, kv_heads, head_dim;
    std::int32_t position;
    std::int64_t capacity;
  };
  for (const Case c : {Case{4, 2, 64, 0, 3}, Case{3, 1, 128, 5, 9}, Case{12, 1, 64, 4095, 4096}, Case{2, 2, 10, 1, 2},
                       Case{16, 8, 128, 40000, 40001}}) {
    const int hd = c.head_dim, half = hd / 2;
    const std::int64_t kv_size = static_cast<std::int64_t>(c.kv_heads) * hd;
    const auto qkv =
        to_floats(to_bits(test::random_normal(rng, static_cast<std::size_t>((c.heads + 2 * c.kv_heads) * hd), 3.0f)));
    const auto qw = to_floats(to_bits(test::random_normal(rng, static_cast<std::size_t>(hd), 1.0f)));
    const auto kw = to_floats(to_bits(test::random_normal(rng, static_cast<std::size_t>(hd), 1.0f)));
    const double theta = 1e6;
    std::vector<double> inv_freq(static_cast<std::size_t>(half));
    for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -2.0 * i / hd);
    const float eps = 1e-6f;

    core::Buffer qkv_d = device_copy(to_bits(qkv)), qw_d = device_copy(to_bits(qw)), kw_d = device_copy(to_bits(kw));
    core::Buffer freq_d = device_copy(inv_freq), pos_d = device_copy(std::vector<std::int32_t>{c.position});
    core::Buffer q_d(gpu.device(), static_cast<std::size_t>(c.heads * hd) * 2);
    core::Buffer k_d(gpu.device(), static_cast<std::size_t>(c.capacity * kv_size) * 2), v_d(gpu.device(), k_d.bytes());
    for (core::Buffer* b : {&q_d, &k_d, &v_d}) b->fill_bytes(0xFF);
    CUDA_CHECK(cudaDeviceSynchronize());
    decode::qk_norm_rope_append(ptr<bf16>(qkv_d), ptr<bf16>(qw_d), ptr<bf16>(kw_d), c.heads, c.kv_heads, hd, eps,
                                ptr<double>(freq_d), ptr<std::int32_t>(pos_d), ptr<bf16>(q_d), ptr<bf16>(k_d),
                                ptr<bf16>(v_d), gpu.stream());
    gpu.synchronize();
    const auto q = to_floats(test::to_host<std::uint16_t>(q_d));
    const auto k_bits = test::to_host<std::uint16_t>(k_d), v_bits = test::to_host<std::uint16_t>(v_d);
    const auto k = to_floats(k_bits);
    const std::string what = "heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " head_dim " +
                             std::to_string(hd) + " position " + std::to_string(c.position);
    int failures = 0;
    for (int head = 0; head < c.heads + c.kv_heads; ++head) {
      const bool is_q = head < c.heads;
      const float* x = qkv.data() + head * hd;
      const auto& w = is_q ? qw : kw;
      double sum_sq = 0;
      for (int i = 0; i < hd; ++i) sum_sq += static_cast<double>(x[i]) * x[i];
      const double rstd = 1.0 / std::sqrt(sum_sq / hd + eps);
      for (int i = 0; i < half; ++i) {
        const double ya = round_bf16(x[i] * rstd * w[i]), yb = round_bf16(x[i + half] * rstd * w[i + half]);
        const double angle = static_cast<double>(c.position) * inv_freq[i];
        const double out_a = ya * std::cos(angle) - yb * std::sin(angle),
                     out_b = yb * std::cos(angle) + ya * std::sin(angle);
        // Output rounding, plus a bf16 ulp of ya or yb rounded the other way (fp32 rstd).
        const double tolerance = 3 * kHalfUlp * (std::fabs(ya) + std::fabs(yb)) + 1e-6;
        const float* dst = is_q ? q.data() + head * hd : k.data() + c.position * kv_size + (head - c.heads) * hd;
        if (!(std::fabs(dst[i] - out_a) <= tolerance && std::fabs(dst[i + half] - out_b) <= tolerance) &&
            failures++ < 5) {
          ADD_FAILURE() << what << ": head " << head << " pair " << i << " got (" << dst[i] << ", " << dst[i + half]
                        << ") expected (" << out_a << ", " << out_b << ")";
        }
      }
    }
    // v copied exactly into its row; every other cache row untouched.
    const Bits qkv_bits = to_bits(qkv);
    for (std::int64_t row = 0; row < c.capacity; ++row) {
      for (std::int64_t j = 0; j < kv_size; ++j) {
        const std::size_t at = static_cast<std::size_t>(row * kv_size + j);
        if (row == c.position) {
          ASSERT_EQ(v_bits[at], qkv_bits[static_cast<std::size_t>((c.heads + c.kv_heads) * hd + j)]) << what;
        } else {
          ASSERT_EQ(k_bits[at], kPoison) << what << ": k row " << row << " written";
          ASSERT_EQ(v_bits[at], kPoison) << what << ": v row " << row << " written";
        }
      }
    }
  }
}

// Causal attention of new positions start + i over the cache, in double.
std::vector<double> attention_reference(const std::vector<float>& q, std::int64_t q_stride, const std::vector<float>& k,
                                        const std::vector<float>& v, int heads, int kv_heads, int hd,
                                        std::int64_t start, std::int64_t queries) {
  const int group = heads / kv_heads;
  const std::int64_t kv_stride = static_cast<std::int64_t>(kv_heads) * hd;
  std::vector<double> out(static_cast<std::size_t>(queries * heads * hd));
  for (std::int64_t i = 0; i < queries; ++i) {
    for (int h = 0; h < heads; ++h) {
      const int kvh = h / group;
      const std::int64_t last = start + i;
      std::vector<double> s(static_cast<std::size_t>(last + 1));
      double best = -INFINITY;
      for (std::int64_t j = 0; j <= last; ++j) {
        double dot = 0;
        for (int d = 0; d < hd; ++d)
          dot += static_cast<double>(q[i * q_stride + h * hd + d]) * k[j * kv_stride + kvh * hd + d];
        s[j] = dot / std::sqrt(static_cast<double>(hd));
        best = std::max(best, s[j]);
      }
      double sum = 0;
      for (auto& x : s) sum += x = std::exp(x - best);
      for (int d = 0; d < hd; ++d) {
        double acc = 0;
        for (std::int64_t j = 0; j <= last; ++j) acc += s[j] * v[j * kv_stride + kvh * hd + d];
        out[static_cast<std::size_t>((i * heads + h) * hd + d)] = acc / sum;
      }
    }
  }
  return out;
}

TEST(DecodeKernels, CachedAttentionAcrossSplitBoundaries) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const core::DeviceContext gpu(core::Device::cuda(0));
  struct Case {
    int heads, kv_heads, hd;
    std::int64_t start, queries;
    int splits;
  };
  const Case cases[] = {
      {2, 1, 64, 0, 1, 1},       // one key
      {4, 2, 64, 30, 1, 128},    // 31 keys: one split in use
      {4, 2, 64, 31, 1, 128},    // exactly 32
      {4, 2, 64, 32, 1, 128},    // 33: a second split of one key
      {3, 1, 128, 96, 1, 3},     // 97 keys over 3 splits of 33
      {12, 1, 64, 200, 1, 7},    // 12 query heads per kv head (two blocks of 6)
      {10, 2, 64, 63, 1, 2},     // 5 per kv head
      {11, 1, 64, 40, 1, 4},     // 11 per kv head: blocks of one
      {16, 8, 128, 1000, 1, 5},  // Qwen3-0.6B heads
      {4, 2, 64, 10, 6, 2},      // several queries, causal among themselves
      {8, 2, 128, 0, 17, 1},     // queries from an empty cache
      {6, 3, 64, 70, 33, 1},
  };
  for (const Case& c : cases) {
    const std::int64_t keys = c.start + c.queries, kv_stride = static_cast<std::int64_t>(c.kv_heads) * c.hd;
    const std::int64_t q_stride = static_cast<std::int64_t>(c.heads + 2 * c.kv_heads) * c.hd;  // rows of a packed qkv
    const auto q = to_floats(to_bits(test::random_normal(rng, static_cast<std::size_t>(c.queries * q_stride), 1.0f)));
    const auto k = to_floats(to_bits(test::random_normal(rng, static_cast<std::size_t>(keys * kv_stride), 1.0f)));
    const auto v = to_floats(to_bits(test::random_normal(rng, static_cast<std::size_t>(keys * kv_stride), 1.0f)));
    const auto expected = attention_reference(q, q_stride, k, v, c.heads, c.kv_heads, c.hd, c.start, c.queries);
    core::Buffer q_d = device_copy(to_bits(q));
    core::Buffer pos_d = device_copy(std::vector<std::int32_t>{static_cast<std::int32_t>(c.start)});
    core::Buffer partial(
        gpu.device(),
        static_cast<std::size_t>(decode::attention_partial_floats(c.heads, c.hd, c.queries, c.splits)) * 4);
    double v_max = 0;
    for (float x : v) v_max = std::max(v_max, static_cast<double>(std::fabs(x)));
    // The plain decoder's packed cache, and the megakernel's [kv head, position] with 3 spare rows
    // per head (a capacity above the keys in use).
    const std::int64_t capacity = keys + 3;
    for (const bool packed : {true, false}) {
      const decode::KvLayout layout =
          packed ? decode::KvLayout::packed(c.kv_heads, c.hd) : decode::KvLayout{c.hd, capacity * c.hd};
      auto lay_out = [&](const std::vector<float>& rows) {
        Bits out(static_cast<std::size_t>(packed ? keys * kv_stride : c.kv_heads * capacity * c.hd), 0xFFFF);
        for (std::int64_t j = 0; j < keys; ++j)
          for (int h = 0; h < c.kv_heads; ++h)
            for (int d = 0; d < c.hd; ++d)
              out[static_cast<std::size_t>(j * layout.position_stride + h * layout.head_stride + d)] =
                  core::float_to_bf16(rows[static_cast<std::size_t>(j * kv_stride + h * c.hd + d)]);
        return out;
      };
      core::Buffer k_d = device_copy(lay_out(k)), v_d = device_copy(lay_out(v));
      core::Buffer att(gpu.device(), static_cast<std::size_t>(c.queries * c.heads * c.hd) * 2);
      att.fill_bytes(0xFF);
      CUDA_CHECK(cudaDeviceSynchronize());
      decode::cached_attention(ptr<bf16>(q_d), q_stride, ptr<bf16>(k_d), ptr<bf16>(v_d), layout, c.heads, c.kv_heads,
                               c.hd, ptr<std::int32_t>(pos_d), c.queries, c.splits, ptr<float>(partial), ptr<bf16>(att),
                               gpu.stream());
      gpu.synchronize();
      const auto got = to_floats(test::to_host<std::uint16_t>(att));
      const std::string what = "heads " + std::to_string(c.heads) + "/" + std::to_string(c.kv_heads) + " hd " +
                               std::to_string(c.hd) + " start " + std::to_string(c.start) + " queries " +
                               std::to_string(c.queries) + " splits " + std::to_string(c.splits) +
                               (packed ? " packed" : " head-major");
      int failures = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        // bf16 output rounding, plus fp32 scores and exponentials (relative 1e-5 of the values).
        const double tolerance = kHalfUlp * std::fabs(expected[i]) + 1e-4 * v_max;
        if (!(std::fabs(got[i] - expected[i]) <= tolerance) && failures++ < 5) {
          ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " expected " << expected[i];
        }
      }
    }
  }
  // Misuse is refused.
  core::Buffer b(gpu.device(), 1 << 16);
  const decode::KvLayout packed = decode::KvLayout::packed(1, 64);
  EXPECT_THROW(decode::cached_attention(ptr<bf16>(b), 64, ptr<bf16>(b), ptr<bf16>(b), packed, 2, 1, 96,
                                        ptr<std::int32_t>(b), 1, 1, ptr<float>(b), ptr<bf16>(b), gpu.stream()),
               core::Error);
  EXPECT_THROW(decode::cached_attention(ptr<bf16>(b) + 1, 64, ptr<bf16>(b), ptr<bf16>(b), packed, 2, 1, 64,
                                        ptr<std::int32_t>(b), 1, 1, ptr<float>(b), ptr<bf16>(b), gpu.stream()),
               core::Error);
  EXPECT_THROW(decode::cached_attention(ptr<bf16>(b), 64, ptr<bf16>(b), ptr<bf16>(b), decode::KvLayout{64, 68}, 2, 1,
                                        64, ptr<std::int32_t>(b), 1, 1, ptr<float>(b), ptr<bf16>(b), gpu.stream()),
               core::Error);
}

// Rows of keys and values (strided, as a prefill chunk holds them) into both cache layouts at an
// offset: every element where the layout says, nothing else written.
TEST(DecodeKernels, StoreKvRowsIntoEitherLayout) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const core::DeviceContext gpu(core::Device::cuda(0));
  struct Case {
    int kv_heads, hd;
    std::int64_t n, start, k_stride, v_stride;
  };
  for (const Case& c : {Case{1, 64, 1, 0, 64, 64}, Case{3, 64, 37, 5, 200, 320}, Case{8, 128, 70, 11, 1024, 4096},
                        Case{2, 128, 5, 0, 512, 768}}) {
    const std::int64_t capacity = c.start + c.n + 2, kv_size = static_cast<std::int64_t>(c.kv_heads) * c.hd;
    const Bits keys = to_bits(test::random_normal(rng, static_cast<std::size_t>(c.n * c.k_stride)));
    const Bits values = to_bits(test::random_normal(rng, static_cast<std::size_t>(c.n * c.v_stride)));
    for (const bool packed : {true, false}) {
      const decode::KvLayout layout =
          packed ? decode::KvLayout::packed(c.kv_heads, c.hd) : decode::KvLayout{c.hd, capacity * c.hd};
      const auto elements = static_cast<std::size_t>(capacity * kv_size);
      core::Buffer k_d = device_copy(Bits(elements, 0x7777)), v_d = device_copy(Bits(elements, 0x7777));
      core::Buffer keys_d = device_copy(keys), values_d = device_copy(values);
      CUDA_CHECK(cudaDeviceSynchronize());
      decode::store_kv_rows(ptr<bf16>(keys_d), c.k_stride, ptr<bf16>(values_d), c.v_stride, c.n, c.kv_heads, c.hd,
                            ptr<bf16>(k_d), ptr<bf16>(v_d), layout, c.start, gpu.stream());
      gpu.synchronize();
      Bits k_expected(elements, 0x7777), v_expected(elements, 0x7777);
      for (std::int64_t i = 0; i < c.n; ++i)
        for (int h = 0; h < c.kv_heads; ++h)
          for (int d = 0; d < c.hd; ++d) {
            const auto at =
                static_cast<std::size_t>((c.start + i) * layout.position_stride + h * layout.head_stride + d);
            k_expected[at] = keys[static_cast<std::size_t>(i * c.k_stride + h * c.hd + d)];
            v_expected[at] = values[static_cast<std::size_t>(i * c.v_stride + h * c.hd + d)];
          }
      EXPECT_EQ(test::to_host<std::uint16_t>(k_d), k_expected)
          << "keys, kv heads " << c.kv_heads << " packed " << packed;
      EXPECT_EQ(test::to_host<std::uint16_t>(v_d), v_expected)
          << "values, kv heads " << c.kv_heads << " packed " << packed;
    }
  }
  core::Buffer b(gpu.device(), 1 << 16);
  EXPECT_THROW(decode::store_kv_rows(ptr<bf16>(b), 60, ptr<bf16>(b), 64, 1, 1, 64, ptr<bf16>(b), ptr<bf16>(b),
                                     decode::KvLayout::packed(1, 64), 0, gpu.stream()),
               core::Error);
}

TEST(DecodeKernels, EmbedTokenAndSmallKernels) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const core::DeviceContext gpu(core::Device::cuda(0));
  const std::int64_t vocab = 13, dim = 1027;
  const Bits table = to_bits(test::random_normal(rng, static_cast<std::size_t>(vocab * dim)));
  core::Buffer table_d = device_copy(table), x(gpu.device(), static_cast<std::size_t>(dim) * 2);
  core::Buffer flag = device_copy(std::vector<std::int32_t>{0}), token = device_copy(std::vector<std::int32_t>{7});
  auto row = [&](std::int64_t id) { return Bits(table.begin() + id * dim, table.begin() + (id + 1) * dim); };
  decode::embed_token(nullptr, 4, ptr<bf16>(table_d), vocab, dim, ptr<bf16>(x), ptr<std::int32_t>(flag), gpu.stream());
  gpu.synchronize();
  EXPECT_EQ(test::to_host<std::uint16_t>(x), row(4));
  decode::embed_token(ptr<std::int32_t>(token), 4, ptr<bf16>(table_d), vocab, dim, ptr<bf16>(x),
                      ptr<std::int32_t>(flag), gpu.stream());
  gpu.synchronize();
  EXPECT_EQ(test::to_host<std::uint16_t>(x), row(7));
  EXPECT_EQ(test::to_host<std::int32_t>(flag)[0], 0);
  decode::embed_token(nullptr, 13, ptr<bf16>(table_d), vocab, dim, ptr<bf16>(x), ptr<std::int32_t>(flag), gpu.stream());
  gpu.synchronize();
  EXPECT_EQ(test::to_host<std::uint16_t>(x), row(12));  // clamped
  EXPECT_EQ(test::to_host<std::int32_t>(flag)[0], 1);

  core::Buffer positions(gpu.device(), 1001 * 4);
  decode::fill_positions(ptr<std::int32_t>(positions), 17, 1001, gpu.stream());
  decode::set_int(ptr<std::int32_t>(flag), -5, gpu.stream());
  const auto values = test::random_normal(rng, 3001);
  core::Buffer in = device_copy(to_bits(values)), out(gpu.device(), 3001 * 4);
  decode::bf16_to_f32(ptr<bf16>(in), ptr<float>(out), 3001, gpu.stream());
  gpu.synchronize();
  const auto p = test::to_host<std::int32_t>(positions);
  for (std::int32_t i = 0; i < 1001; ++i) ASSERT_EQ(p[i], 17 + i);
  EXPECT_EQ(test::to_host<std::int32_t>(flag)[0], -5);
  EXPECT_EQ(test::to_host<float>(out), to_floats(to_bits(values)));
}

}  // namespace
