#include "trainer/train.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "comm/single_rank.h"
#include "core/error.h"
#include "core/half.h"
#include "models/generation.h"
#include "optim/initialize.h"
#include "optim/optimizer.h"
#include "trainer/checkpoint.h"
#include "trainer/gradient_sync.h"
#include "trainer/model_runner.h"
#include "trainer/pretrained.h"
#include "text/sampler.h"
#include "trainer/stop_signals.h"
#include "trainer/task_evaluation.h"
#include "trainer/tensorboard.h"
#include "text/token_shard.h"
#include "text/tokenizer.h"

namespace trainer {

namespace fs = std::filesystem;

namespace {

constexpr double kPeakBf16Flops = 989e12;  // H100/H200 dense bf16, the MFU denominator

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string format_duration(double s) {
  char buf[32];
  const int total = static_cast<int>(s);
  std::snprintf(buf, sizeof buf, "%d:%02d:%02d", total / 3600, total / 60 % 60, total % 60);
  return buf;
}

// Every token of `shard` must be a valid id of the model's vocabulary.
void check_vocabulary(const text::TokenShard& shard, std::int64_t vocab) {
  std::uint32_t largest = 0;
  for (std::uint64_t i = 0; i < shard.size(); ++i) largest = std::max(largest, shard[i]);
  if (shard.size() > 0 && largest >= static_cast<std::uint64_t>(vocab)) {
    throw core::InputError(shard.path().string() + ": token id " + std::to_string(largest) +
                           " is outside the model's vocabulary of " + std::to_string(vocab));
  }
}

// Fresh master weights of the owned shard: the parameters' seeded initialisation, computed where
// the shard lives (independent of the number of ranks), or the weights of model.init_from.
void initialize_weights(const RunConfig& config, optim::Slab& slab, const core::DeviceContext& context) {
  if (config.model.init_from.empty()) {
    optim::initialize_owned(slab, context, config.run.seed);
    return;
  }
  const PretrainedWeights source = load_pretrained(config.model.init_from);
  if (source.layout.total_elements() > slab.layout().total_elements()) {
    throw core::InputError(config.model.init_from + ": its weights do not match the configured model");
  }
  core::copy_bytes(slab.master().data(), source.master.data() + slab.owned().begin, slab.master().bytes(),
                   context.stream());
  context.synchronize();
  slab.write_mirror(context);
  context.synchronize();
}

// An exclusive lock on RUN/.lock (flock: released by the kernel when the process ends, however it
// ends), holding the owner's pid for the message. An empty path takes no lock (ranks other than 0).
class RunLock {
 public:
  explicit RunLock(const fs::path& directory) {
    if (directory.empty()) return;
    const fs::path path = directory / ".lock";
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw core::Error("cannot open " + path.string() + ": " + std::strerror(errno));
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      char owner[32] = {};
      const ssize_t n = ::pread(fd_, owner, sizeof owner - 1, 0);
      ::close(fd_);
      fd_ = -1;
      throw core::InputError("run.output_dir: " + directory.string() + " is in use by another trainer" +
                             (n > 0 ? " (pid " + std::string(owner, static_cast<std::size_t>(n)) + ")" : std::string()) +
                             "; use another output_dir or stop that run first");
    }
    const std::string pid = std::to_string(::getpid());
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) < 0) {
      throw core::Error("cannot write " + path.string() + ": " + std::strerror(errno));
    }
  }
  ~RunLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
};

// Rewrites `path` (a JSON-lines file) without the records whose "step" is beyond `step`.
void drop_records_after(const fs::path& path, std::int64_t step) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return;
  std::ifstream in(path);
  std::string kept, line;
  bool dropped = false;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
        j["step"].get<std::int64_t>() > step) {
      dropped = true;
      continue;
    }
    if (!j.is_discarded()) kept += line + "\n";  // a line cut by a crash is dropped too
    else dropped = true;
  }
  if (!dropped) return;
  const fs::path temp = path.string() + ".tmp";
  {
    std::ofstream out(temp, std::ios::trunc);
    out << kept;
    if (!out) throw core::Error("cannot write " + temp.string());
  }
  fs::rename(temp, path);
}

