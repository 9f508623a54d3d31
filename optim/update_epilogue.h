// Host side of the end every optimizer's update shares (the kernels' is update_epilogue.cuh): the
// updated weight's mirror stored rounding to nearest, its gradient zeroed (also on a skipped
// step), and the step or skipped counter advanced. The CPU references keep only their formulas.
#pragma once

#include <cstdint>

#include "core/half.h"
#include "optim/step_scalars.h"

namespace optim {

inline void write_back(float w, float& g, std::uint16_t& mirror, bool bf16) {
  mirror = bf16 ? core::float_to_bf16(w) : core::float_to_fp16(w);
  g = 0.0f;
}

inline void finish_update(StepScalars& s, bool skipped) {
  if (skipped) {
    ++s.skipped;
  } else {
    ++s.step;
  }
}

}  // namespace optim
