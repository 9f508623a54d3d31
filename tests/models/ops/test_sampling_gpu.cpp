// Device token sampling (sample_cuda) against the CPU reference (sample_cpu) for the same draws:
// the same id for every case, over many random logits and vocabulary sizes 1, 7, 1000, 4097 (not
// a multiple of the scan tile) and 151936 (Qwen3); greedy, temperatures, top-k, top-p and both;
// logits with many ties (a few levels), -inf masks, NaN and +inf, and all masked; the exact
// boundaries of the CPU suite (u = 0.5 between two equal tokens, p at a quarter). The kernels
// allocate nothing and never wait for the host: they are captured into a CUDA graph and replayed.
// Each output slot is poisoned first, so a case that writes nothing fails.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "models/ops/sampling.h"
#include "support/gpu_watchdog.h"
#include "support/test_support.h"

namespace {

using models::ops::SamplingParams;
namespace ops = models::ops;

constexpr float kInf = std::numeric_limits<float>::infinity();

std::string describe(const SamplingParams& p, float u) {
  return "temperature " + std::to_string(p.temperature) + " top_k " + std::to_string(p.top_k) + " top_p " +
         std::to_string(p.top_p) + " u " + std::to_string(u);
}

const std::vector<SamplingParams>& parameter_grid() {
  static const std::vector<SamplingParams> grid = {
      {},                     // greedy
      {.temperature = 1.0f},  // plain sampling
      {.temperature = 0.7f},
      {.temperature = 3.0f},
      {.temperature = 1.0f, .top_k = 1},
      {.temperature = 0.9f, .top_k = 5},
      {.temperature = 1.2f, .top_k = 50},
      {.temperature = 1.0f, .top_p = 0.9f},
      {.temperature = 1.0f, .top_p = 0.3f},
      {.temperature = 0.6f, .top_k = 40, .top_p = 0.95f},
      {.temperature = 2.0f, .top_k = 3, .top_p = 0.5f},
      {.temperature = 1e-3f},  // nearly greedy: exp underflows for most tokens
  };
  return grid;
}

// Runs every (params, u) case on one logits vector, device and host, and compares the ids.
class SamplingCases {
 public:
  SamplingCases(const core::DeviceContext& gpu, std::int64_t vocab)
      : gpu_(gpu),
        vocab_(vocab),
        logits_(gpu.device(), static_cast<std::size_t>(vocab) * 4),
        workspace_(gpu.device(), ops::sample_cuda_workspace_bytes(vocab)) {}

  // Returns the number of cases compared; failures are reported through gtest.
  int compare(const std::vector<float>& logits, const std::vector<SamplingParams>& grid,
              const std::vector<float>& draws, const std::string& what) {
    test::from_host(logits_, logits);
    const std::size_t cases = grid.size() * draws.size();
    core::Buffer ids(gpu_.device(), cases * 4);
    ids.fill_bytes(0xFF);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::size_t slot = 0;
    for (const SamplingParams& p : grid) {
      for (float u : draws) {
        ops::sample_cuda(logits_.as<float>(), vocab_, p, u, ids.as<std::int32_t>() + slot++, workspace_.data(),
                         workspace_.bytes(), gpu_.stream());
      }
    }
    gpu_.synchronize();
    const auto device_ids = test::to_host<std::int32_t>(ids);
    slot = 0;
    int failures = 0;
    for (const SamplingParams& p : grid) {
      for (float u : draws) {
        const std::int32_t expected = ops::sample_cpu(logits, p, u);
        const std::int32_t got = device_ids[slot++];
        if (got != expected && failures++ < 5) {
          ADD_FAILURE() << what << " vocab " << vocab_ << ", " << describe(p, u) << ": device id " << got
                        << ", reference " << expected;
        }
      }
    }
    return static_cast<int>(cases);
  }