struct Batch {
  std::vector<std::int32_t> ids, targets;
};

// Validation: the first `batches` x micro-batch windows of the shard, in order (the same every time).
// With several ranks, rank r evaluates batches r, r + world, ... and the sums are all-reduced.
double validation_loss(ModelRunner& runner, const text::TokenShard& val, std::int64_t batches, std::int64_t micro_batch,
                       std::int64_t seq, comm::Communicator& comm) {
  const std::uint64_t windows = val.size() > static_cast<std::uint64_t>(seq) ? (val.size() - 1) / static_cast<std::uint64_t>(seq) : 0;
  if (windows == 0) throw core::InputError(val.path().string() + ": too few tokens for one sequence of " + std::to_string(seq));
  Batch b{std::vector<std::int32_t>(static_cast<std::size_t>(micro_batch * seq)), {}};
  b.targets.resize(b.ids.size());
  double total = 0;
  std::int64_t counted = 0;
  std::uint64_t next = 0;
  for (std::int64_t i = 0; i < batches; ++i) {
    if (i % comm.world() != comm.rank()) {
      next += static_cast<std::uint64_t>(micro_batch);
      continue;
    }
    for (std::int64_t s = 0; s < micro_batch; ++s) {
      const std::uint64_t start = (next++ % windows) * static_cast<std::uint64_t>(seq);
      val.read_window(start, {b.ids.data() + s * seq, static_cast<std::size_t>(seq)},
                      {b.targets.data() + s * seq, static_cast<std::size_t>(seq)});
    }
    total += runner.eval_loss(b.ids.data(), b.targets.data(), micro_batch, seq);
    ++counted;
  }
  const std::vector<double> sums =
      comm.all_reduce_host({total, static_cast<double>(counted)}, comm::ReduceOp::sum, "validation loss");
  return sums[0] / sums[1];
}

// A generated continuation of `prompt` through the model's decoder (KV cache) and the run's
// tokenizer: temperature 0.8, seeded, ids chosen on the backend; it ends at "<|endoftext|>" when
// the tokenizer has one. The continuation as text (special tokens left out; ids the tokenizer
// does not know as U+FFFD), or nothing when the family has no decoder on this backend
// or the prompt leaves no room.
std::optional<std::string> sample_text(const models::ModelSpec& spec, optim::Slab& slab,
                                       const core::DeviceContext& context, const float* full_weights,
                                       text::Tokenizer& tokenizer, const std::string& prompt, std::int64_t tokens,
                                       std::uint64_t seed) {
  std::vector<std::int32_t> ids;
  for (const std::uint32_t id : tokenizer.encode(prompt.empty() ? std::string("\n") : prompt)) {
    ids.push_back(static_cast<std::int32_t>(id));
  }
  const std::int64_t capacity = std::min<std::int64_t>(static_cast<std::int64_t>(ids.size()) + tokens, spec.max_sequence_length());
  if (ids.empty() || static_cast<std::int64_t>(ids.size()) >= capacity) return std::nullopt;
  auto decoder = spec.decoder(slab, context, {.max_tokens = capacity, .full_weights = full_weights});
  if (!decoder) return std::nullopt;
  models::GenerationOptions options;
  options.max_new_tokens = capacity - static_cast<std::int64_t>(ids.size());
  options.sampling.temperature = 0.8f;
  options.seed = seed;
  if (const auto* bpe = dynamic_cast<const text::BpeTokenizer*>(&tokenizer)) {
    if (const std::int64_t eos = bpe->added_token_id("<|endoftext|>"); eos >= 0) {
      options.stop_ids.push_back(static_cast<std::int32_t>(eos));
    }
  }
  const models::GenerationResult result = models::generate(*decoder, context, spec.vocab_size(), ids, options);
  return tokenizer.display_text(result.ids);
}

