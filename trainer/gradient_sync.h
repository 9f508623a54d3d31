// Gradient synchronisation of a data-parallel step (DESIGN.md section 5), after the last
// micro-batch's backward (accumulation never communicates before it):
//   ZeRO-0: all-reduce (average) of the whole gradient slab; every rank then updates everything.
//   ZeRO-1: reduce-scatter (average) into each rank's owned shard, in place.
//   ZeRO-2: the same result, reduced range by range while the backward still runs. It is the
//           model's gradient sink (optim/gradient_sink.h):
//           - sharded gradients (the slab's gradient buffer is the owned shard; one micro-batch
//             per step): the backward gets each range in one of two staging buffers, and on
//             release the range's pieces are reduced from there onto their owners' shards, on
//             the communication stream while the backward goes on (the compute stream waits only
//             before reusing a staging buffer, and in finish()). With `held_elements` one
//             more buffer takes a vocabulary-sized range held open across the others
//             (GradientSink::acquire_held: the head's gradient in the fused cross-entropy pass);
//           - whole gradient buffer (gradient accumulation, or a backend without the sink): the
//             ranges are reduced in place during the last micro-batch, and finish() reduces the
//             tensors that were not reported.
//   ZeRO-3: the gradients as ZeRO-2 (the weights are sharded too: trainer/weight_gather.h).
// With ZeRO >= 1 and a whole buffer the gradients outside the owned shard are zeroed afterwards,
// so the next step accumulates from zero everywhere (the optimizer zeroes the owned shard itself).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "core/device.h"
#include "optim/gradient_sink.h"
#include "optim/slab.h"

namespace trainer {

class GradientSync final : public optim::GradientSink {
 public:
  // `staging_elements`: the largest range the model acquires (needed with sharded gradients);
  // `held_elements`: the largest range acquire_held() takes (0: none).
  GradientSync(comm::Communicator& comm, optim::Slab& slab, const core::DeviceContext& context,
               std::int64_t staging_elements = 0, std::int64_t held_elements = 0);

  // Before each micro-batch: whether it is the step's last (only then are ranges reduced).
  void begin_micro_batch(bool last) { last_micro_batch_ = last; }
  // Completes the synchronisation of this step (enqueued on cuda; done on return on cpu).
  void finish();
  // Device bytes of the staging buffers (part of the gradient memory).
  std::size_t staging_bytes() const { return staging_.bytes() + held_.bytes(); }

  // optim::GradientSink.
  std::int64_t max_range_elements() const override { return staged() ? slot_elements_ : 0; }
  float* acquire(optim::Range range) override;
  void release(optim::Range range) override;
  std::int64_t max_held_range_elements() const override { return staged() ? held_elements_ : 0; }
  float* acquire_held(optim::Range range) override;

 private:
  static constexpr int kSlots = 2;
  bool staged() const { return slot_elements_ > 0; }
  // Averages the pieces of `range` (gradients at `data`, element range.begin first) onto the
  // ranks whose shards hold them, each into its shard of the slab's gradients (one NCCL group).
  void reduce_onto_owners(optim::Range range, const float* data);
  // The same on the communication stream without making the compute stream wait; returns the
  // marker after it (a staging buffer is free again once it has passed).
  std::uint64_t reduce_detached(optim::Range range, const float* data);
  void zero_outside_owned();

  comm::Communicator& comm_;
  optim::Slab& slab_;
  const core::DeviceContext& context_;
  int stage_;
  bool last_micro_batch_ = true;
  std::vector<optim::Range> reduced_;  // ranges reduced so far this step (ZeRO-2)
  // Staging (sharded gradients only).
  std::int64_t slot_elements_ = 0;
  core::Buffer staging_;
  int next_slot_ = 0;
  int open_slot_ = -1;
  optim::Range open_range_{};
  std::uint64_t slot_free_[kSlots] = {};  // communicator markers after each slot's last reduction
  std::uint64_t last_marker_ = 0;
  // The held range's buffer (acquire_held).
  std::int64_t held_elements_ = 0;
  core::Buffer held_;
  bool held_open_ = false;
  optim::Range held_range_{};
  std::uint64_t held_free_ = 0;
};

// The other half: after an optimizer step or a load with ZeRO-1/2 and several ranks, each rank
// has updated only its shard of the weights. cuda all-gathers the 16-bit mirror in place; cpu
// gathers the fp32 master shards into a whole-model copy, which the cpu model reads. ZeRO-3
// gathers nothing here: the model reads each range through WeightGather.
class WeightSync {
 public:
  WeightSync(comm::Communicator& comm, optim::Slab& slab, const core::DeviceContext& context);
  // cpu with a sharded master: the whole-model fp32 weights (valid after gather()); else nullptr.
  const float* full_weights() const { return full_.bytes() > 0 ? full_.as<float>() : nullptr; }
  void gather();

 private:
  comm::Communicator& comm_;
  optim::Slab& slab_;
  bool sharded_;
  core::Buffer full_;  // cpu only
};

}  // namespace trainer
