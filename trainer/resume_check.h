// What a resume may not change silently, checked against the checkpoint before anything is
// written: the model's function and the learning-rate schedule.
#pragma once

#include "trainer/checkpoint.h"
#include "trainer/config.h"

namespace trainer {

// core::InputError naming the key and both values when a shape key of the model (every field that
// changes what the model computes, as model.init_from compares them) differs from the checkpoint's,
// or when the schedule (training.max_steps where the schedule depends on it, optimizer.lr,
// schedule.*) differs and checkpoint.allow_schedule_change is false; a warning when allowed.
// Keys that only set the initial weights are reported as unused.
void check_resume_config(const VerifiedCheckpoint& checkpoint, const RunConfig& config);

}  // namespace trainer
