// The CUDA AdamW step (statistics + update) against the CPU reference on fresh random data:
// many tensor lists with odd sizes, both mirror types, both non-finite policies, sharded
// ranges, CUDA-graph replay, launch count, determinism, indices beyond 2^31, and ZeRO-2 gradients
// over the owned shard only stepping exactly like gradients over the whole slab.
#include <cmath>
#include <memory>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/half.h"
#include "optim/adamw.h"
#include "optim/sharded_grads_support.h"
#include "support/test_support.h"

namespace {

using optim::NonFinitePolicy;
using optim::OptimizerConfig;

struct OptimizerRun {
  core::DeviceContext context;
  optim::Slab slab;
  optim::AdamW adamw;

  OptimizerRun(core::Device device, const optim::SlabLayout& layout, const OptimizerConfig& config,
               optim::SlabOptions options, std::int64_t chunk)
      : context(device), slab(layout, context, options), adamw(config, slab, context, chunk) {
    context.synchronize();
  }
};

struct HostState {
  std::vector<float> master, m, v, grad;
};

void load(OptimizerRun& run, const HostState& s) {
  test::from_host(run.slab.master(), s.master);
  test::from_host(run.adamw.exp_avg(), s.m);
  test::from_host(run.adamw.exp_avg_sq(), s.v);
  test::from_host(run.slab.grad(), s.grad);
}

// Random gradients for every tensor element (padding stays 0, as in training).

void expect_same_step(OptimizerRun& gpu, OptimizerRun& cpu, const std::string& where) {
  const auto rg = gpu.adamw.report();
  const auto rc = cpu.adamw.report();
  EXPECT_EQ(rg.step, rc.step) << where;
  EXPECT_EQ(rg.skipped_steps, rc.skipped_steps) << where;
  EXPECT_EQ(rg.nonfinite, rc.nonfinite) << where;
  EXPECT_NEAR(rg.grad_norm, rc.grad_norm, 1e-12 * rc.grad_norm) << where;

  const double rtol = 1e-6;
  EXPECT_TRUE(
      test::all_close(test::to_host<float>(gpu.slab.master()), test::to_host<float>(cpu.slab.master()), rtol, 0))
      << where << ": master";
  EXPECT_TRUE(
      test::all_close(test::to_host<float>(gpu.adamw.exp_avg()), test::to_host<float>(cpu.adamw.exp_avg()), rtol, 0))
      << where << ": exp_avg";
  EXPECT_TRUE(test::all_close(test::to_host<float>(gpu.adamw.exp_avg_sq()),
                              test::to_host<float>(cpu.adamw.exp_avg_sq()), rtol, 0))
      << where << ": exp_avg_sq";

  const auto grads = test::to_host<float>(gpu.slab.grad());
  const auto owned = gpu.slab.owned();
  for (std::int64_t i = owned.begin; i < owned.end; ++i) {
    ASSERT_EQ(grads[static_cast<std::size_t>(i)], 0.0f) << where << ": gradient " << i << " not zeroed";
  }
  const auto master = test::to_host<float>(gpu.slab.master());
  const auto mirror = test::to_host<std::uint16_t>(gpu.slab.mirror());
  const bool bf16 = gpu.slab.mirror_dtype() == core::DType::bf16;
  for (const auto& seg : gpu.slab.segments()) {
    for (std::int64_t i = seg.offset; i < seg.offset + seg.length; ++i) {
      const float w = master[static_cast<std::size_t>(i - owned.begin)];
      ASSERT_EQ(mirror[static_cast<std::size_t>(i)], bf16 ? core::float_to_bf16(w) : core::float_to_fp16(w))
          << where << ": mirror element " << i;
    }
  }
}

TEST(AdamWGpu, MatchesReferenceOverRandomTensorLists) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const std::int64_t chunk_sizes[] = {64, 1024, 16384, 65536};
  for (int trial = 0; trial < 24; ++trial) {
    const int world = trial % 4 == 3 ? 1 + static_cast<int>(rng() % 4) : 1;
    const int rank = static_cast<int>(rng() % static_cast<std::uint64_t>(world));
    const int count = 1 + static_cast<int>(rng() % 60);
    const std::int64_t max_numel = trial % 5 == 0 ? 300000 : 5000;
    const optim::SlabLayout layout(test::random_specs(rng, count, max_numel), world);
    OptimizerConfig config;
    config.lr = 1e-3 * (0.1 + unit(rng));
    config.beta1 = 0.8 + 0.15 * unit(rng);
    config.beta2 = 0.9 + 0.099 * unit(rng);
    config.eps = trial % 2 ? 1e-8 : 1e-6;
    config.weight_decay = trial % 3 ? 0.1 * unit(rng) : 0.0;
    config.grad_clip = trial % 4 == 0 ? 0.0 : 0.5 + 50 * unit(rng);
    config.nonfinite = trial % 2 ? NonFinitePolicy::zero_element : NonFinitePolicy::skip_step;
    const optim::SlabOptions options{.rank = rank,
                                     .zero_stage = world > 1 ? 1 : 0,
                                     .mirror_dtype = trial % 3 == 1 ? core::DType::f16 : core::DType::bf16};
    const std::int64_t chunk = chunk_sizes[trial % 4];
    const std::string where = "trial " + std::to_string(trial) + " (" + std::to_string(count) + " tensors, world " +
                              std::to_string(world) + ", rank " + std::to_string(rank) + ", chunk " +
                              std::to_string(chunk) + ")";

    OptimizerRun gpu(core::Device::cuda(0), layout, config, options, chunk);
    OptimizerRun cpu(core::Device::cpu(), layout, config, options, chunk);
    const auto owned = static_cast<std::size_t>(gpu.slab.owned().size());
    HostState s;
    s.master = test::random_normal(rng, owned);
    s.m = test::random_normal(rng, owned, 0.01f);
    s.v = test::random_normal(rng, owned, 1e-4f);
    for (float& x : s.v) x = x * x;
    s.grad = test::random_grads(rng, layout, 0.05f);
    load(gpu, s);
    load(cpu, s);
    for (int step = 0; step < 3; ++step) {
      if (step > 0) {
        auto g = test::random_grads(rng, layout, step == 1 ? 2.0f : 0.01f);
        if (trial % 3 == 2 && step == 1) test::poison_one_gradient(rng, gpu.slab.segments(), g);
        test::from_host(gpu.slab.grad(), g);
        test::from_host(cpu.slab.grad(), g);
      }
      const double lr = config.lr * (1.0 - 0.2 * step);
      gpu.adamw.step(lr);
      cpu.adamw.step(lr);
      expect_same_step(gpu, cpu, where + ", step " + std::to_string(step + 1));
      if (HasFailure()) return;
    }
  }
}

