// The weight ranges a model holds from a weight source (optim/weight_source.h, ZeRO-3) for a
// scope, and where a tensor's weights are inside them; shared by the cpu models (fp32) and the
// cuda models (16-bit mirror ranges). `const auto held = holds.hold(range, next);` acquires the
// range, tells the source that `next` is the range acquired after it (WeightSource::prefetch; empty:
// none known), and releases the range when `held` goes out of scope; without a source all three do
// nothing.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "optim/slab_layout.h"
#include "optim/weight_source.h"

namespace models {

// The slab range from the first element of tensor `first` to the end of tensor `last` (the
// ranges a model reads: an embedding, a layer's contiguous tensors).
optim::Range tensor_span(const optim::SlabLayout& layout, int first, int last);
// A language model's last range: its final norm, and an untied head after it (a tied head is
// the embedding's range).
optim::Range tail_span(const optim::SlabLayout& layout, int final_norm, int head, int embed);

class WeightHolds {
 public:
  class Hold {
   public:
    Hold(WeightHolds& holds, optim::Range range, optim::Range next = {});
    ~Hold();
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    WeightHolds& holds_;
    optim::Range range_;
  };

  // `element_bytes`: 4 for the cpu's fp32, 2 for a 16-bit mirror.
  WeightHolds(optim::WeightSource* source, const optim::SlabLayout& layout, std::size_t element_bytes)
      : source_(source), layout_(layout), element_bytes_(element_bytes) {}

  bool active() const { return source_ != nullptr; }
  // Holds `range` for the scope of the result (nothing without a source or for an empty range),
  // then hints `next`.
  [[nodiscard]] Hold hold(optim::Range range, optim::Range next = {}) { return Hold(*this, range, next); }
  // Hints that `next` is the range acquired next (nothing without a source or for an empty range).
  void prefetch(optim::Range next) {
    if (source_ != nullptr && !next.empty()) source_->prefetch(next);
  }
  // The first element of tensor `tensor` inside a held range; core::Error when none holds it.
  void* find(int tensor) const;

 private:
  optim::WeightSource* source_;
  const optim::SlabLayout& layout_;
  std::size_t element_bytes_;
  std::vector<std::pair<optim::Range, std::byte*>> held_;
};

}  // namespace models
