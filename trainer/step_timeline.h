// One training step's timeline on the GPU, per rank (logging.timeline_step): the compute
// stream's phases (the model's own where it records them, as Qwen3Cuda's per-op phases, the
// trainer's optimizer and its waits for the gradient and weight synchronisation) and the
// communication stream's collectives, each with its start and end from CUDA events against one
// origin recorded as the step starts (no profiler needed). The trainer writes it as timeline_rank<R>.json in the run
// directory with a summary of how much communication ran under compute; bench/timeline.py draws
// the ranks' files.
#pragma once

#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "core/device.h"
#include "core/phase_timer.h"
#include "models/model.h"

namespace trainer {

// Busy time of a lane is the length of the union of its intervals; compute phases named "wait..."
// (the trainer's gradient and weight synchronisation, where the compute stream waits for
// collectives) are drawn but not counted. `comm_under_compute_ms`: the communication lane's busy
// time that overlaps the compute lane's; `comm_exposed_ms`: the rest.
struct TimelineSummary {
  double step_ms = 0, compute_busy_ms = 0, comm_busy_ms = 0, comm_under_compute_ms = 0, comm_exposed_ms = 0;
};
TimelineSummary summarize_timeline(const std::vector<core::PhaseTimer::Interval>& compute,
                                   const std::vector<core::PhaseTimer::Interval>& comm, double step_ms);

class StepTimeline {
 public:
  // `model`'s phase timer and the communicator's are set for begin()..finish() only.
  StepTimeline(const core::DeviceContext& context, comm::Communicator& comm, models::TrainableModel& model);
  ~StepTimeline();
  StepTimeline(const StepTimeline&) = delete;
  StepTimeline& operator=(const StepTimeline&) = delete;

  // The origin, before the step's first work is queued; turns the timers on.
  void begin();
  // The compute stream's timer, for the trainer's own phases between begin() and finish().
  core::PhaseTimer* compute() { return &compute_; }
  // After the step's last work is queued: waits for it, turns the timers off and returns
  // {"step_ms", "compute": [[name, start, end]...], "comm": [...], "summary": {...}}.
  nlohmann::json finish();

 private:
  cudaStream_t stream_;
  comm::Communicator& comm_;
  models::TrainableModel& model_;
  core::PhaseTimer compute_;
  cudaEvent_t origin_ = nullptr, end_ = nullptr;
};

}  // namespace trainer
