// Adafactor's formulas (Shazeer & Stern 2018), written once for the CPU reference and the CUDA
// kernels. Per tensor W with gradient G (already multiplied by the global clip coefficient),
// at step t (1-based):
//   rho   = relative_step ? min(warmup_init ? 1e-6 t : lr, 1/sqrt(t)) : lr
//   alpha = scale_parameter ? max(eps2, rms(W)) * rho : rho            (rms(W) before the step)
//   b2    = 1 - t^decay_rate
//   factored [R, C] (row-major), row means r_i and column means c_j of G*G:
//     eps1_mode add:   R_i = b2 R_i + (1-b2)(r_i + eps1);  C_j likewise
//                      V_ij = (R_i / mean(R)) * C_j
//     eps1_mode clamp: R_i = R_i + (1-b2)(r_i - R_i);      C_j likewise   (torch's lerp)
//                      V_ij = max((R_i / max(mean(R), eps1)) * C_j, eps1^2)
//   otherwise v (full):  add: v = b2 v + (1-b2)(g^2 + eps1) | clamp: v = v + (1-b2)(g^2 - v), V = max(v, eps1^2)
//   U = G / sqrt(V);  U /= max(1, rms(U) / clip_threshold)
//   update = alpha U;  with beta1: m = b1 m + (1-b1) update, update = m
//   W = W (1 - wd * (decay_scale == lr ? lr : alpha)) - update
// Scalars are formed in double; element arithmetic is fp32 with the fp:: operations.
#pragma once

#include <cmath>
#include <cstdint>

#include "optim/float_ops.h"
#include "optim/optimizer_config.h"
#include "optim/step_scalars.h"

namespace optim {

// Hyper-parameters of one step, passed by value to every Adafactor launch.
struct AdafactorStepParams {
  double lr = 0;
  double eps1 = 1e-30;
  double eps2 = 1e-3;
  double clip_threshold = 1.0;
  double decay_rate = -0.8;
  double beta1 = -1;  // < 0: no first moment
  double weight_decay = 0;
  double max_norm = 0;  // global gradient clip; <= 0 disables
  bool relative_step = true;
  bool scale_parameter = true;
  bool warmup_init = false;
  Eps1Mode eps1_mode = Eps1Mode::add;
  DecayScale decay_scale = DecayScale::lr;
  NonFinitePolicy policy = NonFinitePolicy::skip_step;
};

OPTIM_HD double adafactor_beta2(const AdafactorStepParams& p, long long t) {
  return 1.0 - ::pow(static_cast<double>(t), p.decay_rate);
}

// The relative step size rho for a segment whose learning rate is `lr` (lr * lr_scale).
OPTIM_HD double adafactor_rho(const AdafactorStepParams& p, double lr, long long t) {
  if (!p.relative_step) return lr;
  const double base = p.warmup_init ? 1e-6 * static_cast<double>(t) : lr;
  const double inv_sqrt_t = 1.0 / ::sqrt(static_cast<double>(t));
  return base < inv_sqrt_t ? base : inv_sqrt_t;
}

// The step size alpha from rho and the tensor's sum of squared weights.
OPTIM_HD double adafactor_alpha(const AdafactorStepParams& p, double rho, double weight_sq_sum, double numel) {
  if (!p.scale_parameter) return rho;
  const double rms = numel > 0 ? ::sqrt(weight_sq_sum / numel) : 0.0;
  return (rms > p.eps2 ? rms : p.eps2) * rho;
}

// One row or column statistic's EMA from its mean of g*g over the tensor's row or column.
OPTIM_HD float adafactor_ema(const AdafactorStepParams& p, double beta2, float state, double mean_sq) {
  if (p.eps1_mode == Eps1Mode::add) {
    return static_cast<float>(beta2 * static_cast<double>(state) + (1.0 - beta2) * (mean_sq + p.eps1));
  }
  return static_cast<float>(static_cast<double>(state) + (1.0 - beta2) * (mean_sq - static_cast<double>(state)));
}

// The per-step constants the element formulas need (one set per tensor).
struct AdafactorElementParams {
  float beta2, one_minus_beta2, eps1, eps1_sq;
  float mean_row;      // factored: mean(R) (clamped at eps1 in clamp mode)
  float update_scale;  // alpha / max(1, rms(U) / clip_threshold)
  float decay_factor;  // 1 - wd * (lr or alpha)
  float beta1, one_minus_beta1;
  float clip;  // global gradient clip coefficient
  bool add_mode, use_beta1;
};

OPTIM_HD float adafactor_grad(float grad, float clip) { return fp::mul(fp::finite(grad) ? grad : 0.0f, clip); }

// V for a factored element from its row and column statistics.
OPTIM_HD float adafactor_factored_v(const AdafactorElementParams& e, float row, float col) {
  const float v = fp::mul(fp::div(row, e.mean_row), col);
  return e.add_mode ? v : (v > e.eps1_sq ? v : e.eps1_sq);
}

// Updates a full second moment in place and returns V for the element.
OPTIM_HD float adafactor_full_v(const AdafactorElementParams& e, float& v, float g) {
  const float g2 = fp::mul(g, g);
  if (e.add_mode) {
    v = fp::fma(e.beta2, v, fp::mul(e.one_minus_beta2, fp::add(g2, e.eps1)));
    return v;
  }
  v = fp::fma(e.one_minus_beta2, fp::add(g2, -v), v);
  return v > e.eps1_sq ? v : e.eps1_sq;
}

// V of a full second moment that this step has already updated.
OPTIM_HD float adafactor_full_v_read(const AdafactorElementParams& e, float v) {
  return e.add_mode || v > e.eps1_sq ? v : e.eps1_sq;
}

OPTIM_HD float adafactor_u(float g, float v) { return fp::div(g, fp::sqrt(v)); }

// Applies the update for one element given its unclipped U.
OPTIM_HD void adafactor_apply(const AdafactorElementParams& e, float& w, float* m, float u) {
  float update = fp::mul(e.update_scale, u);
  if (e.use_beta1) {
    *m = fp::fma(e.beta1, *m, fp::mul(e.one_minus_beta1, update));
    update = *m;
  }
  w = fp::add(fp::mul(w, e.decay_factor), -update);
}

}  // namespace optim

