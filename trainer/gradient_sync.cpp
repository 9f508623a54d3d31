// GradientSync: which collective each ZeRO stage issues over the gradient slab, and the staging
// of ZeRO-2 with sharded gradients (gradient_sync.h).
#include "trainer/gradient_sync.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/error.h"

namespace trainer {

GradientSync::GradientSync(comm::Communicator& comm, optim::Slab& slab, const core::DeviceContext& context,
                           std::int64_t staging_elements, std::int64_t held_elements)
    : comm_(comm), slab_(slab), context_(context), stage_(slab.zero_stage()) {
  if (slab.layout().world_size() != comm.world()) {
    throw core::Error("gradient sync: the slab is laid out for " + std::to_string(slab.layout().world_size()) +
                      " ranks but the job has " + std::to_string(comm.world()));
  }
  if (slab.shard_gradients()) {
    if (!context.is_cuda()) throw core::Error("gradient sync: sharded gradients need the cuda backend");
    if (staging_elements <= 0)
      throw core::Error("gradient sync: sharded gradients need staging (staging_elements > 0)");
    slot_elements_ = staging_elements;
    staging_ = core::Buffer(context.device(), static_cast<std::size_t>(kSlots * slot_elements_) * sizeof(float));
    if (held_elements > 0) {
      held_elements_ = held_elements;
      held_ = core::Buffer(context.device(), static_cast<std::size_t>(held_elements) * sizeof(float));
    }
  }
}

float* GradientSync::acquire_held(optim::Range range) {
  if (!staged()) return acquire(range);
  if (held_open_) throw core::Error("gradient sync: a held range is still open");
  if (range.empty() || range.size() > held_elements_) {
    throw core::Error("gradient sync: held range of " + std::to_string(range.size()) +
                      " elements does not fit the held buffer of " + std::to_string(held_elements_));
  }
  comm_.wait_for(held_free_);  // its previous reduction has read it
  CUDA_CHECK(
      cudaMemsetAsync(held_.data(), 0, static_cast<std::size_t>(range.size()) * sizeof(float), context_.stream()));
  held_open_ = true;
  held_range_ = range;
  return held_.as<float>();
}

std::uint64_t GradientSync::reduce_detached(optim::Range range, float* data) {
  // The backward goes on while the reductions run; the compute stream waits only at markers.
  const comm::DetachedScope detached(comm_);
  reduce(range, data);
  reduced_.push_back(range);
  return last_marker_ = comm_.marker();
}

void GradientSync::reduce(optim::Range range, float* data) {
  if (stage_ == 0) {
    comm_.all_reduce(data, core::DType::f32, static_cast<std::size_t>(range.size()), comm::ReduceOp::avg,
                     "gradient all-reduce (ZeRO-0)");
  } else {
    reduce_onto_owners(range, data);
  }
}

float* GradientSync::acquire(optim::Range range) {
  if (!staged()) return slab_.grad_origin() + range.begin;
  if (open_slot_ >= 0) throw core::Error("gradient sync: a staged range is still open");
  if (range.size() > slot_elements_ || range.empty()) {
    throw core::Error("gradient sync: range of " + std::to_string(range.size()) +
                      " elements does not fit the staging of " + std::to_string(slot_elements_));
  }
  const int slot = next_slot_;
  next_slot_ = (next_slot_ + 1) % kSlots;
  comm_.wait_for(slot_free_[slot]);  // its previous reduction has read it
  float* data = staging_.as<float>() + static_cast<std::int64_t>(slot) * slot_elements_;
  CUDA_CHECK(cudaMemsetAsync(data, 0, static_cast<std::size_t>(range.size()) * sizeof(float), context_.stream()));
  open_slot_ = slot;
  open_range_ = range;
  return data;
}

void GradientSync::release(optim::Range range) {
  if (!staged()) {
    // The range's gradients are final once the last micro-batch releases them: reduce them in
    // place while the backward goes on (on cpu the models report no ranges: finish() does it all).
    if (last_micro_batch_ && comm_.world() > 1 && context_.is_cuda()) {
      reduce_detached(range, slab_.grad_origin() + range.begin);
    }
    return;
  }
  if (held_open_ && range == held_range_) {
    held_free_ = reduce_detached(range, held_.as<float>());
    held_open_ = false;
    return;
  }
  if (open_slot_ < 0 || !(range == open_range_))
    throw core::Error("gradient sync: release of a range that is not open");
  float* data = staging_.as<float>() + static_cast<std::int64_t>(open_slot_) * slot_elements_;
  slot_free_[open_slot_] = reduce_detached(range, data);
  open_slot_ = -1;
}

void GradientSync::reduce_onto_owners(optim::Range range, const float* data) {
  if (range.empty()) return;
  float* grad = slab_.grad_origin();
  comm_.group_start();
  for (int rank = 0; rank < comm_.world(); ++rank) {
    const optim::Range piece = range.intersect(slab_.layout().shard(rank));
    if (piece.empty()) continue;
    float* recv = rank == comm_.rank() ? grad + piece.begin : nullptr;
    comm_.reduce_into(data + (piece.begin - range.begin), recv, core::DType::f32,
                      static_cast<std::size_t>(piece.size()), comm::ReduceOp::avg, rank, "gradient reduce onto owners");
  }
  comm_.group_end();
}

void GradientSync::finish() {
  if (comm_.world() == 1) return;
  const optim::SlabLayout& layout = slab_.layout();
  if (staged()) {
    // Every tensor's gradient existed only in staging: a tensor the backward never released has
    // no gradient anywhere, which is a bug, not something to repair here.
    for (const optim::SlabTensor& t : layout.tensors()) {
      const optim::Range r = t.range();
      std::int64_t covered = 0;
      for (const optim::Range& done : reduced_) covered += done.intersect(r).size();
      if (covered != r.size()) {
        throw core::Error("gradient sync: the backward released " + std::to_string(covered) + " of the " +
                          std::to_string(r.size()) + " gradient elements of '" + t.spec.name + "'");
      }
    }
    reduced_.clear();
    comm_.wait_for(last_marker_);  // the optimizer reads the reduced shard
    // Every staging buffer's reduction came before that marker on the communication stream: the
    // next step's first acquires need not wait (ZeRO-3's prefetches add markers in between).
    for (std::uint64_t& marker : slot_free_) marker = 0;
    held_free_ = 0;
    return;
  }
  float* grad = slab_.grad_origin();
  if (!reduced_.empty()) {
    // The backward's reductions come first on the communication stream; the compute stream waits
    // for them before anything reads or zeroes the gradients.
    comm_.wait_for(last_marker_);
    // The tensors no reported range covered (none when the model reports every layer); alignment
    // gaps and tail padding hold no gradient the optimizer reads, so they are not reduced.
    for (const optim::SlabTensor& t : layout.tensors()) {
      const bool reported =
          std::any_of(reduced_.begin(), reduced_.end(), [&](const optim::Range& r) { return r.contains(t.range()); });
      if (!reported) reduce(t.range(), grad + t.range().begin);
    }
    reduced_.clear();
  } else if (stage_ == 0) {
    comm_.all_reduce(grad, core::DType::f32, static_cast<std::size_t>(layout.total_elements()), comm::ReduceOp::avg,
                     "gradient all-reduce (ZeRO-0)");
  } else {
    comm_.reduce_scatter(grad, core::DType::f32, static_cast<std::size_t>(layout.shard_elements()), comm::ReduceOp::avg,
                         "gradient reduce-scatter");
  }
  if (stage_ == 0) return;
  zero_outside_owned();
}

void GradientSync::zero_outside_owned() {
  float* grad = slab_.grad_origin();
  const optim::Range owned = slab_.owned();
  const std::int64_t total = slab_.layout().total_elements();
  const auto bytes = [](std::int64_t n) { return static_cast<std::size_t>(n) * sizeof(float); };
  if (context_.is_cuda()) {
    if (owned.begin > 0) CUDA_CHECK(cudaMemsetAsync(grad, 0, bytes(owned.begin), context_.stream()));
    if (owned.end < total)
      CUDA_CHECK(cudaMemsetAsync(grad + owned.end, 0, bytes(total - owned.end), context_.stream()));
  } else {
    std::memset(grad, 0, bytes(owned.begin));
    std::memset(grad + owned.end, 0, bytes(total - owned.end));
  }
}

std::vector<optim::Range> weight_chunks(const std::vector<optim::Range>& ranges, std::int64_t total, int max_chunks) {
  if (total <= 0 || max_chunks <= 0) return {};
  // The contiguous pieces between every range boundary (and 0, total).
  std::vector<std::int64_t> cuts = {0, total};
  for (const optim::Range& r : ranges) {
    if (r.begin > 0 && r.begin < total) cuts.push_back(r.begin);
    if (r.end > 0 && r.end < total) cuts.push_back(r.end);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  // Adjacent pieces merged up to a target size, grown until the count fits.
  for (std::int64_t target = (total + max_chunks - 1) / max_chunks;; target += target / 2 + 1) {
    std::vector<optim::Range> chunks;
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      const optim::Range piece{cuts[i], cuts[i + 1]};
      if (!chunks.empty() && chunks.back().size() + piece.size() <= target) {
        chunks.back().end = piece.end;
      } else {
        chunks.push_back(piece);
      }
    }
    if (static_cast<int>(chunks.size()) <= max_chunks) return chunks;
  }
}

WeightSync::WeightSync(comm::Communicator& comm, optim::Slab& slab, const core::DeviceContext& context,
                       const std::vector<optim::Range>& ranges)
    : comm_(comm),
      slab_(slab),
      // ZeRO-3 keeps only shards: the model gathers each range when it reads it (weight_gather.h).
      sharded_(!(slab.owned() == slab.full()) && comm.world() > 1 && slab.zero_stage() < 3) {
  if (!sharded_) return;
  if (!context.is_cuda()) {
    full_ = core::Buffer(core::Device::cpu(), static_cast<std::size_t>(slab.layout().total_elements()) * sizeof(float));
    return;
  }
  // Each chunk's marker stays in the communicator's ring until the forward waits for it.
  if (!ranges.empty()) {
    chunks_ = weight_chunks(ranges, slab.layout().total_elements(), static_cast<int>(comm::Communicator::kMarkers));
    arrived_.assign(chunks_.size(), 0);
  }
}

void WeightSync::gather() {
  if (!sharded_) return;
  const optim::Range owned = slab_.owned();
  if (full_.bytes() > 0) {
    std::copy(slab_.master().as<float>(), slab_.master().as<float>() + owned.size(), full_.as<float>() + owned.begin);
    comm_.all_gather(full_.data(), core::DType::f32, static_cast<std::size_t>(owned.size()), "weight all-gather");
    return;
  }
  if (chunks_.empty()) {  // a model that reads its weights whole
    comm_.all_gather(slab_.mirror().data(), slab_.mirror_dtype(), static_cast<std::size_t>(owned.size()),
                     "mirror all-gather");
    return;
  }
  const core::DType dtype = slab_.mirror_dtype();
  const std::size_t element = core::dtype_size(dtype);
  auto* mirror = static_cast<std::byte*>(slab_.mirror_origin());
  const comm::DetachedScope detached(comm_);
  for (std::size_t c = 0; c < chunks_.size(); ++c) {
    comm_.group_start();
    for (int rank = 0; rank < comm_.world(); ++rank) {
      const optim::Range piece = chunks_[c].intersect(slab_.layout().shard(rank));
      if (piece.empty()) continue;
      comm_.broadcast(mirror + static_cast<std::size_t>(piece.begin) * element, dtype,
                      static_cast<std::size_t>(piece.size()), rank, "mirror chunk gather (ZeRO-1/2)");
    }
    comm_.group_end();
    arrived_[c] = comm_.marker();
  }
}

const void* WeightSync::acquire(optim::Range range) {
  if (chunks_.empty() || range.empty() || range.end > slab_.layout().total_elements()) {
    throw core::Error("weight sync: acquire of range [" + std::to_string(range.begin) + ", " +
                      std::to_string(range.end) + ") outside the slab, or without a chunked mirror");
  }
  // The last chunk the range reaches: its marker comes after every earlier chunk's.
  const auto last = std::upper_bound(chunks_.begin(), chunks_.end(), range.end - 1,
                                     [](std::int64_t e, const optim::Range& c) { return e < c.end; });
  const std::uint64_t marker = arrived_[static_cast<std::size_t>(last - chunks_.begin())];
  if (marker > waited_) {
    comm_.wait_for(marker);
    waited_ = marker;
  }
  return static_cast<const std::byte*>(slab_.mirror_origin()) +
         static_cast<std::size_t>(range.begin) * core::dtype_size(slab_.mirror_dtype());
}

void WeightSync::wait_all() {
  if (arrived_.empty() || arrived_.back() <= waited_) return;
  comm_.wait_for(arrived_.back());
  waited_ = arrived_.back();
}

}  // namespace trainer
