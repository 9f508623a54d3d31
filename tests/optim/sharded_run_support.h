// Several simulated ZeRO shards of one slab on one device, stepped in lock-step with each phase's
// partials summed across them between phases, as the trainer's all-reduce does.
#pragma once

#include <cstring>
#include <memory>
#include <vector>

#include "optim/optimizer.h"
#include "support/test_support.h"

namespace test {

template <typename Opt>
struct ShardedRunOf {
  std::vector<std::unique_ptr<core::DeviceContext>> contexts;
  std::vector<std::unique_ptr<optim::Slab>> slabs;
  std::vector<std::unique_ptr<Opt>> opts;

  ShardedRunOf(core::Device device, const std::vector<optim::ParamSpec>& specs, int world,
               const optim::OptimizerConfig& config) {
    const optim::SlabLayout layout(specs, world);
    for (int r = 0; r < world; ++r) {
      contexts.push_back(std::make_unique<core::DeviceContext>(device));
      slabs.push_back(std::make_unique<optim::Slab>(layout, *contexts.back(),
                                                    optim::SlabOptions{.rank = r, .zero_stage = world > 1 ? 1 : 0}));
      opts.push_back(std::make_unique<Opt>(config, *slabs.back(), *contexts.back()));
    }
  }

  // `master` and `grad` over the whole slab; each shard takes its owned part of the master.
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
      std::vector<float> sum_f32(p0.count, 0.0f);
      std::vector<unsigned long long> sum_u(p0.count, 0);
      for (auto& rank_parts : parts) {
        const auto& p = rank_parts[k];
        std::vector<char> host(bytes);
        core::copy_bytes(host.data(), p.data, bytes, contexts[0]->stream());
        contexts[0]->synchronize();
        for (std::size_t i = 0; i < p.count; ++i) {
          if (p.dtype == core::DType::f64) {
            sum_f[i] += reinterpret_cast<const double*>(host.data())[i];
          } else if (p.dtype == core::DType::f32) {
            sum_f32[i] += reinterpret_cast<const float*>(host.data())[i];
          } else {
            sum_u[i] += reinterpret_cast<const unsigned long long*>(host.data())[i];
          }
        }
      }
      const void* src = p0.dtype == core::DType::f64   ? static_cast<const void*>(sum_f.data())
                        : p0.dtype == core::DType::f32 ? static_cast<const void*>(sum_f32.data())
                                                       : static_cast<const void*>(sum_u.data());
      for (auto& rank_parts : parts) {
        core::copy_bytes(rank_parts[k].data, src, bytes, contexts[0]->stream());
        contexts[0]->synchronize();
      }
    }
  }

  // The shards' buffers joined in rank order (masters, or a per-element state buffer).
  std::vector<float> master() const {
    std::vector<float> out;
    for (const auto& slab : slabs) {
      const auto part = test::to_host<float>(slab->master());
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  }
};

}  // namespace test
