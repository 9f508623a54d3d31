// WeightGather: ZeRO-3's per-range weight gather (weight_gather.h).
#include "trainer/weight_gather.h"

#include <cstring>
#include <string>

#include "core/error.h"

namespace trainer {

WeightGather::WeightGather(comm::Communicator& comm, optim::Slab& slab, const core::DeviceContext& context,
                           std::int64_t largest_range)
    : comm_(comm),
      slab_(slab),
      context_(context),
      dtype_(context.is_cuda() ? slab.mirror_dtype() : core::DType::f32),
      slot_elements_(largest_range) {
  if (slab.zero_stage() != 3) throw core::Error("weight gather: needs a ZeRO-3 slab");
  if (largest_range <= 0) throw core::Error("weight gather: the model reports no weight ranges");
  buffers_ =
      core::Buffer(context.device(), static_cast<std::size_t>(kSlots * slot_elements_) * core::dtype_size(dtype_));
}

const void* WeightGather::acquire(optim::Range range) {
  if (range.empty() || range.size() > slot_elements_ || range.end > slab_.layout().total_elements()) {
    throw core::Error("weight gather: range [" + std::to_string(range.begin) + ", " + std::to_string(range.end) +
                      ") does not fit a buffer of " + std::to_string(slot_elements_) + " elements");
  }
  int slot = 0;
  while (slot < kSlots && busy_[slot]) ++slot;
  if (slot == kSlots) throw core::Error("weight gather: more than two ranges acquired at once");
  const std::size_t element = core::dtype_size(dtype_);
  auto* base = static_cast<std::byte*>(buffers_.data()) + static_cast<std::size_t>(slot * slot_elements_) * element;
  // This rank's piece first (the master on cpu, the mirror on cuda), then every owner's piece
  // broadcast into place.
  const optim::Range mine = range.intersect(slab_.owned());
  if (!mine.empty()) {
    std::byte* to = base + static_cast<std::size_t>(mine.begin - range.begin) * element;
    if (context_.is_cuda()) {
      const auto* from =
          static_cast<const std::byte*>(slab_.mirror_origin()) + static_cast<std::size_t>(mine.begin) * element;
      CUDA_CHECK(cudaMemcpyAsync(to, from, static_cast<std::size_t>(mine.size()) * element, cudaMemcpyDeviceToDevice,
                                 context_.stream()));
    } else {
      const float* from = slab_.master().as<float>() + (mine.begin - slab_.owned().begin);
      std::memcpy(to, from, static_cast<std::size_t>(mine.size()) * element);
    }
  }
  comm_.group_start();
  for (int rank = 0; rank < comm_.world(); ++rank) {
    const optim::Range piece = range.intersect(slab_.layout().shard(rank));
    if (piece.empty()) continue;
    comm_.broadcast(base + static_cast<std::size_t>(piece.begin - range.begin) * element, dtype_,
                    static_cast<std::size_t>(piece.size()), rank, "weight gather (ZeRO-3)");
  }
  comm_.group_end();
  busy_[slot] = true;
  held_[slot] = range;
  return base;
}

core::Buffer WeightGather::gather_whole() {
  if (context_.is_cuda()) throw core::Error("weight gather: gather_whole is cpu only");
  const optim::Range owned = slab_.owned();
  core::Buffer whole(core::Device::cpu(), static_cast<std::size_t>(slab_.layout().total_elements()) * sizeof(float));
  std::memcpy(whole.as<float>() + owned.begin, slab_.master().as<float>(),
              static_cast<std::size_t>(owned.size()) * sizeof(float));
  comm_.all_gather(whole.data(), core::DType::f32, static_cast<std::size_t>(owned.size()), "weight gather (sample)");
  return whole;
}

void WeightGather::release(optim::Range range) {
  for (int slot = 0; slot < kSlots; ++slot) {
    if (busy_[slot] && held_[slot] == range) {
      busy_[slot] = false;
      return;
    }
  }
  throw core::Error("weight gather: release of a range that is not held");
}

}  // namespace trainer
