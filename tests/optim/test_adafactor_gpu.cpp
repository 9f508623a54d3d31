// The CUDA Adafactor step against the CPU reference on fresh random data: many tensor lists with
// odd shapes (factored and not), sharded ranges, both policies, first moment on and off, graph
// replay, a launch count that does not depend on the number of tensors, and ZeRO-2 gradients over
// the owned shard only stepping exactly like gradients over the whole slab.
// Tolerance: row sums are added in another order on the GPU (fp32 per-thread partials), which
// moves R and C by a few ulps; weights are compared at 1e-6 relative
// plus 1e-7 absolute (updates are ~1e-2, so 1e-5 of an update), the first moment at 1e-6
// relative plus 1e-6 of its largest value.
#include <cmath>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/half.h"
#include "optim/adafactor.h"
#include "optim/adafactor_support.h"
#include "optim/sharded_grads_support.h"
#include "support/test_support.h"

namespace {

using optim::OptimizerConfig;
using optim::ParamSpec;
using test::factor_2d;

struct AdafactorRun {
  core::DeviceContext context;
  optim::Slab slab;
  optim::Adafactor opt;
  AdafactorRun(core::Device device, const optim::SlabLayout& layout, const OptimizerConfig& config,
               optim::SlabOptions options)
      : context(device), slab(layout, context, options), opt(config, slab, context) {
    context.synchronize();
  }
};

TEST(AdafactorGpu, MatchesReferenceOverRandomTensorLists) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  for (int trial = 0; trial < 20; ++trial) {
    const int world = trial % 3 == 2 ? 2 + static_cast<int>(rng() % 3) : 1;
    const int rank = static_cast<int>(rng() % static_cast<std::uint64_t>(world));
    auto specs = factor_2d(test::random_specs(rng, 1 + static_cast<int>(rng() % 40), trial % 4 == 0 ? 200000 : 5000));
    specs.push_back({.name = "wide", .shape = {3, 2000 + static_cast<std::int64_t>(rng() % 300)}, .factored = true});
    const optim::SlabLayout layout(specs, world);
    OptimizerConfig config;
    config.type = "adafactor";
    config.lr = 1e-2;
    config.weight_decay = trial % 2 ? 0.1 : 0.0;
    config.grad_clip = trial % 4 == 1 ? 0.0 : 2.0;
    config.nonfinite = trial % 2 ? optim::NonFinitePolicy::zero_element : optim::NonFinitePolicy::skip_step;
    if (trial % 3 == 0) config.adafactor.beta1 = 0.9;
    config.adafactor.eps1_mode = trial % 5 == 3 ? optim::Eps1Mode::clamp : optim::Eps1Mode::add;
    config.adafactor.decay_scale = trial % 2 ? optim::DecayScale::alpha : optim::DecayScale::lr;
    config.adafactor.relative_step = trial % 7 != 4;
    config.adafactor.scale_parameter = trial % 6 != 5;
    const optim::SlabOptions options{.rank = rank,
                                     .zero_stage = world > 1 ? 1 : 0,
                                     .mirror_dtype = trial % 3 == 1 ? core::DType::f16 : core::DType::bf16};
    const std::string where = "trial " + std::to_string(trial) + " (" + std::to_string(specs.size()) +
                              " tensors, world " + std::to_string(world) + ", rank " + std::to_string(rank) + ")";
    AdafactorRun gpu(core::Device::cuda(0), layout, config, options);
    AdafactorRun cpu(core::Device::cpu(), layout, config, options);
    const auto master = test::random_normal(rng, gpu.slab.master().bytes() / 4);
    test::from_host(gpu.slab.master(), master);
    test::from_host(cpu.slab.master(), master);
    for (int step = 0; step < 3; ++step) {
      auto g = test::random_grads(rng, layout, step == 1 ? 3.0f : 0.05f);
      if (trial % 4 == 3 && step == 1 && !gpu.slab.segments().empty()) {
        const auto& seg = gpu.slab.segments()[rng() % gpu.slab.segments().size()];
        g[static_cast<std::size_t>(seg.offset)] = INFINITY;
      }
      test::from_host(gpu.slab.grad(), g);
      test::from_host(cpu.slab.grad(), g);
      gpu.opt.step(config.lr);
      cpu.opt.step(config.lr);
      const auto rg = gpu.opt.report();
      const auto rc = cpu.opt.report();
      const std::string at = where + ", step " + std::to_string(step + 1);
      EXPECT_EQ(rg.step, rc.step) << at;
      EXPECT_EQ(rg.nonfinite, rc.nonfinite) << at;
      EXPECT_TRUE(
          test::all_close(test::to_host<float>(gpu.slab.master()), test::to_host<float>(cpu.slab.master()), 1e-6, 1e-7))
          << at << ": master";
      EXPECT_TRUE(test::all_close(test::to_host<float>(gpu.opt.row_col_state()),
                                  test::to_host<float>(cpu.opt.row_col_state()), 1e-6, 0))
          << at << ": row/column state";
      EXPECT_TRUE(
          test::all_close(test::to_host<float>(gpu.opt.v_state()), test::to_host<float>(cpu.opt.v_state()), 1e-6, 0))
          << at << ": v";
      if (config.adafactor.beta1) {
        const auto m_cpu = test::to_host<float>(cpu.opt.exp_avg());
        float m_max = 0;
        for (float x : m_cpu) m_max = std::max(m_max, std::fabs(x));
        EXPECT_TRUE(test::all_close(test::to_host<float>(gpu.opt.exp_avg()), m_cpu, 1e-6, 1e-6 * m_max))
            << at << ": exp_avg";
      }
      const auto grads = test::to_host<float>(gpu.slab.grad());
      const auto mirror = test::to_host<std::uint16_t>(gpu.slab.mirror());
      const auto gm = test::to_host<float>(gpu.slab.master());
      const auto owned = gpu.slab.owned();
      for (const auto& seg : gpu.slab.segments()) {
        for (std::int64_t i = seg.offset; i < seg.offset + seg.length; ++i) {
          ASSERT_EQ(grads[static_cast<std::size_t>(i)], 0.0f) << at;
          if (rg.step > 0) {
            const float w = gm[static_cast<std::size_t>(i - owned.begin)];
            ASSERT_EQ(mirror[static_cast<std::size_t>(i)],
                      options.mirror_dtype == core::DType::bf16 ? core::float_to_bf16(w) : core::float_to_fp16(w))
                << at;
          }
        }
      }
      if (HasFailure()) return;
    }
  }
}

