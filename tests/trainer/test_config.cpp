// The trainer's run configuration (schema, defaults, overrides, errors with file:line and a
// suggestion, the resolved YAML round trip, the world-size check) and the learning-rate schedules.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/qwen3/family.h"
#include "trainer/config.h"
#include "trainer/schedule.h"

namespace {

namespace fs = std::filesystem;

// A temporary folder with the files a config may point at (empty: only their existence is checked).
class ConfigFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("llmtrain_test_config_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "checkpoints" / "step_00000100");
    fs::create_directories(dir_ / "hf_model");
    for (const char* name : {"train.bin", "val.bin", "tokenizer.json"}) std::ofstream(dir_ / name).put('\0');
  }
  void TearDown() override { fs::remove_all(dir_); }

  // `@` in the text stands for the temporary folder.
  std::string with_dir(const std::string& text) const {
    std::string out;
    for (const char ch : text) out += ch == '@' ? dir_.string() : std::string(1, ch);
    return out;
  }

  // Lines 1-8; cases append from line 9.
  std::string base() const {
    return with_dir(
        "run:\n"
        "  output_dir: @/out\n"
        "model:\n"
        "  preset: qwen3-tiny\n"
        "data:\n"
        "  train: @/train.bin\n"
        "training:\n"
        "  max_steps: 100\n");
  }

  trainer::RunConfig parse(const std::string& yaml, const std::vector<std::string>& overrides = {}) const {
    std::vector<std::string> resolved_overrides;
    for (const auto& o : overrides) resolved_overrides.push_back(with_dir(o));
    return trainer::parse_run_config(with_dir(yaml), "run.yaml", resolved_overrides);
  }

  std::string error_of(const std::string& yaml, const std::vector<std::string>& overrides = {}) const {
    try {
      parse(yaml, overrides);
    } catch (const core::InputError& e) {
      return e.what();
    }
    return "(no error)";
  }

  std::string write(const std::string& name, const std::string& text) const {
    const fs::path path = dir_ / name;
    std::ofstream(path) << with_dir(text);
    return path.string();
  }

  fs::path dir_;
};

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

TEST_F(ConfigFiles, MinimalConfigGetsTheDocumentedDefaults) {
  const trainer::RunConfig c = parse(base());
  EXPECT_EQ(c.run.name, "run");
  EXPECT_EQ(c.run.output_dir, dir_.string() + "/out");
  EXPECT_EQ(c.run.seed, 1234u);
  EXPECT_EQ(c.device, trainer::Device::cuda);
  EXPECT_EQ(c.model.arch, "qwen3");
  EXPECT_EQ(c.model.preset, "qwen3-tiny");
  EXPECT_EQ(models::qwen3::config_from_shape(c.model.shape), models::qwen3::preset("qwen3-tiny"));
  EXPECT_TRUE(c.model.init_from.empty());
  EXPECT_EQ(c.model.shape["recompute"], "none");
  EXPECT_EQ(c.data.val, "");
  EXPECT_EQ(c.data.seq_len, 1024);
  EXPECT_EQ(c.data.tokenizer, "byte");
  EXPECT_EQ(c.training.micro_batch_size, 1);
  EXPECT_FALSE(c.training.global_batch_size.has_value());
  EXPECT_EQ(c.training.max_steps, 100);
  EXPECT_EQ(c.training.precision, trainer::Precision::bf16);
  EXPECT_DOUBLE_EQ(c.training.grad_clip, 1.0);
  EXPECT_EQ(c.optimizer, optim::OptimizerConfig{});
  EXPECT_EQ(c.schedule, trainer::ScheduleConfig{});
  EXPECT_EQ(c.parallel.zero_stage, 1);
  EXPECT_EQ(c.parallel.timeout_s, 300);
  EXPECT_EQ(c.checkpoint.every, 1000);
  EXPECT_EQ(c.checkpoint.keep_last, 3);
  EXPECT_EQ(c.checkpoint.resume, "auto");
  EXPECT_EQ(c.eval.every, 0);  // no validation data
  EXPECT_EQ(c.eval.batches, 20);
  EXPECT_EQ(c.logging.every, 10);
  EXPECT_FALSE(c.logging.tensorboard);
  EXPECT_EQ(c.sample.every, 0);
  EXPECT_EQ(c.sample.tokens, 128);

  const trainer::RunConfig with_val = parse(base() + "device: cpu\n", {"data.val=@/val.bin"});
  EXPECT_EQ(with_val.eval.every, 200);
  EXPECT_EQ(with_val.training.precision, trainer::Precision::fp32);
}

