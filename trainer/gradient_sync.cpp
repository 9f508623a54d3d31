// GradientSync: which collective each ZeRO stage issues over the gradient slab (gradient_sync.h).
#include "trainer/gradient_sync.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace trainer {

GradientSync::GradientSync(comm::Communicator& comm, optim::Slab& slab, const core::DeviceContext& context)
    : comm_(comm), slab_(slab), context_(context), stage_(slab.zero_stage()) {
  if (slab.layout().world_size() != comm.world()) {
    throw core::Error("gradient sync: the slab is laid out for " + std::to_string(slab.layout().world_size()) +
                      " ranks but the job has " + std::to_string(comm.world()));
  }
}

void GradientSync::reduce_range(optim::Range range) {
  reduce_onto_owners(range);
  reduced_.push_back(range);
}

void GradientSync::reduce_onto_owners(optim::Range range) {
  if (range.empty()) return;
  float* grad = slab_.grad().as<float>();
  comm_.group_start();
  for (int rank = 0; rank < comm_.world(); ++rank) {
    const optim::Range piece = range.intersect(slab_.layout().shard(rank));
    if (piece.empty()) continue;
    comm_.reduce(grad + piece.begin, core::DType::f32, static_cast<std::size_t>(piece.size()), comm::ReduceOp::avg,
                 rank, "gradient reduce (ZeRO-2)");
  }
  comm_.group_end();
}

void GradientSync::finish() {
  if (comm_.world() == 1) return;
  float* grad = slab_.grad().as<float>();
  const optim::SlabLayout& layout = slab_.layout();
  if (stage_ == 0) {
    comm_.all_reduce(grad, core::DType::f32, static_cast<std::size_t>(layout.total_elements()), comm::ReduceOp::avg,
                     "gradient all-reduce (ZeRO-0)");
    return;
  }
  if (stage_ == 1 || reduced_.empty()) {
    comm_.reduce_scatter(grad, core::DType::f32, static_cast<std::size_t>(layout.shard_elements()),
                         comm::ReduceOp::avg, "gradient reduce-scatter");
  } else {
    // The tensors no reported range covered (none when the model reports every layer); alignment
    // gaps and tail padding hold no gradient the optimizer reads, so they are not reduced.
    for (const optim::SlabTensor& t : layout.tensors()) {
      const bool reported = std::any_of(reduced_.begin(), reduced_.end(),
                                        [&](const optim::Range& r) { return r.contains(t.range()); });
      if (!reported) reduce_onto_owners(t.range());
    }
    reduced_.clear();
  }
  zero_outside_owned();
}

void GradientSync::zero_outside_owned() {
  float* grad = slab_.grad().as<float>();
  const optim::Range owned = slab_.owned();
  const std::int64_t total = slab_.layout().total_elements();
  const auto bytes = [](std::int64_t n) { return static_cast<std::size_t>(n) * sizeof(float); };
  if (context_.is_cuda()) {
    if (owned.begin > 0) CUDA_CHECK(cudaMemsetAsync(grad, 0, bytes(owned.begin), context_.stream()));
    if (owned.end < total) CUDA_CHECK(cudaMemsetAsync(grad + owned.end, 0, bytes(total - owned.end), context_.stream()));
  } else {
    std::memset(grad, 0, bytes(owned.begin));
    std::memset(grad + owned.end, 0, bytes(total - owned.end));
  }
}

}  // namespace trainer
