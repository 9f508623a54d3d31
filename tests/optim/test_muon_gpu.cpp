// The CUDA Muon step against the CPU reference on fresh random data: matrices of several shapes
// (tall, wide, parts, stacked, shapes shared by several matrices so the products are batched),
// the AdamW rest, simulated ZeRO shards (1 to 4 ranks), and a skipped step; the buffers the memory
// plan counts (muon_load.h) against what the GPU optimizer allocates.
// Tolerance: the GPU's Newton-Schulz runs in bf16 with fp32 accumulation, the CPU's in fp32, so a
// matrix's update (weight after minus before) agrees within 5e-2 normwise (bf16 keeps 8 bits and
// five iterations compound the roundings: a host emulation of the bf16 iteration on these shapes
// differs from fp64 by 0.5e-2 to 2.3e-2); the momentum and AdamW's tensors within 1e-6 relative.
#include <algorithm>
#include <cmath>

#include <gtest/gtest.h>

#include "core/half.h"
#include "optim/muon.h"
#include "optim/muon_load.h"
#include "optim/sharded_run_support.h"
#include "support/test_support.h"

namespace {

using optim::OptimizerConfig;
using optim::ParamSpec;

std::vector<ParamSpec> gpu_specs() {
  return {{.name = "embed", .shape = {53, 32}, .factored = true},
          {.name = "norm", .shape = {32}, .decay = false},
          {.name = "qkv", .shape = {64, 32}, .hidden_matrix = true, .parts = {{"q", 32}, {"k", 16}, {"v", 16}}},
          {.name = "o", .shape = {32, 32}, .hidden_matrix = true},
          {.name = "xz", .shape = {64, 32}, .hidden_matrix = true, .stacked_rows = 32},
          {.name = "up", .shape = {96, 32}, .hidden_matrix = true},
          {.name = "down", .shape = {32, 96}, .lr_scale = 0.5f, .hidden_matrix = true},
          {.name = "odd", .shape = {7, 45}, .decay = false, .hidden_matrix = true},
          {.name = "bias", .shape = {5}, .decay = false}};
}

OptimizerConfig gpu_config(int trial) {
  OptimizerConfig c;
  c.type = "muon";
  c.lr = 3e-3;
  c.weight_decay = 0.05;
  c.grad_clip = trial % 2 ? 1.0 : 0.0;
  c.nonfinite = trial % 2 ? optim::NonFinitePolicy::zero_element : optim::NonFinitePolicy::skip_step;
  c.muon.lr = 2e-2;
  c.muon.nesterov = trial % 3 != 2;
  c.muon.adjust_lr = trial % 2 ? optim::MuonAdjustLr::match_rms_adamw : optim::MuonAdjustLr::original;
  return c;
}

// Normwise distance of the updates a - before and b - before over [begin, end).
double update_error(const std::vector<float>& a, const std::vector<float>& b, const std::vector<float>& before,
                    std::int64_t begin, std::int64_t end) {
  double diff = 0, norm = 0;
  for (std::int64_t i = begin; i < end; ++i) {
    const double da = static_cast<double>(a[i]) - before[i], db = static_cast<double>(b[i]) - before[i];
    diff += (da - db) * (da - db);
    norm += db * db;
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

TEST(MuonGpu, MatchesCpuReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  for (int trial = 0; trial < 6; ++trial) {
    const int world = trial < 3 ? 1 : trial - 1;  // 1, 1, 1, 2, 3, 4 simulated ranks
    SCOPED_TRACE("trial " + std::to_string(trial) + ", world " + std::to_string(world));
    const OptimizerConfig config = gpu_config(trial);
    const auto specs = gpu_specs();
    test::ShardedRunOf<optim::Muon> gpu(core::Device::cuda(0), specs, world, config);
    test::ShardedRunOf<optim::Muon> cpu(core::Device::cpu(), specs, world, config);
    const optim::SlabLayout layout(specs, world);
    const auto master = test::random_normal(rng, static_cast<std::size_t>(layout.total_elements()), 0.05f);
    std::vector<float> before = master;
    for (int step = 0; step < 3; ++step) {
      const auto g = test::random_grads(rng, layout, step == 1 ? 3.0f : 0.05f);
      if (step == 0) {
        gpu.load(master, g);
        cpu.load(master, g);
      } else {
        for (auto& s : gpu.slabs) test::from_host(s->grad(), g);
        for (auto& s : cpu.slabs) test::from_host(s->grad(), g);
      }
      gpu.step(config.lr);
      cpu.step(config.lr);
      const auto a = gpu.master(), b = cpu.master();
      const auto& plan = cpu.opts[0]->plan();
      for (const auto& t : layout.parameters()) {
        const auto index = static_cast<std::size_t>(&t - layout.parameters().data());
        if (plan.is_matrix[index]) {
          EXPECT_LE(update_error(a, b, before, t.offset, t.offset + t.numel), 5e-2)
              << t.spec.name << ", step " << step + 1;
        } else {
          for (std::int64_t i = t.offset; i < t.offset + t.numel; ++i) {
            ASSERT_NEAR(a[static_cast<std::size_t>(i)], b[static_cast<std::size_t>(i)],
                        1e-6 * std::fabs(b[static_cast<std::size_t>(i)]) + 1e-9)
                << t.spec.name << ", step " << step + 1;
          }
        }
      }
      for (std::size_t r = 0; r < gpu.slabs.size(); ++r) {
        EXPECT_EQ(gpu.opts[r]->report().step, cpu.opts[r]->report().step);
        const auto m_gpu = test::to_host<float>(gpu.opts[r]->exp_avg());
        const auto m_cpu = test::to_host<float>(cpu.opts[r]->exp_avg());
        EXPECT_TRUE(test::all_close(m_gpu, m_cpu, 1e-6, 1e-9)) << "momentum and AdamW m, rank " << r;
        // The optimizer zeroes the gradients it consumed, the owned range (the trainer's gradient
        // sync zeroes the rest under ZeRO-1: GradientSync::zero_outside_owned).
        const auto grads = test::to_host<float>(gpu.slabs[r]->grad());
        const auto owned_grads = gpu.slabs[r]->owned();
        for (std::int64_t i = owned_grads.begin; i < owned_grads.end; ++i) {
          ASSERT_EQ(grads[static_cast<std::size_t>(i - gpu.slabs[r]->grad_covers().begin)], 0.0f)
              << "gradient not zeroed at " << i;
        }
        // The mirror of every owned parameter element holds the weight rounded to bf16 (the
        // alignment padding between tensors is no parameter's and nothing reads it).
        const auto mirror = test::to_host<std::uint16_t>(gpu.slabs[r]->mirror());
        const auto owned = gpu.slabs[r]->owned();
        for (const auto& t : layout.parameters()) {
          for (std::int64_t i = std::max(owned.begin, t.offset); i < std::min(owned.end, t.offset + t.numel); i += 7) {
            ASSERT_EQ(mirror[static_cast<std::size_t>(i - gpu.slabs[r]->mirror_covers().begin)],
                      core::float_to_bf16(a[static_cast<std::size_t>(i)]))
                << "mirror of element " << i << " (" << t.spec.name << ")";
          }
        }
      }
      // Continue both from the CPU's weights, so each step's updates are compared on their own.
      before = b;
      gpu.load(b, g);
    }
  }
}

TEST(MuonGpu, SkippedStepOnlyZeroesGradients) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const auto specs = gpu_specs();
  const OptimizerConfig config = gpu_config(0);  // skip_step
  test::ShardedRunOf<optim::Muon> gpu(core::Device::cuda(0), specs, 1, config);
  const optim::SlabLayout layout(specs, 1);
  const auto master = test::random_normal(rng, static_cast<std::size_t>(layout.total_elements()), 0.05f);
  auto g = test::random_grads(rng, layout, 0.05f);
  g[static_cast<std::size_t>(layout.tensor("up").offset + 17)] = NAN;
  gpu.load(master, g);
  gpu.step(config.lr);
  EXPECT_EQ(gpu.master(), master);
  for (float x : test::to_host<float>(gpu.slabs[0]->grad())) ASSERT_EQ(x, 0.0f);
  for (float m : test::to_host<float>(gpu.opts[0]->exp_avg())) ASSERT_EQ(m, 0.0f);
  const auto report = gpu.opts[0]->report();
  EXPECT_TRUE(report.skipped);
  EXPECT_EQ(report.step, 0);
  EXPECT_EQ(report.skipped_steps, 1);
}

TEST(MuonGpu, PlannedBuffersMatchAllocation) {
  REQUIRE_GPU();
  const auto specs = gpu_specs();
  for (int world : {1, 3}) {
    const optim::MuonLoad load = optim::muon_load(optim::SlabLayout(specs, world), 1, 5);
    test::ShardedRunOf<optim::Muon> gpu(core::Device::cuda(0), specs, world, gpu_config(0));
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(gpu.opts[static_cast<std::size_t>(r)]->buffer_bytes(),
                load.ranks[static_cast<std::size_t>(r)].bytes(true))
          << "rank " << r << " of " << world;
    }
  }
}

}  // namespace
