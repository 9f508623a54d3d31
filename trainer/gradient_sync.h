// Gradient synchronisation of a data-parallel step (DESIGN.md section 5), during the last
// micro-batch's backward (accumulation never communicates before it):
//   ZeRO-0: all-reduce (average) of the gradients; every rank then updates everything.
//   ZeRO-1: each piece of the gradients reduced (average) onto the rank whose shard holds it.
//   ZeRO-2: the same, with sharded gradients where it can.
//   ZeRO-3: the gradients as ZeRO-2 (the weights are sharded too: trainer/weight_gather.h).
// It is the model's gradient sink (optim/gradient_sink.h), so each range is reduced as soon as the
// backward releases it, on the communication stream while the backward goes on (cuda):
//   - sharded gradients (ZeRO-2/3 on cuda, one micro-batch per step; the slab's gradient buffer is
//     the owned shard): the backward gets each range in one of two staging buffers, reduced from
//     there onto the owners' shards (the compute stream waits only before reusing a staging
//     buffer, and in finish()). With `held_elements` one more buffer takes a vocabulary-sized
//     range held open across the others (GradientSink::acquire_held: the head's gradient in the
//     fused cross-entropy pass);
//   - whole gradient buffer (ZeRO-0/1, gradient accumulation): the ranges are reduced in place
//     during the last micro-batch, and finish() reduces the tensors that were not reported (on
//     cpu, whose models report none, all of them in one collective).
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
#include "optim/weight_source.h"

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
  // What `range`'s gradients at `data` need at this stage: the all-reduce (ZeRO-0), else the
  // reduction onto owners.
  void reduce(optim::Range range, float* data);
  // The same on the communication stream without making the compute stream wait; returns the
  // marker after it (a staging buffer is free again once it has passed).
  std::uint64_t reduce_detached(optim::Range range, float* data);
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
// has updated only its shard of the weights. cpu gathers the fp32 master shards into a whole-model
// copy, which the cpu model reads. cuda brings every owner's 16-bit mirror pieces to every rank in
// place, chunk by chunk in slab order (= the forward's order: embedding, layers, tail), each chunk
// broadcast by its owners on the communication stream without making the compute stream wait; the
// model reads its ranges through this source (optim/weight_source.h), whose acquire makes the
// compute stream wait for the chunks the range spans, so layer l's forward runs while later
// layers arrive. Whoever reads the mirror otherwise (decoders) calls wait_all() first. ZeRO-3
// gathers nothing here: the model reads each range through WeightGather.
class WeightSync final : public optim::WeightSource {
 public:
  // `ranges`: what the model acquires (ModelSpec::weight_ranges; chunk boundaries fall between them).
  WeightSync(comm::Communicator& comm, optim::Slab& slab, const core::DeviceContext& context,
             const std::vector<optim::Range>& ranges);
  // cpu with a sharded master: the whole-model fp32 weights (valid after gather()); else nullptr.
  const float* full_weights() const { return full_.bytes() > 0 ? full_.as<float>() : nullptr; }
  // The source the model reads through (cuda with a sharded mirror), else nullptr.
  optim::WeightSource* source() { return chunks_.empty() ? nullptr : this; }
  void gather();
  // The compute stream waits until every chunk has arrived.
  void wait_all();
  // The chunks the mirror arrives in (for tests and logs).
  const std::vector<optim::Range>& chunks() const { return chunks_; }

  // optim::WeightSource: the range in the mirror, once the chunks it spans have arrived.
  const void* acquire(optim::Range range) override;
  void release(optim::Range range) override { (void)range; }

 private:
  comm::Communicator& comm_;
  optim::Slab& slab_;
  bool sharded_;
  core::Buffer full_;                   // cpu only
  std::vector<optim::Range> chunks_;    // cuda with a sharded mirror
  std::vector<std::uint64_t> arrived_;  // each chunk's marker after its last gather
  std::uint64_t waited_ = 0;            // the compute stream has waited for markers up to this
};

// `ranges` cut into at most `max_chunks` contiguous chunks covering [0, total) in order, each of
// about total / max_chunks elements, cut only at the ranges' boundaries.
std::vector<optim::Range> weight_chunks(const std::vector<optim::Range>& ranges, std::int64_t total, int max_chunks);

}  // namespace trainer
