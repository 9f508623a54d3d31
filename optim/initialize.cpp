// Seeded initialisation of the owned master weights (initialize.h): every element's value is a
// function of (seed, tensor index, element index) alone, so any shard of any world size gets the
// same values as the whole model.
#include "optim/initialize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/rng.h"

namespace optim {

namespace {

// An orthogonal rows x cols matrix (orthonormal rows or columns, whichever are fewer), by
// modified Gram-Schmidt in fp64 on a counter-based normal matrix, scaled by `gain`.
std::vector<float> orthogonal(std::int64_t rows, std::int64_t cols, std::uint64_t seed, float gain) {
  const bool transpose = rows < cols;
  const std::int64_t n = transpose ? cols : rows, k = transpose ? rows : cols;  // n >= k: k orthonormal columns of length n
  std::vector<double> q(static_cast<std::size_t>(n * k));
  for (std::int64_t i = 0; i < n * k; ++i) q[static_cast<std::size_t>(i)] = core::normal01(seed, static_cast<std::uint64_t>(i));
  for (std::int64_t j = 0; j < k; ++j) {
    for (std::int64_t p = 0; p < j; ++p) {
      double dot = 0;
      for (std::int64_t i = 0; i < n; ++i) dot += q[static_cast<std::size_t>(i * k + j)] * q[static_cast<std::size_t>(i * k + p)];
      for (std::int64_t i = 0; i < n; ++i) q[static_cast<std::size_t>(i * k + j)] -= dot * q[static_cast<std::size_t>(i * k + p)];
    }
    double norm = 0;
    for (std::int64_t i = 0; i < n; ++i) norm += q[static_cast<std::size_t>(i * k + j)] * q[static_cast<std::size_t>(i * k + j)];
    norm = std::sqrt(norm);
    for (std::int64_t i = 0; i < n; ++i) q[static_cast<std::size_t>(i * k + j)] /= norm;
  }
  std::vector<float> out(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const double v = transpose ? q[static_cast<std::size_t>(c * k + r)] : q[static_cast<std::size_t>(r * k + c)];
      out[static_cast<std::size_t>(r * cols + c)] = static_cast<float>(gain * v);
    }
  }
  return out;
}

}  // namespace

void initialize_owned(Slab& slab, const core::DeviceContext& context, std::uint64_t seed) {
  const Range owned = slab.owned();
  std::vector<float> host(static_cast<std::size_t>(owned.size()), 0.0f);
  const auto& tensors = slab.layout().tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const SlabTensor& tensor = tensors[t];
    const std::int64_t begin = std::max(owned.begin, tensor.offset), end = std::min(owned.end, tensor.offset + tensor.numel);
    if (begin >= end) continue;
    const ParamSpec& spec = tensor.spec;
    const std::uint64_t tensor_seed = core::splitmix64(seed ^ core::splitmix64(t + 1));
    const std::int64_t rows = spec.shape.empty() ? 1 : spec.shape[0];
    const std::int64_t cols = tensor.numel / std::max<std::int64_t>(rows, 1);
    float* out = host.data() + (begin - owned.begin);
    std::vector<float> matrix;
    if (spec.init == InitKind::orthogonal) matrix = orthogonal(rows, cols, tensor_seed, spec.init_gain);
    const float bound = spec.init_gain * std::sqrt(6.0f / static_cast<float>(rows + cols));
#pragma omp parallel for schedule(static)
    for (std::int64_t g = begin; g < end; ++g) {
      const auto i = static_cast<std::uint64_t>(g - tensor.offset);
      float v = 0;
      switch (spec.init) {
        case InitKind::normal: v = spec.init_std * core::normal01(tensor_seed, i); break;
        case InitKind::zeros: v = 0.0f; break;
        case InitKind::ones: v = 1.0f; break;
        case InitKind::xavier_uniform: v = bound * (2.0f * core::uniform01(tensor_seed, i) - 1.0f); break;
        case InitKind::orthogonal: v = matrix[i]; break;
      }
      out[g - begin] = v;
    }
  }
  core::copy_bytes(slab.master().data(), host.data(), host.size() * sizeof(float), context.stream());
  context.synchronize();
  slab.write_mirror(context);
  context.synchronize();
}

}  // namespace optim