TEST_F(ConfigFiles, ReadsEverySection) {
  const trainer::RunConfig c = parse(
      "run: {name: tiny, output_dir: @/out, seed: 7}\n"
      "device: cpu\n"
      "model:\n  arch: qwen3\n  preset: qwen3-test\n  init_from: @/hf_model\n  recompute: mlp\n"
      "  vocab_size: 512\n  num_layers: 2\n  rope_theta: 5e5\n  tie_word_embeddings: false\n"
      "data: {train: @/train.bin, val: @/val.bin, seq_len: 128, tokenizer: @/tokenizer.json}\n"
      "training: {micro_batch_size: 4, global_batch_size: 32, max_steps: 50, precision: fp32, grad_clip: 0.5}\n"
      "optimizer: {type: adamw8bit, lr: 1e-3, betas: [0.8, 0.99], quantization: linear}\n"
      "schedule: {type: wsd, warmup_steps: 5, min_lr_ratio: 0.0, decay_ratio: 0.3}\n"
      "parallel: {zero_stage: 2, timeout_s: 60, vocab_gradient: windows}\n"
      "checkpoint: {every: 10, keep_last: 0, resume: @/checkpoints/step_00000100}\n"
      "eval: {every: 25, batches: 4}\n"
      "logging: {every: 1, tensorboard: true}\n"
      "sample: {every: 20, tokens: 32, prompt: 'Hello'}\n");
  EXPECT_EQ(c.run.name, "tiny");
  EXPECT_EQ(c.run.seed, 7u);
  EXPECT_EQ(c.device, trainer::Device::cpu);
  EXPECT_EQ(c.model.preset, "qwen3-test");
  EXPECT_EQ(c.model.init_from, dir_.string() + "/hf_model");
  EXPECT_EQ(c.model.shape["recompute"], "mlp");
  models::qwen3::Qwen3Config shape = models::qwen3::preset("qwen3-test");
  shape.vocab_size = 512;
  shape.num_layers = 2;
  shape.rope_theta = 5e5;
  shape.tie_word_embeddings = false;
  EXPECT_EQ(models::qwen3::config_from_shape(c.model.shape), shape);
  EXPECT_EQ(c.data.seq_len, 128);
  EXPECT_EQ(c.data.tokenizer, dir_.string() + "/tokenizer.json");
  EXPECT_EQ(c.training.global_batch_size, 32);
  EXPECT_DOUBLE_EQ(c.training.grad_clip, 0.5);
  EXPECT_DOUBLE_EQ(c.optimizer.grad_clip, 0.5);  // copied from training
  EXPECT_EQ(c.optimizer.type, "adamw8bit");
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.8);
  EXPECT_EQ(c.optimizer.adamw8bit.quantization, optim::Quantization::linear);
  EXPECT_EQ(c.schedule.type, trainer::ScheduleType::wsd);
  EXPECT_DOUBLE_EQ(c.schedule.decay_ratio, 0.3);
  EXPECT_EQ(c.parallel.zero_stage, 2);
  EXPECT_EQ(c.parallel.timeout_s, 60);
  EXPECT_EQ(c.parallel.vocab_gradient, trainer::VocabGradient::windows);
  EXPECT_EQ(c.checkpoint.keep_last, 0);
  EXPECT_EQ(c.eval.every, 25);
  EXPECT_TRUE(c.logging.tensorboard);
  EXPECT_EQ(c.sample.prompt, "Hello");
}

