// The run configuration of the trainer: a strict schema over a YAML file plus `a.b=value`
// command-line overrides. Every section, key, type and range is checked before any work starts;
// each error is a core::InputError naming the file and line (or the override), the key path and
// what was expected, with a did-you-mean suggestion for misspelt keys.
//
// Sections and keys (defaults in the structs below; `required` marks the keys without one):
//   run:        name, output_dir (required), seed
//   device:     cuda | cpu
//   model:      arch (a family of models/registry.cpp: qwen3, e29a), preset (one of the family's;
//               required unless init_from is set), init_from (a Hugging Face folder or a
//               checkpoint: step or run directory; its shape then comes from its config.json or
//               manifest and the keys given here must agree), and the family's fields (its
//               config table in models/<family>/family.cpp: e.g. hidden_size, num_layers, recompute)
//   data:       train (required), val, seq_len, tokenizer (byte | path to a tokenizer.json)
//   training:   micro_batch_size, global_batch_size, max_steps (required), precision, grad_clip
//   optimizer:  the keys of trainer/optimizer_yaml.h except grad_clip
//   schedule:   type (constant | linear | cosine | wsd), warmup_steps, min_lr_ratio, decay_ratio
//   parallel:   zero_stage (0 | 1 | 2 | 3), timeout_s
//   checkpoint: every, keep_last, resume (auto | never | PATH), at_end, allow_data_change,
//               allow_schedule_change
//   eval:       every, batches
//   logging:    every, tensorboard
//   sample:     every, tokens, prompt, decoder (auto | megakernel | plain)
// Paths (data files, tokenizer, init_from, resume) are relative to the working directory and
// must exist when the config is loaded; run.output_dir is created by the trainer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"
#include "optim/optimizer_config.h"
#include "trainer/schedule.h"

namespace trainer {

enum class Device { cuda, cpu };
enum class Precision { bf16, fp32 };

struct RunSection {
  std::string name = "run";
  std::string output_dir;  // required
  std::uint64_t seed = 1234;

  bool operator==(const RunSection&) const = default;
};

struct ModelConfig {
  std::string arch = "qwen3";
  std::string preset;              // empty: none (only with init_from)
  models::Shape shape;             // every field of the family: fallbacks, the preset, then the keys given
  std::vector<std::string> given;  // the field keys the config or an override set, in table order
  std::string init_from;           // empty: random initialisation
  // Set by resolve_init_from: the config.json keys of the folder or checkpoint started from,
  // carried into the checkpoints' manifests and exports (token ids and other metadata).
  nlohmann::json carried_hf_config;

  // `given` is how the config was written, not what it means: equal configs may differ in it.
  bool operator==(const ModelConfig& o) const {
    return arch == o.arch && preset == o.preset && shape == o.shape && init_from == o.init_from &&
           carried_hf_config == o.carried_hf_config;
  }
};

struct DataConfig {
  std::string train;               // token shard file(s), required
  std::string val;                 // empty: no validation data (eval.every must then be 0)
  std::int64_t seq_len = 1024;     // tokens per sequence, <= the model's max_position_embeddings
  std::string tokenizer = "byte";  // byte (vocab_size >= 256) or a tokenizer.json path

  bool operator==(const DataConfig&) const = default;
};

struct TrainingConfig {
  std::int64_t micro_batch_size = 1;  // sequences per rank per forward/backward
  // Sequences (not tokens) per optimizer step over all ranks; a multiple of micro_batch_size x
  // world size (checked by validate_for_world). Unset (`auto` in YAML): micro_batch_size x world
  // size, i.e. no gradient accumulation.
  std::optional<std::int64_t> global_batch_size;
  std::int64_t max_steps = 0;             // optimizer steps, required
  Precision precision = Precision::bf16;  // cuda requires bf16, cpu fp32; defaults to the device's
  // Max global L2 norm of the gradients (0 disables). It lives here, not in the optimizer section,
  // and is copied into RunConfig::optimizer.grad_clip.
  double grad_clip = 1.0;

  bool operator==(const TrainingConfig&) const = default;
};

// With sharded gradients (ZeRO-2/3, cuda, one micro-batch a step), how the vocabulary-sized head
// and embedding gradients are made: `whole` keeps one fp32 [vocab, dim] buffer beside the layer
// staging and computes them in the fused cross-entropy pass; `windows` needs no such buffer but
// computes the logits a second time, window by window, after the layers.
enum class VocabGradient { whole, windows };

struct ParallelConfig {
  // 0: replicated state, 1: sharded optimizer state, 2: + sharded gradients, 3: + sharded weights
  int zero_stage = 1;
  std::int64_t timeout_s = 300;  // collective timeout
  VocabGradient vocab_gradient = VocabGradient::whole;