 private:
  const core::DeviceContext& gpu_;
  std::int64_t vocab_;
  core::Buffer logits_, workspace_;
};

std::vector<float> draws_for(std::mt19937_64& rng, int count) {
  std::vector<float> u = {0.0f, 0.9999999f};
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  while (static_cast<int>(u.size()) < count) u.push_back(uniform(rng));
  return u;
}

// Random logits of one of several kinds.
std::vector<float> random_logits(std::mt19937_64& rng, std::int64_t vocab, int kind) {
  auto v = test::random_normal(rng, static_cast<std::size_t>(vocab), kind == 0 ? 1.0f : 4.0f);
  std::uniform_int_distribution<std::int64_t> pick(0, vocab - 1);
  switch (kind) {
    case 0:  // smooth
    case 1:  // peaked
      break;
    case 2:  // ties: a few levels
      for (float& x : v) x = std::round(x);
      break;
    case 3:  // a masked majority (-inf), as after a grammar or banned-token mask
      for (float& x : v) {
        if (std::uniform_int_distribution<int>(0, 3)(rng) != 0) x = -kInf;
      }
      break;
    case 4:  // NaN and +inf entries (NaN counts as -inf; +inf as the largest float)
      for (int i = 0; i < 3; ++i) v[static_cast<std::size_t>(pick(rng))] = std::numeric_limits<float>::quiet_NaN();
      if (vocab > 3) v[static_cast<std::size_t>(pick(rng))] = kInf;
      break;
    case 5:  // every logit equal
      std::fill(v.begin(), v.end(), 0.25f);
      break;
  }
  return v;
}

TEST(SamplingGpu, EqualsReferenceOverRandomLogits) {
  REQUIRE_GPU();
  const core::DeviceContext gpu(core::Device::cuda(0));
  std::mt19937_64 rng(test::fresh_seed());
  int compared = 0;
  for (const std::int64_t vocab : {1, 7, 1000, 4097, 151936}) {
    SamplingCases cases(gpu, vocab);
    const int trials = vocab >= 100000 ? 12 : 60;
    for (int trial = 0; trial < trials; ++trial) {
      const int kind = trial % 6;
      const auto logits = random_logits(rng, vocab, kind);
      compared += cases.compare(logits, parameter_grid(), draws_for(rng, vocab >= 100000 ? 4 : 8),
                                "kind " + std::to_string(kind) + " trial " + std::to_string(trial));
      if (HasFailure()) return;
    }
  }
  std::printf("[ sampling ] %d device choices equal the reference\n", compared);
}

TEST(SamplingGpu, EdgeCasesEqualReference) {
  REQUIRE_GPU();
  const core::DeviceContext gpu(core::Device::cuda(0));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // The exact boundaries of the CPU suite: four equal tokens, the rest masked.
  {
    const std::vector<float> logits = {-kInf, 2.0f, -kInf, 2.0f, 2.0f, -kInf, 2.0f};
    SamplingCases cases(gpu, 7);
    cases.compare(logits,
                  {{.temperature = 1.0f, .top_p = 0.5f},
                   {.temperature = 1.0f, .top_p = 0.25f},
                   {.temperature = 1.0f, .top_p = 0.2500001f},
                   {.temperature = 1.0f, .top_p = 0.75f},
                   {.temperature = 1.0f},
                   {.temperature = 1.0f, .top_k = 2},
                   {}},
                  {0.0f, 0.25f, 0.4999999f, 0.5f, 0.75f, 0.99f, 0.9999999f}, "quarters");
    // The device choice for u = 0.5 at p = 0.5 is the second kept token, as on the host.
    core::Buffer logits_d(gpu.device(), logits.size() * 4), id(gpu.device(), 4);
    core::Buffer workspace(gpu.device(), ops::sample_cuda_workspace_bytes(7));
    test::from_host(logits_d, logits);
    ops::sample_cuda(logits_d.as<float>(), 7, {.temperature = 1.0f, .top_p = 0.5f}, 0.5f, id.as<std::int32_t>(),
                     workspace.data(), workspace.bytes(), gpu.stream());
    gpu.synchronize();
    EXPECT_EQ(test::to_host<std::int32_t>(id)[0], 3);
  }
  // Every logit masked (or NaN): id 0 for greedy and sampling alike.
  for (const std::int64_t vocab : {1, 7, 4097}) {
    SamplingCases cases(gpu, vocab);
    std::vector<float> masked(static_cast<std::size_t>(vocab), -kInf);
    cases.compare(masked, parameter_grid(), {0.0f, 0.5f, 0.9999999f}, "all -inf");
    masked[0] = nan;
    if (vocab > 2) masked[2] = nan;
    cases.compare(masked, parameter_grid(), {0.3f}, "all -inf or NaN");
  }
  // Ties for the maximum at far-apart ids (argmax blocks see them in different orders), and a
  // top-k boundary inside a run of ties.
  {
    const std::int64_t vocab = 151936;
    std::vector<float> logits(static_cast<std::size_t>(vocab), -1.0f);
    for (const std::int64_t id : {151935, 77777, 40000, 513}) logits[static_cast<std::size_t>(id)] = 9.0f;
    SamplingCases cases(gpu, vocab);
    cases.compare(logits, parameter_grid(), {0.0f, 0.2f, 0.6f, 0.9999999f}, "far ties");
    for (std::size_t i = 1000; i < 1100; ++i) logits[i] = 5.0f;
    cases.compare(logits,
                  {{.temperature = 1.0f, .top_k = 5},
                   {.temperature = 1.0f, .top_k = 4},
                   {.temperature = 0.5f, .top_k = 50, .top_p = 0.999f}},
                  {0.0f, 0.5f, 0.9999f}, "top-k inside ties");
  }
  // A workspace that is too small is refused.
  core::Buffer logits_d(gpu.device(), 7 * 4), id(gpu.device(), 4), small(gpu.device(), 64);
  EXPECT_THROW(ops::sample_cuda(logits_d.as<float>(), 7, {.temperature = 1.0f}, 0.5f, id.as<std::int32_t>(),
                                small.data(), small.bytes(), gpu.stream()),
               core::Error);
  EXPECT_THROW(ops::sample_cuda_workspace_bytes(0), core::Error);
}

TEST(SamplingGpu, CapturedIntoAGraphAndReplayed) {
  REQUIRE_GPU();
  const core::DeviceContext gpu(core::Device::cuda(0));
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t vocab = 151936;
  core::Buffer logits_d(gpu.device(), static_cast<std::size_t>(vocab) * 4), ids(gpu.device(), 2 * 4);
  core::Buffer workspace(gpu.device(), ops::sample_cuda_workspace_bytes(vocab));
  const SamplingParams sampled{.temperature = 0.8f, .top_k = 100, .top_p = 0.9f};
  const float u = 0.37f;
  cudaGraph_t graph = test::capture_graph(gpu.stream(), [&] {
    ops::sample_cuda(logits_d.as<float>(), vocab, {}, u, ids.as<std::int32_t>(), workspace.data(), workspace.bytes(),
                     gpu.stream());
    ops::sample_cuda(logits_d.as<float>(), vocab, sampled, u, ids.as<std::int32_t>() + 1, workspace.data(),
                     workspace.bytes(), gpu.stream());
  });
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    const auto logits = test::random_normal(rng, static_cast<std::size_t>(vocab), 3.0f);
    test::from_host(logits_d, logits);
    CUDA_CHECK(cudaGraphLaunch(exec, gpu.stream()));
    gpu.synchronize();
    const auto got = test::to_host<std::int32_t>(ids);
    EXPECT_EQ(got[0], ops::sample_cpu(logits, {}, u)) << "replay " << replay;
    EXPECT_EQ(got[1], ops::sample_cpu(logits, sampled, u)) << "replay " << replay;
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

TEST(SamplingGpu, TokenSamplerDispatchesToTheDevice) {
  REQUIRE_GPU();
  const core::DeviceContext gpu(core::Device::cuda(0));
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t vocab = 1000;
  ops::TokenSampler sampler(gpu, vocab);
  core::Buffer logits_d(gpu.device(), static_cast<std::size_t>(vocab) * 4), id(gpu.device(), 4);
  for (int trial = 0; trial < 20; ++trial) {
    const auto logits = test::random_normal(rng, static_cast<std::size_t>(vocab), 2.0f);
    test::from_host(logits_d, logits);
    const float u = ops::sampling_uniform(5, static_cast<std::uint64_t>(trial));
    const SamplingParams p{.temperature = 1.0f, .top_p = 0.8f};
    sampler.sample(logits_d.as<float>(), p, u, id.as<std::int32_t>());
    gpu.synchronize();
    EXPECT_EQ(test::to_host<std::int32_t>(id)[0], ops::sample_cpu(logits, p, u));
  }
}

}  // namespace