TEST_F(ConfigFiles, OverridesAreAppliedBeforeValidation) {
  const trainer::RunConfig c = parse(base() + "optimizer:\n  lr: 1e-3\n",
                                     {"optimizer.betas=[0.9,0.99]", "training.max_steps=20", "training.max_steps=30",
                                      "schedule.type=linear", "device=cpu", "training.precision=fp32",
                                      "model.hidden_size=256", "sample.prompt=two words", "optimizer.lr=2e-3"});
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.99);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 2e-3);
  EXPECT_EQ(c.training.max_steps, 30);                        // the later override wins
  EXPECT_EQ(c.schedule.type, trainer::ScheduleType::linear);  // a section the file lacks
  EXPECT_EQ(c.device, trainer::Device::cpu);
  EXPECT_EQ(c.model.shape["hidden_size"], 256);
  EXPECT_EQ(c.sample.prompt, "two words");

  // An override is validated like the file: switching the device makes the file's precision wrong.
  EXPECT_NE(error_of(base() + "training:\n", {"device=cpu"}), "(no error)");
  EXPECT_EQ(error_of(replaced(base(), "  max_steps: 100\n", "  max_steps: 100\n  precision: bf16\n"), {"device=cpu"}),
            "run.yaml:9: training.precision: expected fp32 (device cpu), got bf16");
}