TEST(AdamWGpu, GraphReplayEqualsEagerAndUsesTwoKernels) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const optim::SlabLayout layout(test::random_specs(rng, 300, 20000), 1);
  OptimizerConfig config;
  config.grad_clip = 1.0;
  OptimizerRun eager(core::Device::cuda(0), layout, config, {}, optim::Optimizer::kDefaultChunkElements);
  OptimizerRun graphed(core::Device::cuda(0), layout, config, {}, optim::Optimizer::kDefaultChunkElements);
  const auto n = static_cast<std::size_t>(layout.total_elements());
  HostState s{test::random_normal(rng, n), std::vector<float>(n, 0.0f), std::vector<float>(n, 0.0f),
              test::random_grads(rng, layout, 0.1f)};
  load(eager, s);
  load(graphed, s);

  cudaStream_t stream = graphed.context.stream();
  cudaGraph_t graph = test::capture_graph(stream, [&] { graphed.adamw.step(3e-4); });
  EXPECT_EQ(test::kernel_nodes(graph), 2)
      << "a step must be two launches for " << layout.tensors().size() << " tensors";
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (int step = 0; step < 4; ++step) {
    const auto g = test::random_grads(rng, layout, step == 2 ? 5.0f : 0.1f);
    test::from_host(eager.slab.grad(), g);
    test::from_host(graphed.slab.grad(), g);
    eager.adamw.step(3e-4);
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    eager.context.synchronize();
  }
  EXPECT_EQ(test::to_host<float>(eager.slab.master()), test::to_host<float>(graphed.slab.master()));
  EXPECT_EQ(test::to_host<float>(eager.adamw.exp_avg()), test::to_host<float>(graphed.adamw.exp_avg()));
  EXPECT_EQ(test::to_host<float>(eager.adamw.exp_avg_sq()), test::to_host<float>(graphed.adamw.exp_avg_sq()));
  EXPECT_EQ(test::to_host<std::uint16_t>(eager.slab.mirror()), test::to_host<std::uint16_t>(graphed.slab.mirror()));
  EXPECT_EQ(graphed.adamw.report().step, 4);  // capturing runs nothing: 4 replays
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