namespace optim {

// Element constants for one tensor. `u_sq_sum` is the tensor's sum of U*U (0 before it is known),
// `row_mean` the mean of its row statistics (factored tensors), `lr` the segment's learning rate.
OPTIM_HD AdafactorElementParams adafactor_element_params(const AdafactorStepParams& p, long long t, float clip,
                                                         double lr, float decay, double weight_sq_sum, double u_sq_sum,
                                                         double numel, double row_mean) {
  AdafactorElementParams e;
  const double beta2 = adafactor_beta2(p, t);
  e.beta2 = static_cast<float>(beta2);
  e.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  e.eps1 = static_cast<float>(p.eps1);
  e.eps1_sq = static_cast<float>(p.eps1 * p.eps1);
  e.add_mode = p.eps1_mode == Eps1Mode::add;
  e.mean_row = static_cast<float>(e.add_mode || row_mean > p.eps1 ? row_mean : p.eps1);
  const double alpha = adafactor_alpha(p, adafactor_rho(p, lr, t), weight_sq_sum, numel);
  const double rms_u = numel > 0 ? ::sqrt(u_sq_sum / numel) : 0.0;
  const double divisor = rms_u / p.clip_threshold > 1.0 ? rms_u / p.clip_threshold : 1.0;
  e.update_scale = static_cast<float>(alpha / divisor);
  const double decay_lr = p.decay_scale == DecayScale::lr ? lr : alpha;
  e.decay_factor = static_cast<float>(1.0 - p.weight_decay * static_cast<double>(decay) * decay_lr);
  e.use_beta1 = p.beta1 >= 0;
  e.beta1 = static_cast<float>(e.use_beta1 ? p.beta1 : 0.0);
  e.one_minus_beta1 = static_cast<float>(e.use_beta1 ? 1.0 - p.beta1 : 0.0);
  e.clip = clip;
  return e;
}

}  // namespace optim
