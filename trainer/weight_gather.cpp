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
  const std::size_t element = core::dtype_size(dtype_);
  if (whole_ != nullptr && !range.empty() && range.end <= slab_.layout().total_elements()) {
    return whole_ + static_cast<std::size_t>(range.begin) * element;
  }
  if (range.empty() || range.size() > slot_elements_ || range.end > slab_.layout().total_elements()) {
    throw core::Error("weight gather: range [" + std::to_string(range.begin) + ", " + std::to_string(range.end) +
                      ") does not fit a buffer of " + std::to_string(slot_elements_) + " elements");
  }
  int slot = 0;
  while (slot < kSlots && busy_[slot]) ++slot;
  if (slot == kSlots) throw core::Error("weight gather: more than two ranges acquired at once");
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

void WeightGather::release(optim::Range range) {
  if (whole_ != nullptr) return;  // served from the whole model: nothing to free
  for (int slot = 0; slot < kSlots; ++slot) {
    if (busy_[slot] && held_[slot] == range) {
      busy_[slot] = false;
      return;
    }
  }
  throw core::Error("weight gather: release of a range that is not held");
}

std::size_t WeightGather::whole_bytes() const {
  return static_cast<std::size_t>(slab_.layout().total_elements()) * core::dtype_size(dtype_);
}

WeightGather::WholeModel::WholeModel(WeightGather& gather) : gather_(gather) {
  if (gather.whole_ != nullptr) throw core::Error("weight gather: the whole model is already gathered");
  for (const bool busy : gather.busy_) {
    if (busy) throw core::Error("weight gather: the whole model gathered while a range is held");
  }
  const optim::Slab& slab = gather.slab_;
  const optim::Range owned = slab.owned();
  const std::size_t element = core::dtype_size(gather.dtype_);
  weights_ = core::Buffer(gather.context_.device(), gather.whole_bytes());
  // This rank's shard in place (the master on cpu, the mirror on cuda), then every shard to every
  // rank: the layout's shards are equal and in rank order.
  const void* mine = gather.context_.is_cuda() ? slab.mirror().data() : slab.master().data();
  core::copy_bytes(static_cast<std::byte*>(weights_.data()) + static_cast<std::size_t>(owned.begin) * element, mine,
                   static_cast<std::size_t>(owned.size()) * element, gather.context_.stream());
  gather.comm_.all_gather(weights_.data(), gather.dtype_, static_cast<std::size_t>(owned.size()),
                          "whole-model gather (samples, evaluation)");
  gather.whole_ = static_cast<const std::byte*>(weights_.data());
}

// The buffer's release waits for the device (cudaFree synchronises), so no queued read outlives it.
WeightGather::WholeModel::~WholeModel() { gather_.whole_ = nullptr; }

const float* WeightGather::WholeModel::full_weights() const {
  return gather_.context_.is_cuda() ? nullptr : weights_.as<float>();
}

const void* WeightGather::WholeModel::whole_mirror() const {
  return gather_.context_.is_cuda() ? weights_.data() : nullptr;
}

}  // namespace trainer