TEST(AdamWGpu, GradStatsAreDeterministic) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const optim::SlabLayout layout(test::random_specs(rng, 50, 200000), 1);
  OptimizerConfig config;
  OptimizerRun a(core::Device::cuda(0), layout, config, {}, 1024);
  const auto g = test::random_grads(rng, layout, 1.0f);
  double first = 0;
  for (int rep = 0; rep < 5; ++rep) {
    test::from_host(a.slab.grad(), g);
    a.adamw.step(1e-4);
    const double norm = a.adamw.report().grad_norm;
    if (rep == 0) first = norm;
    EXPECT_EQ(norm, first) << "repeat " << rep;
  }
}

TEST(AdamWGpu, WriteMirrorMatchesHostRounding) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  for (core::DType dtype : {core::DType::bf16, core::DType::f16}) {
    core::DeviceContext gpu(core::Device::cuda(0));
    optim::Slab slab(optim::SlabLayout({{.name = "x", .shape = {100003}}}, 1), gpu, {.mirror_dtype = dtype});
    auto master = test::random_normal(rng, slab.master().bytes() / 4, 1.0f);
    const float specials[] = {0.0f, -0.0f, 65504.0f, 65520.0f, 1e-8f, -3e-7f, 1e30f, INFINITY, -INFINITY, 1e-40f};
    for (std::size_t i = 0; i < master.size(); ++i) {
      if (i % 7 == 0)
        master[i] = specials[(i / 7) % std::size(specials)];
      else if (i % 3 == 0)
        master[i] = std::ldexp(master[i], static_cast<int>(i % 60) - 30);
    }
    test::from_host(slab.master(), master);
    slab.write_mirror(gpu);
    gpu.synchronize();
    const auto mirror = test::to_host<std::uint16_t>(slab.mirror());
    for (std::size_t i = 0; i < master.size(); ++i) {
      ASSERT_EQ(mirror[i], dtype == core::DType::bf16 ? core::float_to_bf16(master[i]) : core::float_to_fp16(master[i]))
          << "element " << i << " value " << master[i];
    }
  }
}

