#include "optim/grad_stats.h"

#include <algorithm>
#include <vector>

#include "optim/float_ops.h"

namespace optim {

int grad_stats_blocks(std::int64_t num_chunks) {
  return static_cast<int>(std::clamp<std::int64_t>(num_chunks, 1, 1024));
}

void grad_stats_cpu(const float* grad, const WorkChunk* chunks, std::int64_t num_chunks, StepScalars& scalars) {
  // Per-chunk partials added in chunk order: the same result for any number of threads.
  std::vector<double> sums(static_cast<std::size_t>(num_chunks));
  std::vector<unsigned long long> counts(static_cast<std::size_t>(num_chunks));
#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t c = 0; c < num_chunks; ++c) {
    const float* g = grad + chunks[c].offset;
    double sum = 0;
    unsigned long long count = 0;
    for (std::int32_t i = 0; i < chunks[c].length; ++i) {
      if (fp::finite(g[i])) {
        sum += static_cast<double>(g[i]) * static_cast<double>(g[i]);
      } else {
        ++count;
      }
    }
    sums[static_cast<std::size_t>(c)] = sum;
    counts[static_cast<std::size_t>(c)] = count;
  }
  double total = 0;
  unsigned long long nonfinite = 0;
  for (std::int64_t c = 0; c < num_chunks; ++c) {
    total += sums[static_cast<std::size_t>(c)];
    nonfinite += counts[static_cast<std::size_t>(c)];
  }
  scalars.grad_sq_sum = total;
  scalars.nonfinite = nonfinite;
}

}  // namespace optim
