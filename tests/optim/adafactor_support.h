// Helpers shared by the Adafactor test suites: 2-D tensors marked factored, and the check that
// simulated ZeRO shards (sharded_run_support.h) reproduce the unsharded step.
#pragma once

#include <memory>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "optim/adafactor.h"
#include "optim/sharded_run_support.h"
#include "support/test_support.h"

namespace test {

using optim::OptimizerConfig;
using optim::ParamSpec;

inline std::vector<ParamSpec> factor_2d(std::vector<ParamSpec> specs) {
  for (auto& s : specs) s.factored = s.shape.size() == 2;
  return specs;
}

inline OptimizerConfig adafactor_config(optim::NonFinitePolicy policy = optim::NonFinitePolicy::skip_step) {
  OptimizerConfig c;
  c.type = "adafactor";
  c.lr = 1e-2;
  c.weight_decay = 0.05;
  c.grad_clip = 1.0;
  c.nonfinite = policy;
  c.adafactor.beta1 = 0.9;
  return c;
}

using ShardedRun = ShardedRunOf<optim::Adafactor>;

inline void check_shards_match_unsharded(core::Device device) {
  std::mt19937_64 rng(test::fresh_seed());
  for (int trial = 0; trial < 6; ++trial) {
    auto specs = factor_2d(test::random_specs(rng, 12, 3000));
    specs.push_back({.name = "matrix", .shape = {37, 129}, .factored = true});
    const OptimizerConfig config = adafactor_config();
    for (int world : {2, 3, 4}) {
      SCOPED_TRACE("trial " + std::to_string(trial) + ", world " + std::to_string(world));
      ShardedRun single(device, specs, 1, config);
      ShardedRun sharded(device, specs, world, config);
      const optim::SlabLayout layout(specs, world);
      auto master = test::random_normal(rng, static_cast<std::size_t>(layout.total_elements()));
      for (int step = 0; step < 3; ++step) {
        const auto g = test::random_grads(rng, layout, step == 1 ? 3.0f : 0.1f);
        if (step == 0) {
          single.load(std::vector<float>(master.begin(), master.begin() + single.slabs[0]->owned().size()),
                      std::vector<float>(g.begin(), g.begin() + single.slabs[0]->full().size()));
          sharded.load(master, g);
        } else {
          test::from_host(single.slabs[0]->grad(),
                          std::vector<float>(g.begin(), g.begin() + single.slabs[0]->full().size()));
          for (auto& s : sharded.slabs) test::from_host(s->grad(), g);
        }
        single.step(1e-2);
        sharded.step(1e-2);
      }
      const auto a = single.master();
      const auto b = sharded.master();
      EXPECT_TRUE(test::all_close(std::vector<float>(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(a.size())), a,
                                  1e-6, 1e-7));
      const auto state = test::to_host<float>(single.opts[0]->row_col_state());
      for (const auto& o : sharded.opts) {
        // Every shard keeps the statistics of the factored tensors it touches; where it touches
        // one, its copy equals the unsharded one.
        const auto s = test::to_host<float>(o->row_col_state());
        for (std::size_t si = 0; si < o->plan().segments.size(); ++si) {
          const auto& info = o->plan().segments[si];
          if (!info.factored) continue;
          const auto& seg = o->slab().segments()[si];
          const std::size_t begin = static_cast<std::size_t>(info.row_state);
          const std::size_t n = static_cast<std::size_t>(seg.rows + seg.cols);
          EXPECT_TRUE(test::all_close(std::vector<float>(s.begin() + begin, s.begin() + begin + n),
                                      std::vector<float>(state.begin() + begin, state.begin() + begin + n), 1e-6, 0))
              << "row/column state of tensor " << seg.tensor;
        }
      }
    }
  }
}

}  // namespace test