  bool operator==(const ParallelConfig&) const = default;
};

struct CheckpointConfig {
  std::int64_t every = 1000;    // steps between checkpoints; 0: only on a signal and at the end
  std::int64_t keep_last = 3;   // complete checkpoints kept; 0 keeps all
  std::string resume = "auto";  // auto: newest complete checkpoint if any; never; or a checkpoint path
  bool at_end = true;           // save after the last step (benchmarks turn it off)
  // Resuming with another data.seq_len or global batch changes the order in which the data is
  // seen (windows cut at other offsets, or taken at another rate): refused unless this is set.
  bool allow_data_change = false;
  bool allow_schedule_change = false;  // resume with another lr, schedule.* or max_steps

  bool operator==(const CheckpointConfig&) const = default;
};

struct EvalConfig {
  std::int64_t every = 0;     // steps between validation losses (0: never); defaults to 200 with data.val
  std::int64_t batches = 20;  // micro-batches per rank per validation
  // Downstream tasks (docs/evaluation.md): JSONL files, run every tasks_every steps (0: only after
  // the last step), the first tasks_limit items of each (0: all), generating with `decoder`
  // (auto, megakernel or plain).
  std::vector<std::string> tasks;
  std::int64_t tasks_every = 0;
  std::int64_t tasks_limit = 0;
  std::string decoder = "auto";

  bool operator==(const EvalConfig&) const = default;
};

struct LoggingConfig {
  std::int64_t every = 10;  // steps between log lines and metric records
  bool tensorboard = false;
  std::int64_t timeline_step = 0;  // cuda: each rank writes this step's timeline (0: none)

  bool operator==(const LoggingConfig&) const = default;
};

struct SampleConfig {
  std::int64_t every = 0;     // steps between generated samples (0: never)
  std::int64_t tokens = 128;  // tokens generated per sample
  std::string prompt = "Once upon a time";
  std::string decoder = "auto";  // auto, megakernel or plain (models::DecoderChoice)

  bool operator==(const SampleConfig&) const = default;
};

struct RunConfig {
  RunSection run;
  Device device = Device::cuda;
  ModelConfig model;
  DataConfig data;
  TrainingConfig training;
  optim::OptimizerConfig optimizer;  // grad_clip == training.grad_clip
  ScheduleConfig schedule;
  ParallelConfig parallel;
  CheckpointConfig checkpoint;
  EvalConfig eval;
  LoggingConfig logging;
  SampleConfig sample;

  bool operator==(const RunConfig&) const = default;
};

struct ConfigOptions {
  // false: paths (data, tokenizer, checkpoint, init_from) need not exist: `trainer --plan` reads
  // a config written for another machine.
  bool check_paths = true;
};

// Reads `path`, applies `overrides` (each `section.key=value`, the value parsed as a YAML scalar
// or flow collection, e.g. `optimizer.betas=[0.9,0.99]`, later ones winning) and validates.
// Throws core::InputError for a missing or malformed file, an unknown key, a wrong type, a value
// out of range, a missing required key, a missing data file, or a malformed override.
RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides,
                          const ConfigOptions& options = {});

// As load_run_config, from YAML text; `source` names it in messages.
RunConfig parse_run_config(const std::string& yaml, const std::string& source,
                           const std::vector<std::string>& overrides, const ConfigOptions& options = {});

// The spec of the configured model (its family and shape).
std::unique_ptr<models::ModelSpec> model_spec(const RunConfig& config);

// Checks what depends on the number of ranks: the global batch is a whole number of
// micro-batches on every rank. Throws core::InputError.
void validate_for_world(const RunConfig& config, int world);

// Sequences per optimizer step over all ranks, and micro-batches per rank per step.
std::int64_t global_batch_sequences(const RunConfig& config, int world);
std::int64_t accumulation_steps(const RunConfig& config, int world);

// The fully resolved config (every default written out) as YAML; loading it gives back `config`.
std::string resolved_yaml(const RunConfig& config);

const char* device_name(Device device);
const char* precision_name(Precision precision);

}  // namespace trainer