// Test hook for the collective timeout: LLMTRAIN_TEST_HANG=R:S makes rank R stop forever at step
// S before the gradient synchronisation, as a wedged process would; the watchdog of the other
// ranks must then end the job. The step at which this rank hangs, or -1.
std::int64_t test_hang_step(int rank) {
  const char* spec = std::getenv("LLMTRAIN_TEST_HANG");
  int hang_rank = -1;
  long long hang_step = -1;
  if (spec == nullptr || std::sscanf(spec, "%d:%lld", &hang_rank, &hang_step) != 2 || hang_rank != rank) return -1;
  return hang_step;
}

[[noreturn]] void hang(int rank, std::int64_t step) {
  spdlog::warn("LLMTRAIN_TEST_HANG: rank {} stops at step {}", rank, step);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace

TrainSummary train(const RunConfig& requested, const TrainOptions& options) {
  const comm::Placement placement = options.environment ? options.environment->placement() : comm::Placement{};
  const int world = placement.world, rank = placement.rank;
  const bool lead = rank == 0;  // writes logs, metrics and the resolved config
  validate_for_world(requested, world);
  // The shape of model.init_from (its config.json or manifest) before anything is written.
  const RunConfig config = resolve_init_from(requested);
  const std::unique_ptr<models::ModelSpec> spec = model_spec(config);
  const bool cuda = config.device == Device::cuda;
  const int gpus = cuda ? core::cuda_device_count() : 0;
  if (cuda && gpus == 0) {
    throw core::InputError("device: cuda was requested but no CUDA device is available (use device=cpu)");
  }
  if (cuda && placement.local_world > gpus) {
    throw core::InputError("device: cuda: " + std::to_string(placement.local_world) + " ranks on this node but " +
                           std::to_string(gpus) + " visible GPUs; NCCL needs a GPU of its own for every rank, so "
                           "start at most " + std::to_string(gpus) + " ranks per node");
  }
  const core::DeviceContext context(cuda ? core::Device::cuda(comm::device_for(placement, gpus)) : core::Device::cpu());
  std::unique_ptr<comm::Communicator> communicator;
  if (options.environment) {
    const double timeout = static_cast<double>(config.parallel.timeout_s);
    communicator = comm::make_communicator(*options.environment, context,
                                           {.timeout_s = timeout, .first_step_timeout_s = std::max(4 * timeout, 600.0)});
  } else {
    communicator = std::make_unique<comm::SingleRankCommunicator>();
  }
  comm::Communicator& comm = *communicator;
  // The checkpoint to resume from is verified before anything is written.
  optim::SlabLayout layout(spec->parameters(), world);
  for (const std::string& name : layout.unsplit()) {
    if (comm.rank() == 0) {
      spdlog::warn("{}: its parts start off the 64-element alignment at this shape; the optimizer treats it "
                      "as one tensor", name);
    }
  }
  const std::optional<VerifiedCheckpoint> resume_from = select_checkpoint(config, layout, &comm);
  // A write past the file size limit (RLIMIT_FSIZE) fails with EFBIG and is reported with its path,
  // like a full disk, instead of killing the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  const StopSignals stop_signals;
  const std::int64_t seq = config.data.seq_len, micro = config.training.micro_batch_size;
  const std::int64_t accumulation = accumulation_steps(config, world);

  // The data is checked before the run directory is touched: a refused run leaves it as it was.
  const text::TokenShard train_shard(config.data.train);
  check_vocabulary(train_shard, spec->vocab_size());
  std::optional<text::TokenShard> val_shard;
  if (!config.data.val.empty()) {
    val_shard.emplace(config.data.val);
    check_vocabulary(*val_shard, spec->vocab_size());
  }
  if (!config.data.tokenizer.empty() && config.data.tokenizer != "byte") {
    const text::BpeTokenizer tokenizer(config.data.tokenizer);
    if (tokenizer.vocab_size() > static_cast<std::uint64_t>(spec->vocab_size())) {
      throw core::InputError("data.tokenizer: " + config.data.tokenizer + " has " + std::to_string(tokenizer.vocab_size()) +
                             " ids but model.vocab_size is " + std::to_string(spec->vocab_size()) +
                             " (expected at least the tokenizer's vocabulary)");
    }
  }
  // Task files are read and every item checked here, before the run directory is touched.
  TaskEvaluation tasks(config, *spec);
  // The run's tokenizer for the samples, loaded at the first one.
  std::unique_ptr<text::Tokenizer> tokenizer_for_samples;
  const auto sample_tokenizer = [&]() -> text::Tokenizer& {
    if (!tokenizer_for_samples) {
      tokenizer_for_samples = text::make_tokenizer(config.data.tokenizer.empty() ? "byte" : config.data.tokenizer);
    }
    return *tokenizer_for_samples;
  };
  const std::int64_t global_batch = global_batch_sequences(config, world);
  if (resume_from) {
    const TrainingProgress& saved = resume_from->progress;
    const bool changed = (saved.seq_len > 0 && saved.seq_len != seq) || (saved.global_batch > 0 && saved.global_batch != global_batch);
    if (changed && !config.checkpoint.allow_data_change) {
      throw core::InputError(resume_from->directory.string() + ": saved with data.seq_len " + std::to_string(saved.seq_len) +
                             " and " + std::to_string(saved.global_batch) + " sequences per step, resumed with " +
                             std::to_string(seq) + " and " + std::to_string(global_batch) +
                             ": the data order would change (set checkpoint.allow_data_change: true to continue anyway)");
    }
    if (saved.step >= config.training.max_steps) {
      spdlog::info("{}: the checkpoint is at step {}, training.max_steps is {}: nothing to train",
                   resume_from->directory.string(), saved.step, config.training.max_steps);
      TrainSummary done;
      done.steps = done.resumed_from = saved.step;
      done.final_loss = -1;
      return done;
    }
  }
  fs::create_directories(config.run.output_dir);
  // One trainer per run directory: a second one started on it is refused while this one lives.
  const RunLock run_lock(lead ? fs::path(config.run.output_dir) : fs::path());
  if (lead) {
    std::ofstream resolved(fs::path(config.run.output_dir) / "config.yaml");
    resolved << resolved_yaml(config);
    if (!resolved) throw core::Error("cannot write " + (fs::path(config.run.output_dir) / "config.yaml").string());
  }

  const int stage = config.parallel.zero_stage;
  const bool sharded = stage >= 1 && world > 1;
  // ZeRO-2 keeps only the owned shard of the gradients when nothing accumulates across
  // micro-batches (accumulation must not communicate before the last one, so it needs them all).
  const bool shard_gradients = cuda && stage == 2 && world > 1 && accumulation == 1;
  if (cuda && stage == 2 && world > 1 && !shard_gradients) {
    spdlog::info("ZeRO-2 with {} micro-batches per step keeps the whole gradient buffer: accumulation communicates "
                 "only after the last micro-batch", accumulation);
  }
  optim::Slab slab(std::move(layout), context, {.rank = rank, .zero_stage = stage, .shard_gradients = shard_gradients});
  if (!resume_from) initialize_weights(config, slab, context);
  WeightSync weight_sync(comm, slab, context);
  auto runner = std::make_unique<ModelRunner>(*spec, slab, context, micro * seq, weight_sync.full_weights());
  auto optimizer = optim::make_optimizer(config.optimizer, slab, context);
  if (sharded) {
    optimizer->set_partials_reducer([&comm](const std::vector<optim::Partial>& partials) {
      comm.group_start();
      for (const optim::Partial& p : partials) comm.all_reduce(p.data, p.dtype, p.count, comm::ReduceOp::sum, "optimizer statistics");
      comm.group_end();
    });
  }
  GradientSync gradient_sync(comm, slab, context, shard_gradients ? runner->largest_gradient_range() : 0);
  runner->set_gradient_sink(&gradient_sync);
  tasks.attach(*spec, slab, context, *runner, weight_sync.full_weights());
  TrainingProgress progress;
  progress.sampler_seed = config.run.seed;
  if (resume_from) progress = load_checkpoint(*resume_from, *optimizer, context);
  progress.seq_len = seq;
  progress.global_batch = global_batch;
  const std::int64_t skipped_before = resume_from ? optimizer->report().skipped_steps : 0;
  weight_sync.gather();
  text::Sampler sampler(train_shard.size(), seq, world, rank, progress.sampler_seed);
  sampler.restore(progress.sampler);
  const std::int64_t first_step = progress.step + 1;
  const fs::path checkpoints = checkpoints_root(config);
  // The logging window continues across a resume.
  double interval_loss = progress.window_loss;
  std::int64_t interval_steps = progress.window_steps;
  auto save = [&] {
    progress.sampler = sampler.cursor();
    progress.window_loss = interval_loss;
    progress.window_steps = interval_steps;
    save_checkpoint(checkpoints, config, progress, *optimizer, context, &comm);
    if (lead) prune_checkpoints(checkpoints, config.checkpoint.keep_last);
  };
  // TensorBoard event files under RUN/tb (rank 0); a resumed run's file starts at its first step.
  std::optional<TensorBoardWriter> tensorboard;
  if (lead && config.logging.tensorboard) tensorboard.emplace(fs::path(config.run.output_dir) / "tb", first_step);

  const std::int64_t tokens_per_step = global_batch_sequences(config, world) * seq;
  const double flops_per_token = spec->flops_per_token(seq);
  spdlog::info("{}: {} on {}, {:.1f}M parameters, {} tokens per step ({} x {} x {} accumulation x {} ranks), "
               "ZeRO-{}, {} steps",
               config.run.name, config.model.preset.empty() ? config.model.arch : config.model.preset,
               context.device_name(), static_cast<double>(spec->parameter_count()) / 1e6,
               tokens_per_step, micro, seq, accumulation, world, stage, config.training.max_steps);

  // What the slab and the optimizer hold on this rank (the terms of the ZeRO memory formula).
  std::size_t state_bytes = 0;
  for (const optim::StateBuffer& b : optimizer->state_buffers()) state_bytes += b.buffer->bytes();
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const nlohmann::json memory = {{"weights_gib", static_cast<double>(slab.mirror().bytes() + slab.master().bytes()) / gib},
                                 {"grads_gib", static_cast<double>(slab.grad().bytes() + gradient_sync.staging_bytes()) / gib},
                                 {"state_gib", static_cast<double>(state_bytes) / gib}};
  spdlog::info("memory per rank: weights {:.3f} GiB (mirror + master), gradients {:.3f} GiB (with staging), "
               "optimizer state {:.3f} GiB",
               memory["weights_gib"].get<double>(), memory["grads_gib"].get<double>(), memory["state_gib"].get<double>());

  std::ofstream metrics;
  if (lead) {
    // Records of steps after the one resumed from (logged before a crash) are dropped first, so
    // every step appears once.
    drop_records_after(fs::path(config.run.output_dir) / "metrics.jsonl", progress.step);
    metrics.open(fs::path(config.run.output_dir) / "metrics.jsonl", std::ios::app);
    if (!metrics) throw core::Error("cannot write metrics.jsonl in " + config.run.output_dir);
  }
  if (lead) {
    metrics << nlohmann::json({{"memory_per_rank", memory}, {"world", world}, {"zero_stage", stage}}).dump() << "\n";
  }
  TrainSummary summary;
  summary.steps = progress.step;
  summary.resumed_from = progress.step;
  Batch batch{std::vector<std::int32_t>(static_cast<std::size_t>(micro * seq)), {}};
  batch.targets.resize(batch.ids.size());
  const auto start = std::chrono::steady_clock::now();
  auto interval_start = start;

  // One metrics.jsonl record, and its numbers as TensorBoard scalars at its step.
  auto record = [&](const nlohmann::json& j) {
    if (!lead) return;
    metrics << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    metrics.flush();
    if (!tensorboard || !j.contains("step")) return;
    const std::int64_t at = j["step"].get<std::int64_t>();
    for (const auto& [key, value] : j.items()) {
      if (key == "step" || key == "world" || key == "zero_stage" || !value.is_number()) continue;
      tensorboard->add_scalar(key, at, value.get<double>());
    }
    if (j.contains("sample") && j["sample"].is_string()) tensorboard->add_text("sample", at, j["sample"].get<std::string>());
    tensorboard->flush();
  };
  auto evaluate_tasks = [&](std::int64_t step) {
    if (!tasks.enabled()) return;
    const nlohmann::json results = tasks.run(step, comm);
    if (lead) record(results);
  };
  auto evaluate = [&](std::int64_t step) {
    if (!val_shard) return;
    const double val = validation_loss(*runner, *val_shard, config.eval.batches, micro, seq, comm);
    summary.final_val_loss = val;
    spdlog::info("step {}/{} | val_loss {:.4f}", step, config.training.max_steps, val);
    record({{"step", step}, {"val_loss", val}});
  };

  const std::int64_t hang_step = test_hang_step(rank);
  for (std::int64_t step = first_step; step <= config.training.max_steps; ++step) {
    const double lr = lr_at(config.schedule, config.optimizer.lr, step - 1, config.training.max_steps);
    for (std::int64_t a = 0; a < accumulation; ++a) {
      for (std::int64_t s = 0; s < micro; ++s) {
        train_shard.read_window(sampler.next(), {batch.ids.data() + s * seq, static_cast<std::size_t>(seq)},
                                {batch.targets.data() + s * seq, static_cast<std::size_t>(seq)});
      }
      // Only the last micro-batch's backward communicates (ZeRO-2 overlaps it layer by layer).
      gradient_sync.begin_micro_batch(a + 1 == accumulation);
      runner->micro_step(batch.ids.data(), batch.targets.data(), micro, seq, 1.0f / static_cast<float>(accumulation));
    }
    if (step == hang_step) hang(rank, step);
    gradient_sync.finish();
    optimizer->step(lr);
    weight_sync.gather();
    const auto losses = runner->take_losses();
    double loss = 0;
    for (double l : losses) loss += l;
    loss /= static_cast<double>(losses.size());
    // One small host all-reduce per step: the global mean loss and whether any rank must stop.
    const bool stop_here = StopSignals::requested() || step == options.stop_after_step;
    const std::vector<double> agreed =
        comm.all_reduce_host({loss, stop_here ? 1.0 : 0.0}, comm::ReduceOp::sum, "loss and stop flag");
    loss = agreed[0] / world;
    const bool stop = agreed[1] > 0;
    if (step == first_step) comm.mark_first_step_done();
    interval_loss += loss;
    ++interval_steps;
    summary.steps = step;
    summary.tokens += tokens_per_step;
    progress.step = step;
    progress.tokens_seen += tokens_per_step;

    if (step % config.logging.every == 0 || step == config.training.max_steps) {
      const optim::StepReport report = optimizer->report();
      const double elapsed = seconds_since(interval_start);
      const double tokens_per_s = static_cast<double>(interval_steps * tokens_per_step) / elapsed;
      const double mean_loss = interval_loss / static_cast<double>(interval_steps);
      summary.final_loss = mean_loss;
      double memory_gib = 0;
      if (cuda) {
        std::size_t free_bytes = 0, total_bytes = 0;
        CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
        memory_gib = static_cast<double>(total_bytes - free_bytes) / (1 << 30);
      }
      // MFU per GPU: every rank does 1/world of the step's tokens.
      const double mfu = cuda ? tokens_per_s / world * flops_per_token / kPeakBf16Flops : 0.0;
      const double eta = seconds_since(start) / static_cast<double>(step - first_step + 1) *
                         static_cast<double>(config.training.max_steps - step);
      const std::string device_figures =
          cuda ? fmt::format(" | MFU {:.1f}% | {:.1f} GiB", 100 * mfu, memory_gib) : std::string();
      spdlog::info("step {}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.3f}{} | {:.0f} tok/s{} | ETA {}", step,
                   config.training.max_steps, mean_loss, lr, report.grad_norm,
                   report.skipped_steps > 0 ? " (" + std::to_string(report.skipped_steps) + " skipped)" : std::string(),
                   tokens_per_s, device_figures, format_duration(eta));
      record({{"step", step}, {"loss", mean_loss}, {"lr", lr}, {"grad_norm", report.grad_norm},
              {"tokens_per_s", tokens_per_s}, {"tokens_per_s_per_rank", tokens_per_s / world}, {"world", world},
              {"zero_stage", stage}, {"mfu", mfu}, {"memory_gib", memory_gib},
              {"skipped_steps", report.skipped_steps}, {"elapsed_s", seconds_since(start)}});
      if (runner->saw_invalid_ids()) throw core::Error("token ids outside the vocabulary reached the model");
      interval_start = std::chrono::steady_clock::now();
      interval_loss = 0;
      interval_steps = 0;
    }
    if (config.eval.every > 0 && step % config.eval.every == 0) evaluate(step);
    if (config.eval.tasks_every > 0 && step % config.eval.tasks_every == 0) evaluate_tasks(step);
    if (lead && config.sample.every > 0 && step % config.sample.every == 0) {
      const auto continuation = sample_text(*spec, slab, context, weight_sync.full_weights(), sample_tokenizer(),
                                            config.sample.prompt, config.sample.tokens, config.run.seed + step);
      if (continuation) {
        const std::string text = config.sample.prompt + *continuation;
        spdlog::info("sample at step {}: {}", step, text);
        record({{"step", step}, {"sample", text}});
      }
    }
    if (stop || (step == config.training.max_steps && config.checkpoint.at_end) ||
        (config.checkpoint.every > 0 && step % config.checkpoint.every == 0)) {
      save();
    }
    if (stop && step < config.training.max_steps) {
      if (StopSignals::requested()) {
        spdlog::info("signal {}: stopped after step {} with a checkpoint", StopSignals::signal_number(), step);
      } else {
        spdlog::info("stopped after step {} with a checkpoint (another rank was signalled)", step);
      }
      summary.stopped_early = true;
      summary.seconds = seconds_since(start);
      return summary;
    }
  }
  if (config.eval.every == 0 || config.training.max_steps % config.eval.every != 0) evaluate(config.training.max_steps);
  if (config.eval.tasks_every == 0 || config.training.max_steps % config.eval.tasks_every != 0) {
    evaluate_tasks(config.training.max_steps);
  }
  summary.seconds = seconds_since(start);
  const std::int64_t taken = summary.steps - summary.resumed_from;
  const std::int64_t skipped = optimizer->report().skipped_steps - skipped_before;
  if (taken > 0 && skipped >= taken) {
    throw core::Error("every one of the " + std::to_string(taken) + " steps of this run was skipped: the gradients were "
                      "not finite (optimizer.nonfinite: skip_step); check the data, the learning rate and the weights");
  }
  spdlog::info("done: {} steps, {} tokens in {:.1f} s ({:.0f} tok/s), final loss {:.4f}{}", summary.steps, summary.tokens,
               summary.seconds, static_cast<double>(summary.tokens) / summary.seconds, summary.final_loss,
               summary.final_val_loss >= 0 ? fmt::format(", validation loss {:.4f}", summary.final_val_loss) : "");
  if (lead) {
    const auto text = sample_text(*spec, slab, context, weight_sync.full_weights(), sample_tokenizer(),
                                  config.sample.prompt, config.sample.tokens, config.run.seed);
    if (text) std::printf("\n--- sample ---\n%s%s\n--------------\n", config.sample.prompt.c_str(), text->c_str());
  }
  comm.barrier("end of training");
  return summary;
}

}  // namespace trainer