TEST_F(ConfigFiles, RejectsBadConfigsNamingFileLineKeyAndExpectation) {
  struct Case {
    std::string yaml;
    std::vector<std::string> overrides;
    std::string expected;
  };
  const std::string b = base();
  const Case cases[] = {
      // Unknown keys, with a suggestion.
      {b + "optimzer:\n  lr: 1e-3\n", {}, "run.yaml:9: optimzer: unknown key (did you mean 'optimizer'?)"},
      {b,
       {"trainng.max_steps=5"},
       "command line override 'trainng.max_steps=5': trainng: unknown key (did you mean 'training'?)"},
      {b + "schedule:\n  warmup_step: 10\n",
       {},
       "run.yaml:10: schedule.warmup_step: unknown key (did you mean 'warmup_steps'?)"},
      {b + "optimizer:\n  weight_decya: 0.1\n",
       {},
       "run.yaml:10: optimizer.weight_decya: unknown key (did you mean 'weight_decay'?)"},
      {b + "schedule:\n  lr: 1e-3\n", {}, "run.yaml:10: schedule.lr: unknown key (did you mean 'optimizer.lr'?)"},
      {b + "logging:\n  colour: true\n",
       {},
       "run.yaml:10: logging.colour: unknown key (known: every, tensorboard, timeline_step)"},
      {b + "eval:\n  decoder: fastest\n",
       {},
       "run.yaml:10: eval.decoder: expected auto, megakernel or plain, got 'fastest'"},
      {b + "sample:\n  decoder: mega\n",
       {},
       "run.yaml:10: sample.decoder: expected auto, megakernel or plain, got 'mega'"},
      {b + "eval:\n  tasks: [no_such_task.jsonl]\n",
       {},
       "run.yaml:10: eval.tasks: task file 'no_such_task.jsonl' does not exist"},
      {b + "eval:\n  tasks: data.jsonl\n", {}, "run.yaml:10: eval.tasks: expected a list of task files"},
      {b + "eval:\n  tasks_limit: -1\n", {}, "run.yaml:10: eval.tasks_limit: expected an integer >= 0, got -1"},
      {b + "optimizer:\n  grad_clip: 0.5\n",
       {},
       "run.yaml:10: optimizer.grad_clip: not set here: the clipping threshold is training.grad_clip"},
      {b,
       {"training.max_stepz=5"},
       "command line override 'training.max_stepz=5': training.max_stepz: unknown key (did you mean 'max_steps'?)"},
      {b + "training:\n  grad_clip: 1\n", {}, "run.yaml:9: training: duplicate key"},
      // Wrong types.
      {replaced(b, "max_steps: 100", "max_steps: many"),
       {},
       "run.yaml:8: training.max_steps: expected an integer, got 'many'"},
      {b + "data2: 1\n", {}, "run.yaml:9: data2: unknown key (did you mean 'data'?)"},
      {replaced(b, "train.bin\n", "train.bin\n  seq_len: [1, 2]\n"),
       {},
       "run.yaml:7: data.seq_len: expected an integer, got a list"},
      {b + "logging:\n  tensorboard: maybe\n",
       {},
       "run.yaml:10: logging.tensorboard: expected true or false, got 'maybe'"},
      {b + "eval: 5\n", {}, "run.yaml:9: eval: expected a mapping, got '5'"},
      {b + "schedule:\n  min_lr_ratio: low\n", {}, "run.yaml:10: schedule.min_lr_ratio: expected a number, got 'low'"},
      {b,
       {"training.max_steps=abc"},
       "command line override 'training.max_steps=abc': training.max_steps: expected an integer, got 'abc'"},
      {b,
       {"optimizer.lr=fast"},
       "command line override 'optimizer.lr=fast': optimizer.lr: expected a number, got 'fast'"},
      {b + "optimizer:\n  lr: 1e-3\n",
       {"optimizer.betas=[0.9,1.0]"},
       "command line override 'optimizer.betas=[0.9,1.0]': optimizer.betas[1]: expected a number in [0, 1)"},
      // Out of range.
      {replaced(b, "train.bin\n", "train.bin\n  seq_len: 0\n"),
       {},
       "run.yaml:7: data.seq_len: expected an integer in [1, 4096] (model max_position_embeddings), got 0"},
      {replaced(b, "train.bin\n", "train.bin\n  seq_len: 8192\n"),
       {},
       "data.seq_len: expected an integer in [1, 4096]"},
      {b + "",
       {"training.micro_batch_size=0"},
       "command line override 'training.micro_batch_size=0': training.micro_batch_size: expected an integer >= 1, got 0"},
      {b,
       {"training.global_batch_size=0"},
       "training.global_batch_size: expected auto or a number of sequences >= micro_batch_size (1), got 0"},
      {b + "parallel:\n  zero_stage: 4\n", {}, "run.yaml:10: parallel.zero_stage: expected one of [0, 1, 2, 3], got 4"},
      {b + "parallel:\n  vocab_gradient: rows\n",
       {},
       "parallel.vocab_gradient: expected one of [whole, windows], got 'rows'"},
      {b + "schedule:\n  warmup_steps: 101\n",
       {},
       "schedule.warmup_steps: expected an integer in [0, training.max_steps = 100], got 101"},
      {b + "schedule:\n  type: wsd\n  warmup_steps: 90\n",
       {},
       "schedule.decay_ratio: expected warmup_steps + decay steps <= training.max_steps (100), got 90 + 20"},
      // Step counts whose schedule arithmetic (warmup_steps + decay steps) would overflow.
      {b + "schedule:\n  type: wsd\n",
       {"training.max_steps=9223372036854775807", "schedule.warmup_steps=9223372036854775000"},
       "training.max_steps: expected an integer in [1, 1000000000000], got 9223372036854775807"},
      // Values the chosen schedule would never read.
      {b + "schedule:\n  type: cosine\n  decay_ratio: 0.3\n",
       {},
       "schedule.decay_ratio: only the wsd schedule has a decay phase (schedule.type is cosine)"},
      {b + "schedule:\n  type: constant\n  min_lr_ratio: 0.3\n",
       {},
       "schedule.min_lr_ratio: the constant schedule never decays (use linear, cosine or wsd)"},
      {b + "checkpoint:\n  allow_schedule_change: perhaps\n",
       {},
       "checkpoint.allow_schedule_change: expected true or false, got 'perhaps'"},
      {b + "schedule:\n  type: exponential\n",
       {},
       "run.yaml:10: schedule.type: expected one of [constant, linear, cosine, wsd], got 'exponential'"},
      {b + "device: tpu\n", {}, "run.yaml:9: device: expected one of [cuda, cpu], got 'tpu'"},
      {b + "device: cpu\n",
       {"training.precision=bf16"},
       "command line override 'training.precision=bf16': training.precision: expected fp32 (device cpu), got bf16"},
      {b, {"training.precision=fp32"}, "training.precision: expected bf16 (device cuda), got fp32"},
      {replaced(b, "qwen3-tiny", "qwen3-7b"),
       {},
       "run.yaml:4: model.preset: expected one of [qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-tiny, qwen3-test], got 'qwen3-7b'"},
      // A preset given as '' or as a bare YAML tag is a wrong name, not an absent key.
      {replaced(b, "qwen3-tiny", "\"\""), {}, "run.yaml:4: model.preset: expected one of [qwen3-0.6b"},
      {replaced(b, "qwen3-tiny", "!qwen3-tiny"), {}, "run.yaml:4: model.preset: expected one of [qwen3-0.6b"},
      {b, {"data.train=''"}, "data.train: expected a token shard path, got ''"},
      {b, {"model.arch=llama"}, "model.arch: expected one of [qwen3, e29a], got 'llama'"},
      {b, {"model.recompute=some"}, "model.recompute: expected one of [none, mlp, full], got 'some'"},
      {b, {"model.num_kv_heads=3"}, "model.num_kv_heads: expected a divisor of num_heads (4), got 3"},
      {b, {"model.hidden_size=-8"}, "model.hidden_size: expected an integer >= 1, got -8"},
      {b, {"model.vocab_size=100"}, "model.vocab_size: the byte tokenizer needs vocab_size >= 256, got 100"},
      {b + "eval:\n  every: 10\n", {}, "run.yaml:10: eval.every: eval.every > 0 needs data.val"},
      // Missing files.
      {replaced(b, "train.bin", "nope.bin"), {}, "run.yaml:6: data.train: training data '@/nope.bin' does not exist"},
      {b, {"data.val=@/missing_val.bin"}, "data.val: validation data '@/missing_val.bin' does not exist"},
      {b,
       {"data.tokenizer=@/missing.json"},
       "data.tokenizer: tokenizer (byte or a tokenizer.json path) '@/missing.json'"},
      {b, {"model.init_from=@/no_model"}, "model.init_from: model folder or checkpoint '@/no_model' does not exist"},
      // A path the system cannot look up (a name past 255 bytes) is refused like a missing one.
      {b,
       {"data.val=@/" + std::string(300, 'x') + ".bin"},
       "data.val: validation data '@/" + std::string(300, 'x') + ".bin' cannot be looked up: File name too long"},
      {b + "eval:\n  tasks: [" + std::string(300, 'y') + ".jsonl]\n",
       {},
       "eval.tasks: task file '" + std::string(300, 'y') + ".jsonl' cannot be looked up: File name too long"},
      {b + "checkpoint:\n  resume: @/checkpoints/step_00000200\n",
       {},
       "run.yaml:10: checkpoint.resume: checkpoint (resume: auto, never or a path) '@/checkpoints/step_00000200' does "
       "not exist"},
      // Missing keys and sections.
      {replaced(b, "  max_steps: 100\n", "  micro_batch_size: 2\n"),
       {},
       "run.yaml:8: training.max_steps: missing required key (expected the number of optimizer steps"},
      {replaced(b, "  preset: qwen3-tiny\n", "  arch: qwen3\n"), {}, "run.yaml:4: model.preset: missing required key"},
      {replaced(b, "model:\n  preset: qwen3-tiny\n", ""), {}, "run.yaml: model: missing required section"},
      {b,
       {"training.max_steps="},
       "command line override 'training.max_steps=': training.max_steps: missing required key"},
      // Malformed overrides and YAML.
      {b, {"training.max_steps"}, "command line override 'training.max_steps': expected SECTION.KEY=VALUE"},
      {b, {"training=5"}, "command line override 'training=5': training: expected training.KEY=VALUE"},
      {b,
       {"optimizer.betas=[0.9,"},
       "command line override 'optimizer.betas=[0.9,': optimizer.betas: the value is not valid YAML"},
      {b + "schedule: [\n", {}, "run.yaml:10:1: not valid YAML"},
      {"- 1\n- 2\n", {}, "run.yaml: expected a mapping with the sections run, device, model"},
  };
  for (const Case& c : cases) {
    const std::string message = error_of(c.yaml, c.overrides);
    EXPECT_NE(message.find(with_dir(c.expected)), std::string::npos)
        << "expected: " << with_dir(c.expected) << "\n     got: " << message;
  }
}

