// WeightGather: ZeRO-3's per-range weight gather (weight_gather.h).
#include "trainer/weight_gather.h"

#include <cstring>
#include <optional>
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

void WeightGather::check_range(optim::Range range, const char* what) const {
  if (range.empty() || range.size() > slot_elements_ || range.end > slab_.layout().total_elements()) {
    throw core::Error(std::string("weight gather: ") + what + " of range [" + std::to_string(range.begin) + ", " +
                      std::to_string(range.end) + ") that does not fit a buffer of " + std::to_string(slot_elements_) +
                      " elements");
  }
}

std::byte* WeightGather::slot_data(int slot) {
  return static_cast<std::byte*>(buffers_.data()) +
         static_cast<std::size_t>(slot * slot_elements_) * core::dtype_size(dtype_);
}

int WeightGather::free_slot() const {
  for (int slot = 0; slot < kSlots; ++slot) {
    if (slots_[slot].state == Slot::State::free) return slot;
  }
  return -1;
}

void WeightGather::gather(int slot, optim::Range range, bool detached) {
  const std::size_t element = core::dtype_size(dtype_);
  std::byte* base = slot_data(slot);
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
  {
    std::optional<comm::DetachedScope> scope;
    if (detached) scope.emplace(comm_);
    comm_.group_start();
    for (int rank = 0; rank < comm_.world(); ++rank) {
      const optim::Range piece = range.intersect(slab_.layout().shard(rank));
      if (piece.empty()) continue;
      comm_.broadcast(base + static_cast<std::size_t>(piece.begin - range.begin) * element, dtype_,
                      static_cast<std::size_t>(piece.size()), rank,
                      detached ? "weight gather (ZeRO-3, prefetched)" : "weight gather (ZeRO-3)");
    }
    comm_.group_end();
  }
  slots_[slot].range = range;
  slots_[slot].marker = detached ? comm_.marker() : 0;
}

void WeightGather::start_pending() {
  if (pending_.empty()) return;
  const int slot = free_slot();
  if (slot < 0) return;
  gather(slot, pending_, true);
  slots_[slot].state = Slot::State::prefetched;
  pending_ = {};
}

void WeightGather::prefetch(optim::Range range) {
  if (whole_ != nullptr) return;  // every range is served from the whole model
  check_range(range, "prefetch");
  for (const Slot& s : slots_) {
    if (s.state != Slot::State::free && s.range == range) return;  // already gathered or gathering
  }
  pending_ = range;
  start_pending();
}

const void* WeightGather::acquire(optim::Range range) {
  const std::size_t element = core::dtype_size(dtype_);
  if (whole_ != nullptr && !range.empty() && range.end <= slab_.layout().total_elements()) {
    return whole_ + static_cast<std::size_t>(range.begin) * element;
  }
  check_range(range, "acquire");
  // The hinted copy if this is the hinted range; any other hint was wrong and is dropped.
  pending_ = {};
  int slot = -1;
  for (int s = 0; s < kSlots; ++s) {
    if (slots_[s].state != Slot::State::prefetched) continue;
    if (slots_[s].range == range) {
      slot = s;
    } else {
      slots_[s].state = Slot::State::free;
    }
  }
  if (slot >= 0) {
    comm_.wait_for(slots_[slot].marker);  // on the device: the compute stream waits for the gather
    ++prefetched_acquires_;
  } else {
    slot = free_slot();
    if (slot < 0) throw core::Error("weight gather: more than two ranges acquired at once");
    gather(slot, range, false);
    ++gathered_acquires_;
  }
  slots_[slot].state = Slot::State::held;
  return slot_data(slot);
}

void WeightGather::release(optim::Range range) {
  if (whole_ != nullptr) return;  // served from the whole model: nothing to free
  for (Slot& s : slots_) {
    if (s.state == Slot::State::held && s.range == range) {
      s.state = Slot::State::free;
      start_pending();
      return;
    }
  }
  throw core::Error("weight gather: release of a range that is not held");
}

void WeightGather::weights_changed() {
  pending_ = {};
  for (Slot& s : slots_) {
    if (s.state == Slot::State::prefetched) s.state = Slot::State::free;
  }
}

std::size_t WeightGather::whole_bytes() const {
  return static_cast<std::size_t>(slab_.layout().total_elements()) * core::dtype_size(dtype_);
}

WeightGather::WholeModel::WholeModel(WeightGather& gather) : gather_(gather) {
  if (gather.whole_ != nullptr) throw core::Error("weight gather: the whole model is already gathered");
  for (const Slot& s : gather.slots_) {
    if (s.state == Slot::State::held)
      throw core::Error("weight gather: the whole model gathered while a range is held");
  }
  gather.weights_changed();  // hints are moot while every range comes from the whole model
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
