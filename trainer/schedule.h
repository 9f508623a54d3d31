// Learning-rate schedules of the trainer: a linear warmup from 0 followed by constant, linear,
// cosine or warmup-stable-decay (WSD) shapes, as a multiple of the optimizer's peak rate.
#pragma once

#include <cstdint>
#include <string>

namespace trainer {

enum class ScheduleType { constant, linear, cosine, wsd };

// The `schedule:` section of a run's config.
struct ScheduleConfig {
  ScheduleType type = ScheduleType::cosine;
  std::int64_t warmup_steps = 0;  // W
  double min_lr_ratio = 0.1;      // r: linear, cosine and wsd end at r * peak_lr
  double decay_ratio = 0.2;       // wsd only: the final fraction of the steps that decays

  bool operator==(const ScheduleConfig&) const = default;
};

const char* schedule_type_name(ScheduleType type);

// WSD's decay length D = round(decay_ratio * max_steps) (halves away from zero).
std::int64_t wsd_decay_steps(const ScheduleConfig& config, std::int64_t max_steps);

// The learning rate of optimizer step `step` (0-based: the number of steps already taken) of a
// run of T = max_steps steps, with P = peak_lr, W = warmup_steps and r = min_lr_ratio:
//   warmup, s < W:   P * s / W                  (the first step runs at 0, as transformers' schedules)
//   constant:        P
//   linear:          P * (r + (1 - r) * (T - s) / (T - W))
//   cosine:          P * (r + (1 - r) * (1 + cos(pi * (s - W) / (T - W))) / 2)
//   wsd:             P while s < T - D (stable); then P * (r + (1 - r) * (1 - (s - (T - D)) / D))
//                    over the last D = wsd_decay_steps() steps
// For s >= T the end value holds: P for constant, r * P for the others.
double lr_at(const ScheduleConfig& config, double peak_lr, std::int64_t step, std::int64_t max_steps);

}  // namespace trainer
