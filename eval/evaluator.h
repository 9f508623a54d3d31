// Downstream evaluation of a model through the model interface (models/model.h) only: the same
// code serves the trainer (between steps, on its own model and slab) and build/evaluate.
//
// Multiple choice, as lm-evaluation-harness's loglikelihood requests: the context is `ctx` (its
// trailing whitespace moved to the continuation), the continuation " " + ending; the continuation's
// tokens are those of encode(context + continuation) past the length of encode(context). Each
// ending's log-likelihood is the sum of its tokens' log-probabilities from one forward of
// the context and continuation; all endings of an item go through one batched forward (rows padded
// at the end, which a causal model never reads), split only when they exceed the forward's token
// budget. Generative: greedy decoding through the family's decoder, the output cut at the first
// end-of-sequence id and then at the first stop string.
//
// Items are split over the ranks (item i on rank i % world); each task's per-item scores are summed
// over the ranks as one vector, so every rank count gives the same numbers bit for bit.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "eval/metrics.h"
#include "eval/task.h"
#include "models/generation.h"
#include "models/model.h"
#include "optim/slab.h"
#include "text/tokenizer.h"

namespace eval {

// eval.decoder / --decoder (models/generation.h).
using DecoderChoice = models::DecoderChoice;
using models::decoder_choice_name;
using models::parse_decoder_choice;

// The model an evaluation runs: its spec, slab and backend, the trainable model that scores
// continuations (forward_loss + token_losses), and how many tokens one of its forwards takes.
struct ModelAccess {
  const models::ModelSpec* spec = nullptr;
  optim::Slab* slab = nullptr;
  const core::DeviceContext* context = nullptr;
  models::TrainableModel* scorer = nullptr;
  std::int64_t scorer_tokens = 0;
  const float* full_weights = nullptr;  // cpu: as models::DecoderOptions::full_weights
  const void* whole_mirror = nullptr;   // cuda: as models::DecoderOptions::whole_mirror
};

struct EvaluatorOptions {
  std::int64_t max_sequence = 0;  // the most tokens an item may take (a forward's seq; prompt + new tokens)
  std::string max_sequence_name;  // what that limit is, for messages ("data.seq_len")
  DecoderChoice decoder = DecoderChoice::automatic;
  std::vector<std::int32_t> end_ids;  // generation ends at the first of these (left out of the output)
};

struct ItemResult {
  std::int64_t index = 0;  // in the task
  std::int64_t line = 0;
  std::vector<double> loglik;  // multiple choice: per ending
  ChoiceScore choice;
  std::string generated;   // generative: the text after the prompt, up to an end-of-sequence id
  std::string prediction;  // generated, cut at the first stop string (what is scored)
  GenerativeScore generation;
};

struct TaskResult {
  std::string name;
  std::string path;
  TaskKind kind = TaskKind::multiple_choice;
  std::int64_t items = 0;                               // over all ranks
  std::vector<std::pair<std::string, double>> metrics;  // acc, acc_norm | exact_match, prefix_share
  double seconds = 0;                                   // wall time, the slowest rank's included
  std::string decoder;                                  // generative: "plain" or "megakernel"
  std::vector<ItemResult> mine;                         // this rank's items
};

// Sums `values` over the ranks, returning the same result on every rank (one rank: unchanged).
using SumOverRanks = std::function<std::vector<double>(std::vector<double>)>;

class Evaluator {
 public:
  // `spec` (vocabulary, positions) and `tokenizer` must outlive the evaluator.
  Evaluator(const models::ModelSpec& spec, text::Tokenizer& tokenizer, EvaluatorOptions options);
  ~Evaluator();

  // Encodes and checks a task's items (the first `limit` when limit > 0): an item longer than
  // max_sequence or the model's positions, a continuation that encodes to no token, or an id
  // outside the model's vocabulary is a core::InputError naming the file and the line. Needs no
  // weights, so a run can check its tasks before it allocates anything.
  void add(Task task, std::int64_t limit = 0);
  std::size_t task_count() const;

  // Every task on items rank, rank + world, ... of `model` (of the spec given at construction;
  // all ranks must call it together).
  std::vector<TaskResult> run(const ModelAccess& model, int rank, int world, const SumOverRanks& sum);

  // Log-likelihood of each continuation after `context` (ids, non-empty), through the scorer.
  std::vector<double> loglikelihoods(const ModelAccess& model, const std::vector<std::int32_t>& context,
                                     const std::vector<std::vector<std::int32_t>>& continuations);

 private:
  struct Prepared;
  TaskResult run_task(const ModelAccess& model, const Prepared& task, int rank, int world, const SumOverRanks& sum);
  void ensure_decoder(const ModelAccess& model, std::int64_t capacity);

  const models::ModelSpec& spec_;
  text::Tokenizer& tokenizer_;
  EvaluatorOptions options_;
  std::vector<std::unique_ptr<Prepared>> tasks_;
  std::unique_ptr<models::Decoder> decoder_;
  // What decoder_ reads: a model access with other weights (ZeRO-3 gathers them afresh for each
  // evaluation) builds a new decoder.
  const optim::Slab* decoder_slab_ = nullptr;
  const void* decoder_weights_ = nullptr;
  std::string decoder_kind_;
  core::Buffer ids_, targets_;  // the scorer's inputs in the backend's memory
};

}  // namespace eval
