// ZeRO-3's weight source (optim/weight_source.h): each rank keeps only its shard of the weights;
// acquire(range) gathers the range into one of two preallocated buffers of the largest range the
// model acquires, each piece broadcast by the rank whose shard holds it (the slab's one element
// split, seen per layer), and release(range) frees the buffer for the next range. On cpu the
// pieces are the fp32 master shards, on cuda the 16-bit mirror shards.
//
// Prefetch: a model's hint (prefetch(next)) gathers `next` into the free buffer as soon as there is
// one, on cuda on the communication stream without making the compute stream wait; the acquire
// of that range then waits for it on the device only. So layer l+1's gather runs under layer l's
// compute: the buffer it fills was last read by layer l-1, whose work was queued before the gather
// (the communication stream waits for the compute queued before each collective). A hint the next
// acquire does not match is dropped, and weights_changed() (after each optimizer update) drops a
// gathered copy that was never acquired, so no stale copy outlives an update.
//
// Samples and task evaluation gather the whole model instead (WholeModel): decoders read it whole,
// and an evaluation splits its items over the ranks, so ranks run different numbers of forwards
// and the model's reads must not communicate.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "core/device.h"
#include "optim/slab.h"
#include "optim/weight_source.h"

namespace trainer {

class WeightGather final : public optim::WeightSource {
 public:
  // `largest_range`: the most elements one acquired range spans (ModelSpec::weight_ranges).
  WeightGather(comm::Communicator& comm, optim::Slab& slab, const core::DeviceContext& context,
               std::int64_t largest_range);

  const void* acquire(optim::Range range) override;
  void release(optim::Range range) override;
  void prefetch(optim::Range range) override;
  // The shards changed (an optimizer update): gathered copies not yet acquired are dropped.
  void weights_changed();
  // Acquires served by a prefetched gather, and all acquires that gathered (for tests and logs).
  std::int64_t prefetched_acquires() const { return prefetched_acquires_; }
  std::int64_t gathered_acquires() const { return gathered_acquires_; }

  // Bytes of the two gather buffers (this rank's memory for weights beyond its shard).
  std::size_t buffer_bytes() const { return buffers_.bytes(); }

  // The whole model on this rank while it lives: gathered by the constructor (collective: every
  // rank constructs it together, with no range held), freed by the destructor. Meanwhile acquire()
  // serves every range from it without communicating. cpu: the fp32 weights (4 bytes an element,
  // what the cpu models and decoders read); cuda: the 16-bit mirror (2 bytes an element). This is
  // the one time a rank holds the whole model: the extra peak of samples and evaluation.
  class WholeModel {
   public:
    explicit WholeModel(WeightGather& gather);
    ~WholeModel();
    WholeModel(const WholeModel&) = delete;
    WholeModel& operator=(const WholeModel&) = delete;
    // models::DecoderOptions::full_weights (cpu) and whole_mirror (cuda); nullptr on the other.
    const float* full_weights() const;
    const void* whole_mirror() const;
    std::size_t bytes() const { return weights_.bytes(); }

   private:
    WeightGather& gather_;
    core::Buffer weights_;
  };
  // Bytes a WholeModel holds.
  std::size_t whole_bytes() const;

 private:
  static constexpr int kSlots = 2;
  struct Slot {
    enum class State { free, prefetched, held };
    State state = State::free;
    optim::Range range;
    std::uint64_t marker = 0;  // prefetched: the communicator's marker after its gather
  };

  void check_range(optim::Range range, const char* what) const;
  std::byte* slot_data(int slot);
  // Gathers `range` into buffer `slot`; `detached`: the compute stream does not wait for it.
  void gather(int slot, optim::Range range, bool detached);
  // The pending hint's gather, when a buffer is free.
  void start_pending();
  int free_slot() const;

  comm::Communicator& comm_;
  optim::Slab& slab_;
  const core::DeviceContext& context_;
  core::DType dtype_;
  std::int64_t slot_elements_;
  core::Buffer buffers_;
  Slot slots_[kSlots];
  optim::Range pending_;  // a hinted range waiting for a free buffer
  std::int64_t prefetched_acquires_ = 0, gathered_acquires_ = 0;
  const std::byte* whole_ = nullptr;  // a WholeModel's weights while one lives
};

}  // namespace trainer
