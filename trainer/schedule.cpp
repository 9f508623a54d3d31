// Learning-rate schedules: the formulas documented in schedule.h.
#include "trainer/schedule.h"

#include <cmath>
#include <numbers>

namespace trainer {

const char* schedule_type_name(ScheduleType type) {
  switch (type) {
    case ScheduleType::constant: return "constant";
    case ScheduleType::linear: return "linear";
    case ScheduleType::cosine: return "cosine";
    case ScheduleType::wsd: return "wsd";
  }
  return "unknown";
}

std::int64_t wsd_decay_steps(const ScheduleConfig& config, std::int64_t max_steps) {
  return std::llround(config.decay_ratio * static_cast<double>(max_steps));
}

double lr_at(const ScheduleConfig& config, double peak_lr, std::int64_t step, std::int64_t max_steps) {
  const std::int64_t warmup = config.warmup_steps;
  const double r = config.min_lr_ratio;
  if (step < warmup) return peak_lr * static_cast<double>(step) / static_cast<double>(warmup);
  if (config.type == ScheduleType::constant) return peak_lr;
  if (step >= max_steps) return peak_lr * r;
  switch (config.type) {
    case ScheduleType::linear: {
      const double remaining = static_cast<double>(max_steps - step) / static_cast<double>(max_steps - warmup);
      return peak_lr * (r + (1.0 - r) * remaining);
    }
    case ScheduleType::cosine: {
      const double progress = static_cast<double>(step - warmup) / static_cast<double>(max_steps - warmup);
      return peak_lr * (r + (1.0 - r) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
    }
    case ScheduleType::wsd: {
      const std::int64_t decay = wsd_decay_steps(config, max_steps);
      const std::int64_t decay_start = max_steps - decay;
      if (step < decay_start) return peak_lr;
      const double progress = static_cast<double>(step - decay_start) / static_cast<double>(decay);
      return peak_lr * (r + (1.0 - r) * (1.0 - progress));
    }
    case ScheduleType::constant: break;
  }
  return peak_lr;
}

}  // namespace trainer