TEST_F(ConfigFiles, LoadsFromAFileAndReportsAMissingOne) {
  const std::string path = write("run.yaml", base());
  EXPECT_EQ(trainer::load_run_config(path, {}), parse(base()));
  try {
    trainer::load_run_config((dir_ / "absent.yaml").string(), {});
    FAIL() << "no error for a missing config file";
  } catch (const core::InputError& e) {
    EXPECT_EQ(std::string(e.what()), (dir_ / "absent.yaml").string() + ": cannot open the config file");
  }
  const std::string bad = write("bad.yaml", base() + "trainig:\n  max_steps: 1\n");
  try {
    trainer::load_run_config(bad, {});
    FAIL() << "no error for an unknown key";
  } catch (const core::InputError& e) {
    EXPECT_EQ(std::string(e.what()), bad + ":9: trainig: unknown key (did you mean 'training'?)");
  }
}

TEST_F(ConfigFiles, ResolvedYamlRoundTrips) {
  const std::vector<std::string> configs = {
      base(),
      base() +
          "device: cpu\noptimizer: {type: adafactor, beta1: 0.9, eps1_mode: clamp, decay_scale: alpha}\n"
          "sample: {every: 5, prompt: \"  line one:\\n\\tline # two \"}\n",
      base() + "optimizer: {type: adafactor, relative_step: false}\nschedule: {type: wsd, decay_ratio: 0.1}\n",
      base() + "optimizer: {type: adamw8bit, lr: 6.1e-4, betas: [0.85, 0.975], min_8bit_size: 17}\n",
      base() + "device: cpu\noptimizer: {type: muon, muon: {lr: 0.02, ns_steps: 3, adjust_lr: match_rms_adamw}}\n",
  };
  for (const std::string& yaml : configs) {
    const trainer::RunConfig original =
        parse(yaml, {"data.val=@/val.bin", "training.global_batch_size=8", "model.rope_theta=123456.789"});
    const std::string resolved = trainer::resolved_yaml(original);
    const trainer::RunConfig again = trainer::parse_run_config(resolved, "resolved.yaml", {});
    EXPECT_EQ(again, original) << resolved;
    EXPECT_EQ(trainer::resolved_yaml(again), resolved);
  }
  const trainer::RunConfig on_cpu = parse(configs[3], {"device=cpu", "model.init_from=@/hf_model"});
  EXPECT_EQ(trainer::parse_run_config(trainer::resolved_yaml(on_cpu), "resolved.yaml", {}), on_cpu);
  // Every default is written out.
  const std::string resolved = trainer::resolved_yaml(parse(base()));
  for (const char* key : {"seed: 1234", "global_batch_size: auto", "zero_stage: 1", "timeout_s: 300", "resume: auto",
                          "tensorboard: false", "min_lr_ratio: 0.1", "betas: [0.9, 0.95]", "tokenizer: byte"}) {
    EXPECT_NE(resolved.find(key), std::string::npos) << key << "\n" << resolved;
  }
}

