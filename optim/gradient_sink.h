// Where a model's backward puts the fp32 gradients of slab ranges. Two kinds exist:
//   - the slab itself (max_range_elements() == 0): any range, its memory being the slab's
//     gradient buffer, so gradients accumulate across micro-batches;
//   - staging (ZeRO-2 with sharded gradients): a small buffer per range, handed out zeroed, whose
//     gradients must be final when the range is released (the sink then reduces them onto the
//     ranks owning them and reuses the buffer). The backward then splits vocabulary-sized tensors
//     into row ranges of at most max_range_elements(). Staging may also offer one held range:
//     a buffer for a range of up to max_held_range_elements(), open across the other ranges'
//     acquires and releases (acquire_held), so a vocabulary-sized gradient can be accumulated
//     over token chunks in one pass instead of being recomputed window by window.
// A backward acquires a range, adds the range's gradients into it (GEMMs with beta = 1, norm
// kernels that add), and releases it, one range at a time, in stream order.
#pragma once

#include <cstdint>

#include "optim/slab_layout.h"

namespace optim {

class GradientSink {
 public:
  virtual ~GradientSink() = default;
  // The most elements one acquired range may span; 0: no limit.
  virtual std::int64_t max_range_elements() const = 0;
  // fp32 memory for the gradients of global range `range` (its first element first), valid until
  // release(range).
  virtual float* acquire(Range range) = 0;
  // The gradients of `range` are complete for this backward (the work producing them is queued).
  virtual void release(Range range) = 0;
  // The largest range acquire_held() takes (0: none; a sink without a range limit needs none, its
  // acquire() keeps any range open anyway).
  virtual std::int64_t max_held_range_elements() const { return 0; }
  // Like acquire(), but the range stays open while other ranges are acquired and released, until
  // release(range); one held range at a time.
  virtual float* acquire_held(Range range) { return acquire(range); }
};

}  // namespace optim
