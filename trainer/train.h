// The training loop of `trainer`: builds the slab, the model and the optimizer on the configured
// device, reads token shards through the sampler, accumulates gradients up to the global batch,
// steps the optimizer on the scheduled learning rate, evaluates and samples, and writes one log
// line and one metrics.jsonl record per logged step.
#pragma once

#include <cstdint>

#include "trainer/config.h"

namespace trainer {

struct TrainSummary {
  std::int64_t steps = 0;
  std::int64_t tokens = 0;
  double seconds = 0;
  double final_loss = 0;      // mean training loss of the last logged interval
  double final_val_loss = -1;  // -1 without validation data
};

// Throws core::InputError for bad input (data, devices) and core::Error for failures.
TrainSummary train(const RunConfig& config);

}  // namespace trainer
