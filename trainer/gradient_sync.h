// Gradient synchronisation of a data-parallel step (DESIGN.md section 5), after the last
// micro-batch's backward (accumulation never communicates before it):
//   ZeRO-0: all-reduce (average) of the whole gradient slab; every rank then updates everything.
//   ZeRO-1: reduce-scatter (average) into each rank's owned shard, in place.
//   ZeRO-2: the same result, reduced range by range while the backward still runs: the model
//           reports each layer's range as soon as its gradients are final (reduce_range), and
//           finish() reduces the tensors that were not reported (all of them with a backend
//           without the hook).
// With ZeRO >= 1 the gradients outside the owned shard are zeroed afterwards, so the next step
// accumulates from zero everywhere (the optimizer zeroes the owned shard itself).
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "core/device.h"
#include "optim/slab.h"

namespace trainer {

class GradientSync {
 public:
  GradientSync(comm::Communicator& comm, optim::Slab& slab, const core::DeviceContext& context);

  // ZeRO-2 only: averages global range `range` of the gradients onto the ranks owning its parts.
  void reduce_range(optim::Range range);
  // Completes the synchronisation of this step (enqueued on cuda; done on return on cpu).
  void finish();
  // Whether the model should report ranges (ZeRO-2 with several ranks).
  bool wants_ranges() const { return stage_ == 2 && comm_.world() > 1; }

 private:
  // Averages `range` of the gradients onto the ranks whose shards hold its parts (one NCCL group).
  void reduce_onto_owners(optim::Range range);
  void zero_outside_owned();

  comm::Communicator& comm_;
  optim::Slab& slab_;
  const core::DeviceContext& context_;
  int stage_;
  std::vector<optim::Range> reduced_;  // ranges reduced so far this step (ZeRO-2)
};

}  // namespace trainer
