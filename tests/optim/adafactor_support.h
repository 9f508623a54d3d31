// Helpers shared by the Adafactor test suites: 2-D tensors marked factored, random gradients for
// every tensor element, and several simulated ZeRO shards of one slab stepped in lock-step with
// their partial statistics summed between phases, as the all-reduce will do.
#pragma once

#include <memory>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "optim/adafactor.h"
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

// Runs `steps` steps over `world` simulated shards of one layout, summing each phase's partials
// across the shards (what the ZeRO all-reduce will do), and returns the shards' masters joined.
struct ShardedRun {
  std::vector<std::unique_ptr<core::DeviceContext>> contexts;
  std::vector<std::unique_ptr<optim::Slab>> slabs;
  std::vector<std::unique_ptr<optim::Adafactor>> opts;

  ShardedRun(core::Device device, const std::vector<ParamSpec>& specs, int world, const OptimizerConfig& config) {
    const optim::SlabLayout layout(specs, world);
    for (int r = 0; r < world; ++r) {
      contexts.push_back(std::make_unique<core::DeviceContext>(device));
      slabs.push_back(std::make_unique<optim::Slab>(layout, *contexts.back(),
                                                    optim::SlabOptions{.rank = r, .zero_stage = world > 1 ? 1 : 0}));
      opts.push_back(std::make_unique<optim::Adafactor>(config, *slabs.back(), *contexts.back()));
    }
  }

  void load(const std::vector<float>& master, const std::vector<float>& grad) {
    for (auto& slab : slabs) {
      const auto owned = slab->owned();
      test::from_host(slab->master(), std::vector<float>(master.begin() + owned.begin, master.begin() + owned.end));
      test::from_host(slab->grad(), grad);
    }
  }

  void step(double lr) {
    const int phases = opts[0]->phase_count();
    for (int phase = 0; phase < phases; ++phase) {
      for (auto& o : opts) o->run_phase(phase, lr);
      if (phase + 1 == phases) break;
      sum_partials(phase);
    }
    for (auto& c : contexts) c->synchronize();
  }

  void sum_partials(int phase) {
    for (auto& c : contexts) c->synchronize();  // every shard's phase has finished
    std::vector<std::vector<optim::Partial>> parts;
    for (auto& o : opts) parts.push_back(o->phase_partials(phase));
    for (std::size_t k = 0; k < parts[0].size(); ++k) {
      const auto& p0 = parts[0][k];
      const std::size_t bytes = p0.count * core::dtype_size(p0.dtype);
      std::vector<double> sum_f(p0.count, 0.0);
      std::vector<unsigned long long> sum_u(p0.count, 0);
      for (auto& rank_parts : parts) {
        const auto& p = rank_parts[k];
        std::vector<char> host(bytes);
        core::copy_bytes(host.data(), p.data, bytes, contexts[0]->stream());
        contexts[0]->synchronize();
        for (std::size_t i = 0; i < p.count; ++i) {
          if (p.dtype == core::DType::f64) {
            sum_f[i] += reinterpret_cast<const double*>(host.data())[i];
          } else {
            sum_u[i] += reinterpret_cast<const unsigned long long*>(host.data())[i];
          }
        }
      }
      for (auto& rank_parts : parts) {
        const void* src = p0.dtype == core::DType::f64 ? static_cast<const void*>(sum_f.data()) : sum_u.data();
        core::copy_bytes(rank_parts[k].data, src, bytes, contexts[0]->stream());
        contexts[0]->synchronize();
      }
    }
  }

  std::vector<float> master() const {
    std::vector<float> out;
    for (const auto& slab : slabs) {
      const auto part = test::to_host<float>(slab->master());
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  }
};

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
