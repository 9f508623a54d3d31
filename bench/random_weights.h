// Shared by the benchmarks of whole models: a model's weights drawn from a counter hash (fast,
// no host RNG state, the same values on every run) and the median of timed runs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/device.h"
#include "optim/slab.h"

namespace bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Weights uniform in [-0.04, 0.04) (norms 1 +- 0.1) into the fp32 master, then the bf16 mirror.
inline void random_weights(optim::Slab& slab, const core::DeviceContext& ctx) {
  std::vector<float> w(slab.master().bytes() / 4);
  for (const auto& t : slab.layout().tensors()) {
    const bool norm = t.spec.name.find("norm") != std::string::npos;
    for (std::int64_t i = 0; i < t.numel; ++i) {
      std::uint64_t z = static_cast<std::uint64_t>(t.offset + i) * 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      const float u = static_cast<float>((z ^ (z >> 31)) >> 40) * 0x1p-24f * 2.0f - 1.0f;
      w[static_cast<std::size_t>(t.offset + i)] = norm ? 1.0f + 0.1f * u : 0.04f * u;
    }
  }
  core::copy_bytes(slab.master().data(), w.data(), slab.master().bytes(), ctx.stream());
  ctx.synchronize();
  slab.write_mirror(ctx);
  ctx.synchronize();
}

}  // namespace bench
