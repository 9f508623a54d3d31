// Muon's formulas (torch.optim.Muon's), written once for the CPU reference and the kernels.
//
// Per hidden matrix, with g the gradient already multiplied by the clip coefficient, in fp32:
//   buf = lerp(buf, g, 1 - mu)                  (torch: buf.lerp_(grad, 1 - momentum))
//   u   = nesterov ? lerp(g, buf, mu) : buf     (torch: grad.lerp(buf, momentum))
//   O   = NS_k(u)                               (newton_schulz.h: whole matrices)
//   w  *= 1 - lr*wd;   w -= adjusted_lr * O     (adjusted_lr: muon_adjusted_lr)
// lerp(a, b, t) is evaluated as torch does: a + t (b - a) for |t| < 0.5, b - (b - a)(1 - t)
// otherwise, with t rounded to fp32 first. Scalars are formed in double and rounded once.
#pragma once

#include <cmath>
#include <cstdint>

#include "optim/float_ops.h"
#include "optim/optimizer_config.h"

namespace optim {

// The quintic Newton-Schulz coefficients of torch.optim.Muon (Keller Jordan's).
inline constexpr float kMuonNsA = 3.4445f;
inline constexpr float kMuonNsB = -4.7750f;
inline constexpr float kMuonNsC = 2.0315f;

// What the element formulas need for one step.
struct MuonMomentumParams {
  float keep_weight;      // float(1 - mu), the weight of g in buf's lerp
  float nesterov_weight;  // float(mu); < 0 without Nesterov (u = buf)
  float clip;
};

// Per matrix and step.
struct MuonWeightParams {
  float decay_factor;  // 1 - lr * wd (wd = 0 for tensors without decay)
  float step_size;     // the adjusted learning rate
};

OPTIM_HD float torch_lerp(float a, float b, float t) {
  const float diff = fp::add(b, -a);
  return (t < 0.5f && t > -0.5f) ? fp::add(a, fp::mul(t, diff)) : fp::add(b, -fp::mul(diff, fp::add(1.0f, -t)));
}

// Updates the momentum buffer of one element and returns the value Newton-Schulz orthogonalises.
// A non-finite gradient counts as 0 (only reached under the zero_element policy).
OPTIM_HD float muon_momentum(float& buf, float grad, const MuonMomentumParams& p) {
  const float g = fp::mul(fp::finite(grad) ? grad : 0.0f, p.clip);
  buf = torch_lerp(buf, g, p.keep_weight);
  return p.nesterov_weight >= 0 ? torch_lerp(g, buf, p.nesterov_weight) : buf;
}

// `o` is the element of the orthogonalised update.
OPTIM_HD float muon_weight(float w, float o, const MuonWeightParams& p) {
  return fp::add(fp::mul(w, p.decay_factor), -fp::mul(p.step_size, o));
}

// torch.optim.Muon's _adjust_lr for a [rows, cols] matrix.
inline double muon_adjusted_lr(double lr, MuonAdjustLr adjust, std::int64_t rows, std::int64_t cols) {
  const auto a = static_cast<double>(rows), b = static_cast<double>(cols);
  if (adjust == MuonAdjustLr::match_rms_adamw) return lr * (0.2 * std::sqrt(a > b ? a : b));
  return lr * std::sqrt(a / b > 1.0 ? a / b : 1.0);
}

}  // namespace optim