TEST(AdamWGpu, IndicesBeyond2To31) {
  REQUIRE_GPU();
  // A 2^31-element tensor first, so the checked tensor lives at global indices >= 2^31.
  // ~39 GB of device memory: skip on smaller GPUs.
  const std::int64_t big = std::int64_t{1} << 31;
  const std::int64_t small = 100003;
  const optim::SlabLayout layout({{.name = "big", .shape = {big}}, {.name = "tail", .shape = {small}}}, 1);
  std::size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const double need = static_cast<double>(layout.total_elements()) * 18.0 + 1e9;
  if (static_cast<double>(free_bytes) < need) GTEST_SKIP() << "needs " << need / 1e9 << " GB of free device memory";

  std::mt19937_64 rng(test::fresh_seed());
  OptimizerConfig config;
  config.grad_clip = 1.0;
  config.weight_decay = 0.1;
  OptimizerRun gpu(core::Device::cuda(0), layout, config, {}, optim::Optimizer::kDefaultChunkElements);
  // The reference holds only the tail tensor: with zero gradients and weights in the big tensor
  // the global norm is the tail's alone, so the tail's update must be identical.
  const optim::SlabLayout tail_layout({{.name = "tail", .shape = {small}}}, 1);
  OptimizerRun cpu(core::Device::cpu(), tail_layout, config, {}, optim::Optimizer::kDefaultChunkElements);

  const auto offset = static_cast<std::size_t>(layout.tensors()[1].offset);
  ASSERT_GE(offset, static_cast<std::size_t>(big));
  const auto w = test::random_normal(rng, small);
  const auto m = test::random_normal(rng, small, 0.01f);
  auto v = test::random_normal(rng, small, 0.01f);
  for (float& x : v) x *= x;
  for (int step = 0; step < 2; ++step) {
    const auto g = test::random_normal(rng, small, 0.5f);
    auto put = [&](core::Buffer& device_buffer, const std::vector<float>& values) {
      CUDA_CHECK(
          cudaMemcpy(device_buffer.as<float>() + offset, values.data(), values.size() * 4, cudaMemcpyHostToDevice));
    };
    if (step == 0) {
      put(gpu.slab.master(), w);
      put(gpu.adamw.exp_avg(), m);
      put(gpu.adamw.exp_avg_sq(), v);
      std::copy(w.begin(), w.end(), cpu.slab.master().as<float>());
      std::copy(m.begin(), m.end(), cpu.adamw.exp_avg().as<float>());
      std::copy(v.begin(), v.end(), cpu.adamw.exp_avg_sq().as<float>());
    }
    put(gpu.slab.grad(), g);
    std::copy(g.begin(), g.end(), cpu.slab.grad().as<float>());
    gpu.adamw.step(1e-3);
    cpu.adamw.step(1e-3);
    gpu.context.synchronize();
  }
  auto get = [&](const core::Buffer& device_buffer) {
    std::vector<float> out(small);
    CUDA_CHECK(cudaMemcpy(out.data(), device_buffer.as<float>() + offset, small * 4, cudaMemcpyDeviceToHost));
    return out;
  };
  auto host = [&](const core::Buffer& b) { return std::vector<float>(b.as<float>(), b.as<float>() + small); };
  EXPECT_NEAR(gpu.adamw.report().grad_norm, cpu.adamw.report().grad_norm, 1e-12 * cpu.adamw.report().grad_norm);
  const auto gpu_master = get(gpu.slab.master());
  EXPECT_TRUE(test::all_close(gpu_master, host(cpu.slab.master()), 1e-6, 0)) << "master";
  EXPECT_TRUE(test::all_close(get(gpu.adamw.exp_avg()), host(cpu.adamw.exp_avg()), 1e-6, 0)) << "exp_avg";
  EXPECT_TRUE(test::all_close(get(gpu.adamw.exp_avg_sq()), host(cpu.adamw.exp_avg_sq()), 1e-6, 0)) << "exp_avg_sq";
  std::vector<std::uint16_t> mirror(small);
  CUDA_CHECK(
      cudaMemcpy(mirror.data(), gpu.slab.mirror().as<std::uint16_t>() + offset, small * 2, cudaMemcpyDeviceToHost));
  for (std::size_t i = 0; i < static_cast<std::size_t>(small); ++i) {
    ASSERT_EQ(mirror[i], core::float_to_bf16(gpu_master[i])) << "mirror at global index " << offset + i;
  }
  std::vector<float> grad_tail(small, 1.0f);
  CUDA_CHECK(cudaMemcpy(grad_tail.data(), gpu.slab.grad().as<float>() + offset, small * 4, cudaMemcpyDeviceToHost));
  for (float x : grad_tail) ASSERT_EQ(x, 0.0f);
}

TEST(AdamWGpu, ShardedGradientsMatchFullGradients) {
  REQUIRE_GPU();
  OptimizerConfig config;
  config.lr = 1e-2;
  config.grad_clip = 1.0;
  for (int world : {3, 2}) test::check_sharded_gradients_match_full(core::Device::cuda(0), config, world, 1);
}

}  // namespace
