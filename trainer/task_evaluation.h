// Downstream tasks in the training loop (eval.tasks, docs/evaluation.md): the files are read when
// the run starts and every item is checked against data.seq_len and the model's positions before
// the first step; each run splits the items over the ranks and reduces the scores to one number
// per task, which rank 0 logs and records as eval/<task>/<metric> and eval/<task>/seconds.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "eval/evaluator.h"
#include "models/model.h"
#include "text/tokenizer.h"
#include "trainer/config.h"
#include "trainer/model_runner.h"

namespace trainer {

class TaskEvaluation {
 public:
  // Reads the task files and checks every item for the run's model (core::InputError naming the
  // file, line and field); nothing when eval.tasks is empty.
  TaskEvaluation(const RunConfig& config, const models::ModelSpec& spec);
  bool enabled() const { return evaluator_ != nullptr; }

  // The run's model once it exists.
  void attach(const models::ModelSpec& spec, optim::Slab& slab, const core::DeviceContext& context,
              ModelRunner& runner);

  // Runs every task (all ranks together) and returns the step's record: {"step", "eval/<task>/<metric>"...}.
  // The decoders read `full_weights` (cpu) or `whole_mirror` (cuda), as models::DecoderOptions.
  nlohmann::json run(std::int64_t step, comm::Communicator& comm, const float* full_weights, const void* whole_mirror);

 private:
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::unique_ptr<eval::Evaluator> evaluator_;
  eval::ModelAccess model_;
};

}  // namespace trainer
