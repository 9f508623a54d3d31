// Weight ranges held from a source for a scope (weight_holds.h).
#include "models/weight_holds.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace models {

optim::Range tensor_span(const optim::SlabLayout& layout, int first, int last) {
  const auto& tensors = layout.tensors();
  return {tensors[static_cast<std::size_t>(first)].range().begin, tensors[static_cast<std::size_t>(last)].range().end};
}

optim::Range tail_span(const optim::SlabLayout& layout, int final_norm, int head, int embed) {
  return tensor_span(layout, final_norm, head == embed ? final_norm : head);
}

WeightHolds::Hold::Hold(WeightHolds& holds, optim::Range range, optim::Range next) : holds_(holds), range_(range) {
  if (holds_.source_ == nullptr) return;
  if (!range.empty()) {
    // Models only read what a source hands out; the pointer is stored mutable for one lookup type.
    auto* base = static_cast<std::byte*>(const_cast<void*>(holds_.source_->acquire(range)));
    holds_.held_.emplace_back(range, base);
  }
  holds_.prefetch(next);
}

WeightHolds::Hold::~Hold() {
  if (holds_.source_ == nullptr || range_.empty()) return;
  std::erase_if(holds_.held_, [&](const auto& h) { return h.first == range_; });
  holds_.source_->release(range_);
}

void* WeightHolds::find(int tensor) const {
  const optim::SlabTensor& t = layout_.tensors()[static_cast<std::size_t>(tensor)];
  for (const auto& [range, base] : held_) {
    if (range.contains(t.range())) return base + static_cast<std::size_t>(t.offset - range.begin) * element_bytes_;
  }
  throw core::Error("the weights of '" + t.spec.name + "' were read outside an acquired range");
}

}  // namespace models