TEST(AdafactorGpu, ShardedPartialsReproduceTheUnshardedStep) {
  REQUIRE_GPU();
  test::check_shards_match_unsharded(core::Device::cuda(0));
}

int kernels_in_step(optim::Optimizer& opt, cudaStream_t stream) {
  cudaGraph_t graph = test::capture_graph(stream, [&] { opt.step(1e-2); });
  const int kernels = test::kernel_nodes(graph);
  CUDA_CHECK(cudaGraphDestroy(graph));
  return kernels;
}

TEST(AdafactorGpu, LaunchCountDoesNotGrowWithTensorsAndGraphReplayEqualsEager) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  OptimizerConfig config;
  config.type = "adafactor";
  config.lr = 1e-2;
  config.adafactor.beta1 = 0.9;
  std::vector<int> counts;
  for (int tensors : {5, 300}) {
    auto specs = factor_2d(test::random_specs(rng, tensors, 3000));
    specs.push_back({.name = "m", .shape = {20, 30}, .factored = true});
    specs.push_back({.name = "b", .shape = {30}});
    AdafactorRun run(core::Device::cuda(0), optim::SlabLayout(specs, 1), config, {});
    counts.push_back(kernels_in_step(run.opt, run.context.stream()));
  }
  EXPECT_EQ(counts[0], counts[1]);
  EXPECT_EQ(counts[0], 6);  // statistics, reductions, EMA, U sums, U reductions, update

  const optim::SlabLayout layout(factor_2d(test::random_specs(rng, 60, 20000)), 1);
  AdafactorRun eager(core::Device::cuda(0), layout, config, {});
  AdafactorRun graphed(core::Device::cuda(0), layout, config, {});
  const auto master = test::random_normal(rng, eager.slab.master().bytes() / 4);
  test::from_host(eager.slab.master(), master);
  test::from_host(graphed.slab.master(), master);
  cudaStream_t stream = graphed.context.stream();
  cudaGraph_t graph = test::capture_graph(stream, [&] { graphed.opt.step(1e-2); });
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int step = 0; step < 4; ++step) {
    const auto g = test::random_grads(rng, layout, 0.3f);
    test::from_host(eager.slab.grad(), g);
    test::from_host(graphed.slab.grad(), g);
    eager.opt.step(1e-2);
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    eager.context.synchronize();
  }
  EXPECT_EQ(test::to_host<float>(eager.slab.master()), test::to_host<float>(graphed.slab.master()));
  EXPECT_EQ(test::to_host<float>(eager.opt.row_col_state()), test::to_host<float>(graphed.opt.row_col_state()));
  EXPECT_EQ(test::to_host<float>(eager.opt.exp_avg()), test::to_host<float>(graphed.opt.exp_avg()));
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
}

TEST(AdafactorGpu, ShardedGradientsMatchFullGradients) {
  REQUIRE_GPU();
  for (bool beta1 : {true, false}) {
    OptimizerConfig config = test::adafactor_config();  // clips at 1.0
    if (!beta1) config.adafactor.beta1.reset();
    for (int world : {3, 2}) test::check_sharded_gradients_match_full(core::Device::cuda(0), config, world, 1);
  }
}

}  // namespace
