// Where a model reads the weights of a slab range. Without one, a model reads the slab (its
// mirror, or on cpu the master or a whole-model copy). With ZeRO-3 no rank holds the whole model:
// the trainer's source gathers each range from the ranks owning its pieces into a reusable buffer
// (trainer/weight_gather.h), so a model acquires its weights range by range (ModelSpec::
// weight_ranges), just before it uses them, and releases them after; at most two at once. A model
// also says which range it will acquire next (prefetch), so the source can gather it into its
// free buffer while the current range's compute runs. With ZeRO-1/2 on cuda the mirror is whole
// but arrives chunk by chunk after each update (trainer/gradient_sync.h, WeightSync): acquiring a
// range waits for the chunks it spans.
#pragma once

#include "optim/slab_layout.h"

namespace optim {

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // The weights of global range `range` (element range.begin first): fp32 on cpu, the slab's
  // mirror dtype on cuda; valid until release(range). Every rank acquires the same ranges in the
  // same order (the gather is collective).
  virtual const void* acquire(Range range) = 0;
  virtual void release(Range range) = 0;
  // A hint: `range` is the next range this model acquires (after it releases what it holds now as
  // usual). A source may start gathering it as soon as a buffer is free; the hint is dropped when
  // the next acquire asks for another range. Every rank gives the same hints in the same order.
  virtual void prefetch(Range range) { (void)range; }
};

}  // namespace optim
