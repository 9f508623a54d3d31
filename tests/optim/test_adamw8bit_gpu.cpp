// The CUDA adamw8bit step against the CPU reference on fresh random data: many tensor lists with
// odd sizes, both codes, both mirror types, both non-finite policies, several min_8bit_size and
// chunk sizes, sharded ranges. Codes and scales must be identical, master within 1e-6 relative,
// mirror the rounded master, grads zeroed; a captured step is two kernels and replays equal eager;
// ZeRO-2 gradients over the owned shard only step exactly like gradients over the whole slab.
// The kernel's two shortcuts are checked on their own: its square root against fp::sqrt over every
// float of its range, its companded encoder (fast path and fallback) against the CPU encoder on
// values at, next to and between the code positions.
#include <algorithm>
#include <cmath>
#include <cstring>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/half.h"
#include "optim/adamw8bit.h"
#include "optim/quantization.h"
#include "optim/sharded_grads_support.h"
#include "support/test_support.h"

namespace {

using optim::AdamW8bit;
using optim::NonFinitePolicy;
using optim::OptimizerConfig;
using optim::Quantization;

struct Run8 {
  core::DeviceContext context;
  optim::Slab slab;
  AdamW8bit opt;

  Run8(core::Device device, const optim::SlabLayout& layout, const OptimizerConfig& config, optim::SlabOptions options,
       std::int64_t chunk)
      : context(device), slab(layout, context, options), opt(config, slab, context, chunk) {
    context.synchronize();
  }
};

struct HostState {
  std::vector<float> master, grad, scale_m, scale_v, small_m, small_v;
  std::vector<std::uint8_t> q_m, q_v;
};

void load(Run8& run, const HostState& s) {
  test::from_host(run.slab.master(), s.master);
  test::from_host(run.slab.grad(), s.grad);
  test::from_host(run.opt.q_m(), s.q_m);
  test::from_host(run.opt.q_v(), s.q_v);
  test::from_host(run.opt.scale_m(), s.scale_m);
  test::from_host(run.opt.scale_v(), s.scale_v);
  test::from_host(run.opt.small_m(), s.small_m);
  test::from_host(run.opt.small_v(), s.small_v);
}

// Identical bytes; on failure names the first differing index instead of printing the vectors.
template <typename T>
::testing::AssertionResult identical(const std::vector<T>& actual, const std::vector<T>& expected) {
  if (actual.size() != expected.size()) return ::testing::AssertionFailure() << "sizes differ";
  std::size_t bad = 0, first = actual.size();
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (std::memcmp(&actual[i], &expected[i], sizeof(T)) != 0) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << actual.size() << " differ; first at [" << first
                                       << "]: " << +actual[first] << " vs expected " << +expected[first];
}

void expect_same_step(Run8& gpu, Run8& cpu, const std::string& where) {
  const auto rg = gpu.opt.report();
  const auto rc = cpu.opt.report();
  EXPECT_EQ(rg.step, rc.step) << where;
  EXPECT_EQ(rg.skipped_steps, rc.skipped_steps) << where;
  EXPECT_EQ(rg.nonfinite, rc.nonfinite) << where;
  EXPECT_NEAR(rg.grad_norm, rc.grad_norm, 1e-12 * rc.grad_norm) << where;

  EXPECT_TRUE(identical(test::to_host<std::uint8_t>(gpu.opt.q_m()), test::to_host<std::uint8_t>(cpu.opt.q_m())))
      << where << ": q_m";
  EXPECT_TRUE(identical(test::to_host<std::uint8_t>(gpu.opt.q_v()), test::to_host<std::uint8_t>(cpu.opt.q_v())))
      << where << ": q_v";
  EXPECT_TRUE(identical(test::to_host<float>(gpu.opt.scale_m()), test::to_host<float>(cpu.opt.scale_m())))
      << where << ": scale_m";
  EXPECT_TRUE(identical(test::to_host<float>(gpu.opt.scale_v()), test::to_host<float>(cpu.opt.scale_v())))
      << where << ": scale_v";
  const double rtol = 1e-6;
  EXPECT_TRUE(
      test::all_close(test::to_host<float>(gpu.slab.master()), test::to_host<float>(cpu.slab.master()), rtol, 0))
      << where << ": master";
  EXPECT_TRUE(
      test::all_close(test::to_host<float>(gpu.opt.small_m()), test::to_host<float>(cpu.opt.small_m()), rtol, 0))
      << where << ": small_m";
  EXPECT_TRUE(
      test::all_close(test::to_host<float>(gpu.opt.small_v()), test::to_host<float>(cpu.opt.small_v()), rtol, 0))
      << where << ": small_v";

  const auto grads = test::to_host<float>(gpu.slab.grad());
  const auto master = test::to_host<float>(gpu.slab.master());
  const auto mirror = test::to_host<std::uint16_t>(gpu.slab.mirror());
  const auto cpu_mirror = test::to_host<std::uint16_t>(cpu.slab.mirror());
  const auto owned = gpu.slab.owned();
  const bool bf16 = gpu.slab.mirror_dtype() == core::DType::bf16;
  for (const auto& seg : gpu.slab.segments()) {
    for (std::int64_t i = seg.offset; i < seg.offset + seg.length; ++i) {
      const auto k = static_cast<std::size_t>(i);
      ASSERT_EQ(grads[k], 0.0f) << where << ": gradient " << i << " not zeroed";
      const float w = master[static_cast<std::size_t>(i - owned.begin)];
      ASSERT_EQ(mirror[k], bf16 ? core::float_to_bf16(w) : core::float_to_fp16(w)) << where << ": mirror element " << i;
    }
  }
  // Outside the owned tensor elements the mirror is untouched on both sides.
  std::vector<bool> in_segment(mirror.size(), false);
  for (const auto& seg : gpu.slab.segments()) {
    for (std::int64_t i = seg.offset; i < seg.offset + seg.length; ++i) in_segment[static_cast<std::size_t>(i)] = true;
  }
  for (std::size_t i = 0; i < mirror.size(); ++i) {
    if (!in_segment[i]) {
      ASSERT_EQ(mirror[i], cpu_mirror[i]) << where << ": mirror outside the owned tensors at " << i;
    }
  }
}

TEST(AdamW8bitGpu, MatchesReferenceOverRandomTensorLists) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const std::int64_t chunk_sizes[] = {64, 1024, 16384, 65536};
  const std::int64_t min_sizes[] = {4096, 4096, 1, 300, 1000, 0};
  for (int trial = 0; trial < 24; ++trial) {
    const int world = trial % 4 == 3 ? 1 + static_cast<int>(rng() % 4) : 1;
    const int rank = static_cast<int>(rng() % static_cast<std::uint64_t>(world));
    const int count = 1 + static_cast<int>(rng() % 60);
    const std::int64_t max_numel = trial % 5 == 0 ? 300000 : (trial % 5 == 1 ? 20000 : 5000);
    const optim::SlabLayout layout(test::random_specs(rng, count, max_numel), world);
    OptimizerConfig config;
    config.type = "adamw8bit";
    config.lr = 1e-3 * (0.1 + unit(rng));
    config.beta1 = 0.8 + 0.15 * unit(rng);
    config.beta2 = 0.9 + 0.099 * unit(rng);
    config.eps = trial % 2 ? 1e-8 : 1e-6;
    config.weight_decay = trial % 3 ? 0.1 * unit(rng) : 0.0;
    config.grad_clip = trial % 4 == 0 ? 0.0 : 0.5 + 50 * unit(rng);
    config.nonfinite = trial % 2 ? NonFinitePolicy::zero_element : NonFinitePolicy::skip_step;
    config.adamw8bit.min_8bit_size = min_sizes[trial % std::size(min_sizes)];
    config.adamw8bit.quantization = trial % 3 == 2 ? Quantization::linear : Quantization::companded;
    const optim::SlabOptions options{.rank = rank,
                                     .zero_stage = world > 1 ? 1 : 0,
                                     .mirror_dtype = trial % 3 == 1 ? core::DType::f16 : core::DType::bf16};
    const std::int64_t chunk = chunk_sizes[trial % 4];
    const std::string where = "trial " + std::to_string(trial) + " (" + std::to_string(count) + " tensors, world " +
                              std::to_string(world) + ", rank " + std::to_string(rank) + ", chunk " +
                              std::to_string(chunk) + ", min_8bit_size " +
                              std::to_string(config.adamw8bit.min_8bit_size) + ", " +
                              (config.adamw8bit.quantization == Quantization::linear ? "linear" : "companded") + ")";

    Run8 gpu(core::Device::cuda(0), layout, config, options, chunk);
    Run8 cpu(core::Device::cpu(), layout, config, options, chunk);
    const auto owned = static_cast<std::size_t>(gpu.slab.owned().size());
    const auto& plan = gpu.opt.plan();
    HostState s;
    s.master = test::random_normal(rng, owned);
    s.grad = test::random_grads(rng, layout, 0.05f);
    // A random starting state: any code, positive scales (linear v codes are non-negative).
    s.q_m.resize(owned);
    s.q_v.resize(owned);
    for (auto& x : s.q_m) x = static_cast<std::uint8_t>(rng());
    for (auto& x : s.q_v)
      x = static_cast<std::uint8_t>(config.adamw8bit.quantization == Quantization::linear ? rng() % 128 : rng());
    s.scale_m = test::random_normal(rng, static_cast<std::size_t>(plan.owned_blocks), 0.01f);
    for (float& x : s.scale_m) x = std::fabs(x);
    s.scale_v = test::random_normal(rng, static_cast<std::size_t>(plan.owned_blocks), 1e-3f);
    for (float& x : s.scale_v) x *= x;
    s.small_m = test::random_normal(rng, static_cast<std::size_t>(plan.small_elements), 0.01f);
    s.small_v = test::random_normal(rng, static_cast<std::size_t>(plan.small_elements), 1e-4f);
    for (float& x : s.small_v) x *= x;
    load(gpu, s);
    load(cpu, s);
    // Random mirrors too, so that a write outside the tensors shows.
    std::vector<std::uint16_t> mirror(static_cast<std::size_t>(layout.total_elements()));
    for (auto& x : mirror) x = static_cast<std::uint16_t>(rng());
    test::from_host(gpu.slab.mirror(), mirror);
    test::from_host(cpu.slab.mirror(), mirror);
    for (int step = 0; step < 3; ++step) {
      if (step > 0) {
        auto g = test::random_grads(rng, layout, step == 1 ? 2.0f : 0.01f);
        if (trial % 3 == 2 && step == 1) test::poison_one_gradient(rng, gpu.slab.segments(), g);
        test::from_host(gpu.slab.grad(), g);
        test::from_host(cpu.slab.grad(), g);
      }
      const double lr = config.lr * (1.0 - 0.2 * step);
      gpu.opt.step(lr);
      cpu.opt.step(lr);
      expect_same_step(gpu, cpu, where + ", step " + std::to_string(step + 1));
      if (HasFailure()) return;
    }
  }
}

