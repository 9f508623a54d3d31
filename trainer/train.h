// The training loop of `trainer`: builds the slab, the model and the optimizer on the configured
// device, reads token shards through the sampler, accumulates gradients up to the global batch,
// steps the optimizer on the scheduled learning rate, evaluates and samples, and writes one log
// line and one metrics.jsonl record per logged step. It resumes from a checkpoint under
// checkpoint.resume, saves one every checkpoint.every steps and at the end, and on SIGUSR1,
// SIGTERM or a first SIGINT finishes the current step, saves and returns (trainer/stop_signals.h).
// Under MPI every rank calls train(): the ranks split each global batch, synchronise gradients
// per parallel.zero_stage (trainer/gradient_sync.h), agree on stopping, and rank 0 alone writes
// the logs and metrics.
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "trainer/config.h"

namespace trainer {

struct TrainSummary {
  std::int64_t steps = 0;         // the last step taken (counting the steps before a resume)
  std::int64_t resumed_from = 0;  // the checkpoint's step, 0 for a fresh run
  std::int64_t tokens = 0;        // tokens trained on by this call
  bool stopped_early = false;     // a signal or TrainOptions::stop_after_step ended the run before max_steps
  double seconds = 0;
  double final_loss = 0;       // mean training loss of the last logged interval
  double final_val_loss = -1;  // -1 without validation data
};

struct TrainOptions {
  // > 0: after this step, save a checkpoint and return as a stop signal would (the schedule still
  // spans training.max_steps).
  std::int64_t stop_after_step = 0;
  // The MPI job this process belongs to; nullptr: a single rank without MPI.
  const comm::Environment* environment = nullptr;
};

// Throws core::InputError for bad input (data, devices, a checkpoint that does not verify) and
// core::Error for failures.
TrainSummary train(const RunConfig& config, const TrainOptions& options = {});

}  // namespace trainer
