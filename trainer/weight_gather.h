// ZeRO-3's weight source (optim/weight_source.h): each rank keeps only its shard of the weights;
// acquire(range) gathers the range into one of two preallocated buffers of the largest range the
// model acquires, each piece broadcast by the rank whose shard holds it (the slab's one element
// split, seen per layer), and release(range) frees the buffer for the next range. On cpu the
// pieces are the fp32 master shards, on cuda the 16-bit mirror shards.
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

  comm::Communicator& comm_;
  optim::Slab& slab_;
  const core::DeviceContext& context_;
  core::DType dtype_;
  std::int64_t slot_elements_;
  core::Buffer buffers_;
  optim::Range held_[kSlots] = {};
  bool busy_[kSlots] = {};
  const std::byte* whole_ = nullptr;  // a WholeModel's weights while one lives
};

}  // namespace trainer
