// Gradient statistics of one step: the sum of squares of the finite gradient elements and the
// number of non-finite ones, over the chunks a rank updates. One launch on the GPU: each block
// writes a partial, and the last block to finish adds the partials in block order, so the
// result is deterministic (it depends on the chunk list, not on scheduling).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "optim/segments.h"
#include "optim/step_scalars.h"

namespace optim {

// Number of blocks (and partials) the GPU reduction uses for `num_chunks` chunks.
int grad_stats_blocks(std::int64_t num_chunks);

// CPU reference: writes grad_sq_sum and nonfinite of `scalars`. `grad` is indexed by global
// element (Slab::grad_origin()); only the chunks' elements are read, so it may cover the owned
// range only.
void grad_stats_cpu(const float* grad, const WorkChunk* chunks, std::int64_t num_chunks, StepScalars& scalars);

// GPU: same result into `scalars` (device memory). `partial_sums` / `partial_counts` hold
// grad_stats_blocks(num_chunks) entries each.
void launch_grad_stats(const float* grad, const WorkChunk* chunks, std::int64_t num_chunks, double* partial_sums,
                       unsigned long long* partial_counts, StepScalars* scalars, cudaStream_t stream);

}  // namespace optim