TEST(AdamW8bitGpu, SquareRootFastPathIsCorrectlyRoundedOverItsRange) {
  REQUIRE_GPU();
  EXPECT_EQ(optim::self_check::adamw8bit_sqrt_mismatches(), 0u);
}

TEST(AdamW8bitGpu, CompandedEncoderMatchesReferenceAtAndAroundCodes) {
  REQUIRE_GPU();
  using Codec = optim::MomentCodec<Quantization::companded>;
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const std::size_t groups = 1 << 20;
  std::vector<float> m(4 * groups), v(4 * groups), scale_m(groups), scale_v(groups);
  std::vector<std::uint32_t> draws(4 * groups);
  auto next_float = [](float x, int ulps) {
    std::uint32_t b;
    std::memcpy(&b, &x, 4);
    b = static_cast<std::uint32_t>(static_cast<std::int64_t>(b) + ulps);
    std::memcpy(&x, &b, 4);
    return x;
  };
  for (std::size_t g = 0; g < groups; ++g) {
    // Block maxima from the smallest kept (2^-90) to large, and 0 (all codes 0).
    const int kind = static_cast<int>(g % 8);
    float sm = std::ldexp(0.5f + unit(rng), static_cast<int>(rng() % 100) - 90);
    float sv = std::ldexp(0.5f + unit(rng), static_cast<int>(rng() % 120) - 90);
    if (kind == 0) sm = sv = optim::kMinScale;
    if (kind == 1) sm = 0.0f;
    if (kind == 2) sv = 0.0f;
    scale_m[g] = sm;
    scale_v[g] = sv;
    for (int k = 0; k < 4; ++k) {
      const std::size_t i = 4 * g + static_cast<std::size_t>(k);
      const int cm = static_cast<int>(rng() % 128), cv = static_cast<int>(rng() % 256);
      float xm = Codec::decode_m(static_cast<std::uint8_t>(cm), sm);
      float xv = Codec::decode_v(static_cast<std::uint8_t>(cv), sv);
      switch (rng() % 6) {
        case 0: break;  // on a code
        case 1:         // a few ulps off a code, not above the block maximum
          xm = std::min(next_float(xm, static_cast<int>(rng() % 7) - 3), sm);
          xv = std::min(next_float(xv, static_cast<int>(rng() % 7) - 3), sv);
          break;
        case 2:  // the block maximum itself
          xm = sm;
          xv = sv;
          break;
        case 3:  // zeros and denormals
          xm = (rng() % 2) ? 0.0f : 1e-40f;
          xv = (rng() % 2) ? 0.0f : 1e-41f;
          break;
        default:  // anywhere below the maximum
          xm = sm * unit(rng);
          xv = sv * unit(rng) * unit(rng) * unit(rng);
      }
      if (!(xm >= 0.0f) || xm != xm) xm = 0.0f;
      if (!(xv >= 0.0f) || xv != xv) xv = 0.0f;
      m[i] = (rng() % 2) ? -xm : xm;
      v[i] = xv;
      std::uint32_t um = static_cast<std::uint32_t>(rng() % 65536), uv = static_cast<std::uint32_t>(rng() % 65536);
      if (rng() % 8 == 0) um = (rng() % 2) ? 0u : 65535u;
      if (rng() % 8 == 0) uv = (rng() % 2) ? 0u : 65535u;
      draws[i] = um | (uv << 16);
    }
  }
  std::vector<std::uint8_t> code_m, code_v;
  optim::self_check::adamw8bit_companded_codes(m, v, scale_m, scale_v, draws, code_m, code_v);
  std::size_t bad_m = 0, bad_v = 0;
  for (std::size_t i = 0; i < m.size(); ++i) {
    const optim::RoundingDraws u = optim::rounding_draws_from(draws[i]);
    const std::uint8_t want_m = Codec::encode_m(m[i], Codec::code_scale_m(scale_m[i / 4]), u.m);
    const std::uint8_t want_v = Codec::encode_v(v[i], Codec::code_scale_v(scale_v[i / 4]), u.v);
    if (code_m[i] != want_m && bad_m++ < 5) {
      ADD_FAILURE() << "m " << m[i] << " (scale " << scale_m[i / 4] << ", u " << u.m << "): " << +code_m[i]
                    << " vs reference " << +want_m;
    }
    if (code_v[i] != want_v && bad_v++ < 5) {
      ADD_FAILURE() << "v " << v[i] << " (scale " << scale_v[i / 4] << ", u " << u.v << "): " << +code_v[i]
                    << " vs reference " << +want_v;
    }
  }
  EXPECT_EQ(bad_m, 0u);
  EXPECT_EQ(bad_v, 0u);
}

