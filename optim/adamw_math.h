// AdamW's formulas, written once for the CPU reference and the CUDA kernel.
//
// Per element, in fp32, with g already multiplied by the clip coefficient (torch.optim.AdamW's
// order of operations):
//   w *= 1 - lr*wd                      (decoupled decay; wd = 0 for segments without decay)
//   m  = b1*m + (1-b1)*g
//   v  = b2*v + (1-b2)*g*g
//   w -= (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps),   bc_i = 1 - b_i^t
// Scalars (bias corrections, step size, decay factor) are formed in double and rounded once.
#pragma once

#include <cmath>
#include <cstdint>

#include "optim/float_ops.h"
#include "optim/segments.h"
#include "optim/step_scalars.h"

namespace optim {

// Hyper-parameters of one step, passed by value to the update launch.
struct AdamWStepParams {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  double max_norm = 0;  // clip threshold; <= 0 disables
  NonFinitePolicy policy = NonFinitePolicy::skip_step;
};

// What the element formula needs, for one segment and one step.
struct AdamWElementParams {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float clip, step_size, bc2_sqrt, decay_factor;
  float inv_bc2_sqrt;  // 1 / sqrt(bc2), for adamw_element_quantised
};

// `t` is the 1-based number of the step being applied.
OPTIM_HD AdamWElementParams adamw_element_params(const AdamWStepParams& p, float clip, long long t, float lr_scale,
                                                 float decay) {
  const double bc1 = 1.0 - ::pow(p.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - ::pow(p.beta2, static_cast<double>(t));
  const double lr = p.lr * static_cast<double>(lr_scale);
  AdamWElementParams e;
  e.beta1 = static_cast<float>(p.beta1);
  e.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  e.beta2 = static_cast<float>(p.beta2);
  e.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  e.eps = static_cast<float>(p.eps);
  e.clip = clip;
  e.step_size = static_cast<float>(lr / bc1);
  e.bc2_sqrt = static_cast<float>(::sqrt(bc2));
  e.inv_bc2_sqrt = static_cast<float>(1.0 / ::sqrt(bc2));
  e.decay_factor = static_cast<float>(1.0 - lr * p.weight_decay * static_cast<double>(decay));
  return e;
}

// Updates one element in place. A non-finite gradient counts as 0 (only reached under the
// zero_element policy: skip_step never calls this when any gradient is non-finite).
OPTIM_HD void adamw_element(float& w, float& m, float& v, float grad, const AdamWElementParams& e) {
  const float g = fp::mul(fp::finite(grad) ? grad : 0.0f, e.clip);
  m = fp::fma(e.beta1, m, fp::mul(e.one_minus_beta1, g));
  v = fp::fma(e.beta2, v, fp::mul(fp::mul(e.one_minus_beta2, g), g));
  const float denom = fp::add(fp::div(fp::sqrt(v), e.bc2_sqrt), e.eps);
  w = fp::mul(w, e.decay_factor);
  w = fp::fma(-e.step_size, fp::div(m, denom), w);
}

// The same update with v's bias correction applied as a multiplication (one correctly rounded
// division per element instead of two): 8-bit AdamW's quantised moments use it, whose values are
// approximations already; its fp32 state keeps adamw_element. It is written as its two halves,
// the moments and the weight step from the updated m and sqrt(v), so that the CUDA kernel can
// take the square roots of a lane's elements together (adamw8bit.cu); the operations and their
// order are the same either way.
OPTIM_HD void adamw_moments(float& m, float& v, float grad, const AdamWElementParams& e) {
  const float g = fp::mul(fp::finite(grad) ? grad : 0.0f, e.clip);
  m = fp::fma(e.beta1, m, fp::mul(e.one_minus_beta1, g));
  v = fp::fma(e.beta2, v, fp::mul(fp::mul(e.one_minus_beta2, g), g));
}

// `sqrt_v` is the correctly rounded square root of the updated v.
OPTIM_HD float adamw_weight_quantised(float w, float m, float sqrt_v, const AdamWElementParams& e) {
  const float denom = fp::fma(sqrt_v, e.inv_bc2_sqrt, e.eps);
  return fp::fma(-e.step_size, fp::div(m, denom), fp::mul(w, e.decay_factor));
}

OPTIM_HD void adamw_element_quantised(float& w, float& m, float& v, float grad, const AdamWElementParams& e) {
  adamw_moments(m, v, grad, e);
  w = adamw_weight_quantised(w, m, fp::sqrt(v), e);
}

}  // namespace optim
