// ZeRO-3's weight source (optim/weight_source.h): each rank keeps only its shard of the weights;
// acquire(range) gathers the range into one of two preallocated buffers of the largest range the
// model acquires, each piece broadcast by the rank whose shard holds it (the slab's one element
// split, seen per layer), and release(range) frees the buffer for the next range. On cpu the
// pieces are the fp32 master shards, on cuda the 16-bit mirror shards.
#pragma once

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
  // The whole model's fp32 weights on every rank, for a decoder that reads them whole (a sample
  // on cpu), freed by the caller: collective, and the one moment a rank holds the whole model.
  // cpu only (core::Error on cuda).
  core::Buffer gather_whole();

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
};

}  // namespace trainer