TEST(AdamW8bitGpu, GraphReplayEqualsEagerAndUsesTwoKernels) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const optim::SlabLayout layout(test::random_specs(rng, 300, 20000), 1);
  for (Quantization q : {Quantization::companded, Quantization::linear}) {
    OptimizerConfig config;
    config.type = "adamw8bit";
    config.grad_clip = 1.0;
    config.adamw8bit.quantization = q;
    config.adamw8bit.min_8bit_size = 1000;
    Run8 eager(core::Device::cuda(0), layout, config, {}, optim::Optimizer::kDefaultChunkElements);
    Run8 graphed(core::Device::cuda(0), layout, config, {}, optim::Optimizer::kDefaultChunkElements);
    const auto w0 = test::random_normal(rng, static_cast<std::size_t>(layout.total_elements()));
    test::from_host(eager.slab.master(), w0);
    test::from_host(graphed.slab.master(), w0);

    cudaStream_t stream = graphed.context.stream();
    cudaGraph_t graph = test::capture_graph(stream, [&] { graphed.opt.step(3e-4); });
    EXPECT_EQ(test::kernel_nodes(graph), 2)
        << "a step must be two launches for " << layout.tensors().size() << " tensors";
    cudaGraphExec_t exec = nullptr;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    for (int step = 0; step < 4; ++step) {
      const auto g = test::random_grads(rng, layout, step == 2 ? 5.0f : 0.1f);
      test::from_host(eager.slab.grad(), g);
      test::from_host(graphed.slab.grad(), g);
      eager.opt.step(3e-4);
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      eager.context.synchronize();
    }
    EXPECT_EQ(test::to_host<float>(eager.slab.master()), test::to_host<float>(graphed.slab.master()));
    EXPECT_TRUE(
        identical(test::to_host<std::uint8_t>(eager.opt.q_m()), test::to_host<std::uint8_t>(graphed.opt.q_m())));
    EXPECT_TRUE(
        identical(test::to_host<std::uint8_t>(eager.opt.q_v()), test::to_host<std::uint8_t>(graphed.opt.q_v())));
    EXPECT_EQ(test::to_host<float>(eager.opt.scale_m()), test::to_host<float>(graphed.opt.scale_m()));
    EXPECT_EQ(test::to_host<float>(eager.opt.small_v()), test::to_host<float>(graphed.opt.small_v()));
    EXPECT_EQ(test::to_host<std::uint16_t>(eager.slab.mirror()), test::to_host<std::uint16_t>(graphed.slab.mirror()));
    EXPECT_EQ(graphed.opt.report().step, 4);  // capturing runs nothing: 4 replays
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
  }
}

TEST(AdamW8bitGpu, ShardedGradientsMatchFullGradients) {
  REQUIRE_GPU();
  for (Quantization q : {Quantization::companded, Quantization::linear}) {
    OptimizerConfig config;
    config.type = "adamw8bit";
    config.lr = 1e-2;
    config.grad_clip = 1.0;
    config.adamw8bit.quantization = q;
    for (int world : {3, 2}) test::check_sharded_gradients_match_full(core::Device::cuda(0), config, world, 1);
  }
}

}  // namespace