TEST_F(ConfigFiles, ValidateForWorldChecksTheGlobalBatch) {
  const trainer::RunConfig c = parse(base(), {"training.micro_batch_size=4", "training.global_batch_size=48"});
  EXPECT_NO_THROW(trainer::validate_for_world(c, 1));
  EXPECT_NO_THROW(trainer::validate_for_world(c, 4));
  EXPECT_EQ(trainer::global_batch_sequences(c, 4), 48);
  EXPECT_EQ(trainer::accumulation_steps(c, 4), 3);
  EXPECT_EQ(trainer::accumulation_steps(c, 1), 12);
  try {
    trainer::validate_for_world(c, 5);
    FAIL() << "48 sequences is not a multiple of 4 x 5";
  } catch (const core::InputError& e) {
    EXPECT_EQ(std::string(e.what()),
              "training.global_batch_size: expected a multiple of micro_batch_size x world size (4 x 5 = 20 "
              "sequences), got 48");
  }
  EXPECT_THROW(trainer::validate_for_world(c, 0), core::InputError);

  const trainer::RunConfig automatic = parse(base(), {"training.micro_batch_size=2"});
  EXPECT_NO_THROW(trainer::validate_for_world(automatic, 3));
  EXPECT_EQ(trainer::global_batch_sequences(automatic, 3), 6);
  EXPECT_EQ(trainer::accumulation_steps(automatic, 3), 1);
}

