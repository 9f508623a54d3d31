#include "trainer/task_evaluation.h"

#include <spdlog/spdlog.h>

#include "core/error.h"

namespace trainer {

TaskEvaluation::TaskEvaluation(const RunConfig& config, const models::ModelSpec& spec) {
  if (config.eval.tasks.empty()) return;
  const std::vector<eval::Task> tasks = eval::load_tasks(config.eval.tasks);
  tokenizer_ = text::make_tokenizer(config.data.tokenizer.empty() ? "byte" : config.data.tokenizer);
  eval::EvaluatorOptions options;
  options.max_sequence = config.data.seq_len;
  options.max_sequence_name = "data.seq_len";
  options.decoder = eval::parse_decoder_choice(config.eval.decoder);
  // Generation ends at <|endoftext|> where the run's tokenizer has it, as the samples do.
  if (const auto* bpe = dynamic_cast<const text::BpeTokenizer*>(tokenizer_.get())) {
    if (const std::int64_t eos = bpe->added_token_id("<|endoftext|>"); eos >= 0) {
      options.end_ids.push_back(static_cast<std::int32_t>(eos));
    }
  }
  evaluator_ = std::make_unique<eval::Evaluator>(spec, *tokenizer_, options);
  for (const eval::Task& task : tasks) evaluator_->add(task, config.eval.tasks_limit);
}

void TaskEvaluation::attach(const models::ModelSpec& spec, optim::Slab& slab, const core::DeviceContext& context,
                            ModelRunner& runner) {
  model_ = {.spec = &spec,
            .slab = &slab,
            .context = &context,
            .scorer = &runner.model(),
            .scorer_tokens = runner.max_tokens()};
}

nlohmann::json TaskEvaluation::run(std::int64_t step, comm::Communicator& comm, const float* full_weights,
                                   const void* whole_mirror) {
  if (!evaluator_) throw core::Error("TaskEvaluation::run before attach");
  eval::ModelAccess model = model_;
  model.full_weights = full_weights;
  model.whole_mirror = whole_mirror;
  const auto results = evaluator_->run(model, comm.rank(), comm.world(), [&](std::vector<double> values) {
    return comm.all_reduce_host(std::move(values), comm::ReduceOp::sum, "evaluation task scores");
  });
  nlohmann::json record = {{"step", step}};
  for (const eval::TaskResult& r : results) {
    std::string line = "step " + std::to_string(step) + " | " + r.name;
    for (const auto& [metric, value] : r.metrics) {
      record["eval/" + r.name + "/" + metric] = value;
      line += fmt::format(" {} {:.4f}", metric, value);
    }
    record["eval/" + r.name + "/seconds"] = r.seconds;
    line += fmt::format(" ({} items, {:.2f} s{})", r.items, r.seconds,
                        r.decoder.empty() ? "" : ", " + r.decoder + " decoder");
    if (comm.rank() == 0) spdlog::info("{}", line);
  }
  return record;
}

}  // namespace trainer
