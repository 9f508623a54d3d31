// The floors of the training step's breakdown (bench/qwen3_step_floors.h): the products' FLOPs
// add up to the MFU count of a step (6 FLOPs per parameter and token, the norms' weights aside,
// plus attention), and the per-mode phases appear only where they run.
#include <gtest/gtest.h>

#include "bench/qwen3_step_floors.h"
#include "models/model_config.h"
#include "models/registry.h"

namespace {

TEST(Qwen3StepFloors, ProductsMatchTheMfuCount) {
  const models::Family& family = models::family("qwen3");
  for (const char* preset : {"qwen3-0.6b", "qwen3-4b"}) {
    const models::Shape shape = models::base_shape(family, preset);
    const auto spec = family.spec(shape);
    const std::int64_t batch = 8, seq = 2048;
    const bench::Qwen3StepShape s = bench::qwen3_step_shape(shape, batch, seq, spec->parameter_count());
    double flops = 0;
    for (const auto& [name, work] : bench::qwen3_step_work(s)) {
      EXPECT_TRUE((work.flops > 0) != (work.bytes > 0)) << name;
      flops += work.flops;
    }
    // The norm weights (two per layer, q and k norms, the final norm) are parameters but no product.
    const double norms = static_cast<double>(s.layers * (2 * s.hidden + 2 * s.head_dim) + s.hidden);
    const double expected =
        spec->flops_per_token(seq) * static_cast<double>(batch * seq) - 6.0 * norms * static_cast<double>(batch * seq);
    EXPECT_NEAR(flops / expected, 1.0, 1e-12) << preset;
  }
}

TEST(Qwen3StepFloors, RecomputeAndOptimizerPhases) {
  const models::Family& family = models::family("qwen3");
  const models::Shape shape = models::base_shape(family, "qwen3-0.6b");
  bench::Qwen3StepShape s = bench::qwen3_step_shape(shape, 2, 128, family.spec(shape)->parameter_count());
  auto work = bench::qwen3_step_work(s);
  EXPECT_EQ(work.count("recompute.bwd"), 0u);
  ASSERT_EQ(work.count("optimizer.update"), 1u);
  EXPECT_DOUBLE_EQ(work["optimizer.grad_stats"].bytes, 4.0 * static_cast<double>(s.parameters));
  s.recompute = "mlp";
  const double mlp = bench::qwen3_step_work(s)["recompute.bwd"].flops;
  EXPECT_DOUBLE_EQ(mlp, work["mlp.gate_up.fwd"].flops);
  s.recompute = "full";
  EXPECT_GT(bench::qwen3_step_work(s)["recompute.bwd"].flops, mlp);
  s.optimizer = "muon";
  EXPECT_EQ(bench::qwen3_step_work(s).count("optimizer.update"), 0u);
}

}  // namespace
