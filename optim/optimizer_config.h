// The `optimizer` section of a run's config, validated (read from YAML by trainer/optimizer_yaml.h). Hyper-parameters
// are kept in double, as PyTorch keeps them, and rounded to fp32 only where the element formulas use them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "optim/step_scalars.h"

namespace optim {

// How adamw8bit encodes its moments (docs/optimizers.md explains both).
enum class Quantization {
  companded,  // m: sign + square-root code; v: fourth-root code; stochastic rounding (default)
  linear,     // m and v: signed int8, per-block absmax, round to nearest (the baseline scheme)
};

// Where Adafactor's eps1 enters the second-moment estimate.
enum class Eps1Mode {
  add,    // statistics of g*g + eps1 (the paper, Hugging Face)
  clamp,  // statistics of g*g; the row mean is clamped at eps1 and V at eps1^2 (torch.optim.Adafactor)
};

// What Adafactor's decoupled weight decay is multiplied by.
enum class DecayScale {
  lr,     // the step's learning rate: w *= 1 - lr*wd (torch.optim.Adafactor, AdamW)
  alpha,  // the relative step size incl. parameter scale: w -= alpha*wd*w (Hugging Face)
};

// Muon's learning-rate adjustment per matrix [rows, cols] (torch.optim.Muon's adjust_lr_fn).
enum class MuonAdjustLr {
  original,         // lr * sqrt(max(1, rows / cols)) (Keller Jordan's Muon; torch's default)
  match_rms_adamw,  // lr * 0.2 * sqrt(max(rows, cols)) (Moonlight: the update's RMS of AdamW's)
};

struct AdamW8bitConfig {
  std::int64_t min_8bit_size = 4096;  // tensors with fewer elements keep fp32 state
  Quantization quantization = Quantization::companded;

  bool operator==(const AdamW8bitConfig&) const = default;
};

struct AdafactorConfig {
  double eps1 = 1e-30;
  double eps2 = 1e-3;
  double clip_threshold = 1.0;
  double decay_rate = -0.8;
  std::optional<double> beta1;  // first moment off unless set
  bool relative_step = true;    // step size min(lr, 1/sqrt(t)) (min(1e-6 t, 1/sqrt(t)) with warmup_init)
  bool scale_parameter = true;  // multiply the step size by max(eps2, rms(w))
  bool warmup_init = false;
  Eps1Mode eps1_mode = Eps1Mode::add;
  DecayScale decay_scale = DecayScale::lr;

  bool operator==(const AdafactorConfig&) const = default;
};

// Muon for the hidden matrices (ParamSpec::hidden_matrix); every other tensor takes AdamW with the
// config's lr, betas, eps and weight_decay. Defaults are torch.optim.Muon's.
struct MuonConfig {
  double lr = 1e-3;  // peak rate of the matrices (the schedule scales it as it scales optimizer.lr)
  double momentum = 0.95;
  bool nesterov = true;
  std::int64_t ns_steps = 5;           // Newton-Schulz iterations
  double eps = 1e-7;                   // floor of the Frobenius norm the update is divided by
  std::optional<double> weight_decay;  // unset: optimizer.weight_decay
  MuonAdjustLr adjust_lr = MuonAdjustLr::original;

  bool operator==(const MuonConfig&) const = default;
};

struct OptimizerConfig {
  std::string type = "adamw";  // adamw | adamw8bit | adafactor | muon
  double lr = 3e-4;            // peak learning rate (a schedule scales it per step)
  double beta1 = 0.9;          // adamw, adamw8bit, muon (its AdamW tensors)
  double beta2 = 0.95;         // adamw, adamw8bit, muon
  double eps = 1e-8;           // adamw, adamw8bit, muon
  double weight_decay = 0.1;   // decoupled; applied only to tensors with decay
  double grad_clip = 1.0;      // max global L2 norm of the gradients; 0 disables clipping
  NonFinitePolicy nonfinite = NonFinitePolicy::skip_step;
  AdamW8bitConfig adamw8bit;
  AdafactorConfig adafactor;
  MuonConfig muon;

  bool operator==(const OptimizerConfig&) const = default;
};

// Throws core::InputError naming `where` and the key when a value is out of range.
void validate(const OptimizerConfig& config, const std::string& where);

const char* nonfinite_policy_name(NonFinitePolicy policy);

}  // namespace optim