TEST(Schedule, WarmupThenConstant) {
  trainer::ScheduleConfig s;
  s.type = trainer::ScheduleType::constant;
  s.warmup_steps = 10;
  const double peak = 3e-4;
  EXPECT_EQ(trainer::lr_at(s, peak, 0, 100), 0.0);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 5, 100), peak * 0.5);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 9, 100), peak * 0.9);
  EXPECT_EQ(trainer::lr_at(s, peak, 10, 100), peak);
  EXPECT_EQ(trainer::lr_at(s, peak, 99, 100), peak);
  EXPECT_EQ(trainer::lr_at(s, peak, 150, 100), peak);
  s.warmup_steps = 0;
  EXPECT_EQ(trainer::lr_at(s, peak, 0, 100), peak);
}

TEST(Schedule, Linear) {
  trainer::ScheduleConfig s;
  s.type = trainer::ScheduleType::linear;
  s.warmup_steps = 10;
  s.min_lr_ratio = 0.1;
  const double peak = 2.0;
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 5, 110), 1.0);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 10, 110), 2.0);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 35, 110), peak * (0.1 + 0.9 * 0.75));
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 60, 110), peak * (0.1 + 0.9 * 0.5));
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 109, 110), peak * (0.1 + 0.9 * 0.01));
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 110, 110), peak * 0.1);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 500, 110), peak * 0.1);
}

TEST(Schedule, Cosine) {
  trainer::ScheduleConfig s;
  s.type = trainer::ScheduleType::cosine;
  s.warmup_steps = 10;
  s.min_lr_ratio = 0.1;
  const double peak = 1.0;
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 2, 110), 0.2);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 10, 110), 1.0);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 35, 110), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.25)));
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 60, 110), 0.55);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 85, 110), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.75)));
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 110, 110), 0.1);
  s.min_lr_ratio = 0.0;
  s.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, 4.0, 0, 100), 4.0);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, 4.0, 50, 100), 2.0);
  EXPECT_NEAR(trainer::lr_at(s, 4.0, 100, 100), 0.0, 1e-15);
}

TEST(Schedule, WarmupStableDecay) {
  trainer::ScheduleConfig s;
  s.type = trainer::ScheduleType::wsd;
  s.warmup_steps = 10;
  s.min_lr_ratio = 0.1;
  s.decay_ratio = 0.2;
  const double peak = 1.0;
  EXPECT_EQ(trainer::wsd_decay_steps(s, 100), 20);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 4, 100), 0.4);
  EXPECT_EQ(trainer::lr_at(s, peak, 10, 100), 1.0);
  EXPECT_EQ(trainer::lr_at(s, peak, 50, 100), 1.0);
  EXPECT_EQ(trainer::lr_at(s, peak, 79, 100), 1.0);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 80, 100), 1.0);  // the first decay step: progress 0
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 90, 100), 0.55);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 99, 100), 0.1 + 0.9 * 0.05);
  EXPECT_DOUBLE_EQ(trainer::lr_at(s, peak, 100, 100), 0.1);
  s.decay_ratio = 0.0;  // no decay phase: stable to the end
  EXPECT_EQ(trainer::lr_at(s, peak, 99, 100), 1.0);
  EXPECT_EQ(trainer::wsd_decay_steps(s, 100), 0);
  s.decay_ratio = 0.25;  // 0.25 * 30 = 7.5 rounds to 8
  EXPECT_EQ(trainer::wsd_decay_steps(s, 30), 8);
}

}  // namespace
