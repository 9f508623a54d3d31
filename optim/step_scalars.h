// The few numbers an optimizer step produces and consumes on the device: the gradient
// statistics, the step counters, and the completion counters of the single-launch reductions.
// Kernels derive clipping, skipping and bias correction from these, so the host never waits.
#pragma once

#include <cmath>
#include <cstdint>

#include "optim/float_ops.h"

namespace optim {

enum class NonFinitePolicy : std::int32_t {
  skip_step = 0,     // any non-finite gradient: no update, grads zeroed, step counter not advanced
  zero_element = 1,  // a non-finite gradient element counts as 0 (norm and update)
};

struct StepScalars {
  double grad_sq_sum = 0;            // sum of squares of the finite gradient elements
  unsigned long long nonfinite = 0;  // number of non-finite gradient elements
  long long step = 0;                // applied steps (this step's bias correction uses step + 1)
  long long skipped = 0;             // steps skipped for non-finite gradients
  unsigned int stats_arrivals = 0;   // blocks of the statistics launch that finished
  unsigned int update_arrivals = 0;  // blocks of the update launch that finished
};

// What the host learns about a finished step.
struct StepReport {
  std::int64_t step = 0;           // applied steps so far
  std::int64_t skipped_steps = 0;  // skipped steps so far
  double grad_norm = 0;            // global L2 norm before clipping (finite elements)
  std::uint64_t nonfinite = 0;     // non-finite gradient elements in the step
  bool skipped = false;            // the step was skipped
};

// torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (norm + 1e-6), at most 1;
// max_norm <= 0 disables clipping.
OPTIM_HD float clip_coefficient(double grad_sq_sum, double max_norm) {
  if (!(max_norm > 0)) return 1.0f;
  const double coef = max_norm / (::sqrt(grad_sq_sum) + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

OPTIM_HD bool skips_step(NonFinitePolicy policy, unsigned long long nonfinite) {
  return policy == NonFinitePolicy::skip_step && nonfinite > 0;
}

}  // namespace optim
