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
#include "trainer/resume_check.h"
#include "trainer/step_timeline.h"
#include "trainer/gradient_sync.h"
#include "trainer/memory_plan.h"
#include "trainer/model_runner.h"
#include "trainer/pretrained.h"
#include "text/sampler.h"
#include "trainer/stop_signals.h"
#include "trainer/task_evaluation.h"
#include "trainer/tensorboard.h"
#include "trainer/weight_gather.h"
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
      throw core::InputError(
          "run.output_dir: " + directory.string() + " is in use by another trainer" +
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
    if (!j.is_discarded())
      kept += line + "\n";  // a line cut by a crash is dropped too
    else
      dropped = true;
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
// `lockstep` (ZeRO-3, whose forward gathers weights collectively): every rank runs the same number
// of forwards, a rank short of batches evaluating its first one again without counting it.
double validation_loss(ModelRunner& runner, const text::TokenShard& val, std::int64_t batches, std::int64_t micro_batch,
                       std::int64_t seq, comm::Communicator& comm, bool lockstep) {
  const std::uint64_t windows =
      val.size() > static_cast<std::uint64_t>(seq) ? (val.size() - 1) / static_cast<std::uint64_t>(seq) : 0;
  if (windows == 0)
    throw core::InputError(val.path().string() + ": too few tokens for one sequence of " + std::to_string(seq));
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
  const std::int64_t rounds = (batches + comm.world() - 1) / comm.world();
  for (std::int64_t extra = counted; lockstep && counted > 0 && extra < rounds; ++extra) {
    (void)runner.eval_loss(b.ids.data(), b.targets.data(), micro_batch, seq);
  }
  if (lockstep && counted == 0) {
    throw core::InputError("eval.batches: " + std::to_string(batches) + " is fewer than the " +
                           std::to_string(comm.world()) + " ranks; ZeRO-3 needs at least one batch per rank");
  }
  const std::vector<double> sums =
      comm.all_reduce_host({total, static_cast<double>(counted)}, comm::ReduceOp::sum, "validation loss");
  return sums[0] / sums[1];
}

// A generated continuation of sample.prompt through the decoder sample.decoder picks (`note` gets
// which), reading `full_weights` (cpu) or `whole_mirror` (cuda) as models::DecoderOptions does, and the run's
// tokenizer: temperature 0.8, seeded, ids chosen on the backend; it ends at "<|endoftext|>" when the tokenizer has one.
// The continuation as text (special tokens left out; ids the tokenizer does not know as U+FFFD), or nothing when the
// family has no decoder on this backend or the prompt leaves no room.
std::optional<std::string> sample_text(const models::ModelSpec& spec, optim::Slab& slab,
                                       const core::DeviceContext& context, const float* full_weights,
                                       const void* whole_mirror, text::Tokenizer& tokenizer, const SampleConfig& sample,
                                       std::uint64_t seed, std::string& note) {
  const std::string& prompt = sample.prompt;
  const std::int64_t tokens = sample.tokens;
  std::vector<std::int32_t> ids;
  for (const std::uint32_t id : tokenizer.encode(prompt.empty() ? std::string("\n") : prompt)) {
    ids.push_back(static_cast<std::int32_t>(id));
  }
  const std::int64_t capacity =
      std::min<std::int64_t>(static_cast<std::int64_t>(ids.size()) + tokens, spec.max_sequence_length());
  if (ids.empty() || static_cast<std::int64_t>(ids.size()) >= capacity) return std::nullopt;
  const models::DecoderChoice choice = models::parse_decoder_choice(sample.decoder);
  auto decoder = models::choose_decoder(
      spec, slab, context, {.max_tokens = capacity, .full_weights = full_weights, .whole_mirror = whole_mirror}, choice,
      &note);
  if (!decoder) return std::nullopt;
  if (choice == models::DecoderChoice::megakernel && decoder->kind() != std::string("megakernel")) {
    spdlog::warn("sample.decoder megakernel: the sample decodes with the {}", note);
  }
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

// The loop's state and its named steps. Setup runs in the order the checks need: devices, the
// checkpoint and the data are verified before anything is written to the run directory.
class TrainLoop {
 public:
  TrainLoop(const RunConfig& requested, const TrainOptions& options)
      : options_(options),
        placement_(options.environment ? options.environment->placement() : comm::Placement{}),
        world_(placement_.world),
        rank_(placement_.rank),
        lead_(rank_ == 0),
        config_(resolved_config(requested, world_)),
        spec_(model_spec(config_)),
        cuda_(config_.device == Device::cuda),
        seq_(config_.data.seq_len),
        micro_(config_.training.micro_batch_size),
        accumulation_(accumulation_steps(config_, world_)),
        global_batch_(global_batch_sequences(config_, world_)),
        tokens_per_step_(global_batch_ * seq_) {}

  TrainSummary run() {
    open_devices();
    check_inputs();
    if (const std::optional<TrainSummary> done = nothing_to_train()) return *done;
    open_run_directory();
    build_state();
    open_outputs();
    const std::int64_t hang_step = test_hang_step(rank_);
    for (std::int64_t step = first_step_; step <= config_.training.max_steps; ++step) {
      const double lr = lr_at(config_.schedule, config_.optimizer.lr, step - 1, config_.training.max_steps);
      std::optional<StepTimeline> timeline;
      if (step == config_.logging.timeline_step) {
        timeline.emplace(*context_, *communicator_, runner_->model());
        timeline->begin();
      }
      forward_backward();
      if (step == hang_step) hang(rank_, step);
      optimizer_step(lr, timeline ? timeline->compute() : nullptr);
      if (timeline) write_timeline(step, timeline->finish());
      const bool stop = agree_loss_and_stop(step);
      if (step % config_.logging.every == 0 || step == config_.training.max_steps) log_step(step, lr);
      if (config_.eval.every > 0 && step % config_.eval.every == 0) evaluate(step);
      if (config_.eval.tasks_every > 0 && step % config_.eval.tasks_every == 0) evaluate_tasks(step);
      // ZeRO-3: every rank takes part in gathering the model rank 0 decodes from.
      if ((lead_ || weight_gather_) && config_.sample.every > 0 && step % config_.sample.every == 0) sample(step);
      if (stop || (step == config_.training.max_steps && config_.checkpoint.at_end) ||
          (config_.checkpoint.every > 0 && step % config_.checkpoint.every == 0)) {
        save();
      }
      if (stop && step < config_.training.max_steps) return stopped_early(step);
    }
    return finish();
  }

 private:
  static RunConfig resolved_config(const RunConfig& requested, int world) {
    validate_for_world(requested, world);
    // The shape of model.init_from (its config.json or manifest) before anything is written.
    return resolve_init_from(requested);
  }

  // The device context and the communicator of this rank.
  void open_devices() {
    check_zero_stage(config_, *spec_);
    const int gpus = cuda_ ? core::cuda_device_count() : 0;
    if (cuda_ && gpus == 0) {
      throw core::InputError("device: cuda was requested but no CUDA device is available (use device=cpu)");
    }
    if (cuda_ && placement_.local_world > gpus) {
      throw core::InputError("device: cuda: " + std::to_string(placement_.local_world) + " ranks on this node but " +
                             std::to_string(gpus) +
                             " visible GPUs; NCCL needs a GPU of its own for every rank, so "
                             "start at most " +
                             std::to_string(gpus) + " ranks per node");
    }
    context_.emplace(cuda_ ? core::Device::cuda(comm::device_for(placement_, gpus)) : core::Device::cpu());
    if (options_.environment) {
      const double timeout = static_cast<double>(config_.parallel.timeout_s);
      communicator_ =
          comm::make_communicator(*options_.environment, *context_,
                                  {.timeout_s = timeout, .first_step_timeout_s = std::max(4 * timeout, 600.0)});
    } else {
      communicator_ = std::make_unique<comm::SingleRankCommunicator>();
    }
  }

  // The slab layout, the checkpoint to resume from and the data, all verified before anything is
  // written: a refused run leaves its directory as it was.
  void check_inputs() {
    comm::Communicator& comm = *communicator_;
    layout_.emplace(spec_->parameters(), world_);
    for (const std::string& name : layout_->unsplit()) {
      if (comm.rank() == 0) {
        spdlog::warn(
            "{}: its parts start off the 64-element alignment at this shape; the optimizer treats it "
            "as one tensor",
            name);
      }
    }
    resume_from_ = select_checkpoint(config_, *layout_, &comm);
    // A write past the file size limit (RLIMIT_FSIZE) fails with EFBIG and is reported with its path,
    // like a full disk, instead of killing the process with SIGXFSZ.
    std::signal(SIGXFSZ, SIG_IGN);
    stop_signals_.emplace();
    train_shard_.emplace(config_.data.train);
    check_vocabulary(*train_shard_, spec_->vocab_size());
    if (!config_.data.val.empty()) {
      val_shard_.emplace(config_.data.val);
      check_vocabulary(*val_shard_, spec_->vocab_size());
      // The first evaluation would fail only after eval.every steps of training.
      if (val_shard_->size() <= static_cast<std::uint64_t>(seq_)) {
        throw core::InputError("data.val: " + config_.data.val + " holds " + std::to_string(val_shard_->size()) +
                               " tokens, fewer than one sequence of data.seq_len + 1 = " + std::to_string(seq_ + 1));
      }
    }
    if (!config_.data.tokenizer.empty() && config_.data.tokenizer != "byte") {
      const text::BpeTokenizer tokenizer(config_.data.tokenizer);
      if (tokenizer.vocab_size() > static_cast<std::uint64_t>(spec_->vocab_size())) {
        throw core::InputError("data.tokenizer: " + config_.data.tokenizer + " has " +
                               std::to_string(tokenizer.vocab_size()) + " ids but model.vocab_size is " +
                               std::to_string(spec_->vocab_size()) + " (expected at least the tokenizer's vocabulary)");
      }
    }
    // Task files are read and every item checked here, before the run directory is touched.
    tasks_.emplace(config_, *spec_);
    if (resume_from_) {
      const TrainingProgress& saved = resume_from_->progress;
      const bool changed = (saved.seq_len > 0 && saved.seq_len != seq_) ||
                           (saved.global_batch > 0 && saved.global_batch != global_batch_);
      if (changed && !config_.checkpoint.allow_data_change) {
        throw core::InputError(
            resume_from_->directory.string() + ": saved with data.seq_len " + std::to_string(saved.seq_len) + " and " +
            std::to_string(saved.global_batch) + " sequences per step, resumed with " + std::to_string(seq_) + " and " +
            std::to_string(global_batch_) +
            ": the data order would change (set checkpoint.allow_data_change: true to continue anyway)");
      }
      check_resume_config(*resume_from_, config_);
    }
  }

  // A checkpoint already at training.max_steps: the summary of a run with nothing left to do.
  std::optional<TrainSummary> nothing_to_train() const {
    if (!resume_from_ || resume_from_->progress.step < config_.training.max_steps) return std::nullopt;
    const TrainingProgress& saved = resume_from_->progress;
    spdlog::info("{}: the checkpoint is at step {}, training.max_steps is {}: nothing to train",
                 resume_from_->directory.string(), saved.step, config_.training.max_steps);
    TrainSummary done;
    done.steps = done.resumed_from = saved.step;
    done.final_loss = -1;
    return done;
  }

  // One trainer per run directory (a second one started on it is refused while this one lives);
  // the resolved config is written first.
  void open_run_directory() {
    fs::create_directories(config_.run.output_dir);
    run_lock_.emplace(lead_ ? fs::path(config_.run.output_dir) : fs::path());
    if (lead_) {
      std::ofstream resolved(fs::path(config_.run.output_dir) / "config.yaml");
      resolved << resolved_yaml(config_);
      if (!resolved) throw core::Error("cannot write " + (fs::path(config_.run.output_dir) / "config.yaml").string());
    }
  }

  // The slab, the model, the optimizer and the gradient collectives; the progress and the sampler
  // of a fresh run or of the checkpoint resumed from.
  void build_state() {
    comm::Communicator& comm = *communicator_;
    const core::DeviceContext& context = *context_;
    const int stage = config_.parallel.zero_stage;
    const bool sharded = stage >= 1 && world_ > 1;
    // ZeRO-2 keeps only the owned shard of the gradients when nothing accumulates across
    // micro-batches (accumulation must not communicate before the last one, so it needs them all).
    const bool shard_gradients = shards_gradients(config_, world_);
    if (cuda_ && stage == 2 && world_ > 1 && !shard_gradients) {
      spdlog::info(
          "ZeRO-2 with {} micro-batches per step keeps the whole gradient buffer: accumulation communicates "
          "only after the last micro-batch",
          accumulation_);
    }
    if (cuda_) {
      // A run that cannot fit is refused before it allocates, naming what to change.
      std::size_t free_bytes = 0, total_bytes = 0;
      CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      check_plan_fits(plan_memory(config_, *spec_, world_), static_cast<std::int64_t>(free_bytes),
                      context.device().index);
    }
    slab_.emplace(std::move(*layout_), context,
                  optim::SlabOptions{.rank = rank_, .zero_stage = stage, .shard_gradients = shard_gradients});
    if (!resume_from_) initialize_weights(config_, *slab_, context);
    const std::vector<optim::Range> weight_ranges = spec_->weight_ranges(slab_->layout());
    weight_sync_.emplace(comm, *slab_, context, weight_ranges);
    if (stage == 3) {
      std::int64_t largest = 0;
      for (const optim::Range& r : weight_ranges) largest = std::max(largest, r.size());
      weight_gather_.emplace(comm, *slab_, context, largest);
    }
    // The model reads its weights through ZeRO-3's gather, or ZeRO-1/2's chunked mirror gather on
    // cuda (the forward starts while later chunks arrive), or in place.
    runner_ = std::make_unique<ModelRunner>(*spec_, *slab_, context, micro_ * seq_, weight_sync_->full_weights(),
                                            weight_gather_ ? &*weight_gather_ : weight_sync_->source());
    optimizer_ = optim::make_optimizer(config_.optimizer, *slab_, context);
    if (sharded) {
      optimizer_->set_partials_reducer([&comm](const std::vector<optim::Partial>& partials) {
        comm.group_start();
        for (const optim::Partial& p : partials)
          comm.all_reduce(p.data, p.dtype, p.count, comm::ReduceOp::sum, "optimizer statistics");
        comm.group_end();
      });
    }
    gradient_sync_.emplace(comm, *slab_, context, shard_gradients ? runner_->largest_gradient_range() : 0,
                           held_gradient_elements(config_, slab_->layout(), world_));
    runner_->set_gradient_sink(&*gradient_sync_);
    tasks_->attach(*spec_, *slab_, context, *runner_);
    progress_.sampler_seed = config_.run.seed;
    if (resume_from_) progress_ = load_checkpoint(*resume_from_, *optimizer_, context);
    progress_.seq_len = seq_;
    progress_.global_batch = global_batch_;
    skipped_before_ = resume_from_ ? optimizer_->report().skipped_steps : 0;
    weight_sync_->gather();
    sampler_.emplace(train_shard_->size(), seq_, world_, rank_, progress_.sampler_seed);
    sampler_->restore(progress_.sampler);
    first_step_ = progress_.step + 1;
    // The logging window continues across a resume.
    interval_loss_ = progress_.window_loss;
    interval_steps_ = progress_.window_steps;
  }

  // TensorBoard, the run's banner and memory figures, metrics.jsonl.
  void open_outputs() {
    // TensorBoard event files under RUN/tb (rank 0); a resumed run's file starts at its first step.
    if (lead_ && config_.logging.tensorboard)
      tensorboard_.emplace(fs::path(config_.run.output_dir) / "tb", first_step_);
    const int stage = config_.parallel.zero_stage;
    spdlog::info(
        "{}: {} on {}, {:.1f}M parameters, {} tokens per step ({} x {} x {} accumulation x {} ranks), "
        "ZeRO-{}, {} steps",
        config_.run.name, config_.model.preset.empty() ? config_.model.arch : config_.model.preset,
        context_->device_name(), static_cast<double>(spec_->parameter_count()) / 1e6, tokens_per_step_, micro_, seq_,
        accumulation_, world_, stage, config_.training.max_steps);

    // What the slab and the optimizer hold on this rank (the terms of the ZeRO memory formula).
    std::size_t state_bytes = 0;
    for (const optim::StateBuffer& b : optimizer_->state_buffers()) state_bytes += b.buffer->bytes();
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const nlohmann::json memory = {
        {"weights_gib", static_cast<double>(slab_->mirror().bytes() + slab_->master().bytes()) / gib},
        {"grads_gib", static_cast<double>(slab_->grad().bytes() + gradient_sync_->staging_bytes()) / gib},
        {"weight_bytes", slab_->mirror().bytes() + slab_->master().bytes()},
        {"gather_bytes", weight_gather_ ? weight_gather_->buffer_bytes() : 0},
        {"whole_model_bytes", weight_gather_ ? weight_gather_->whole_bytes() : 0},
        {"state_gib", static_cast<double>(state_bytes) / gib}};
    spdlog::info(
        "memory per rank: weights {:.3f} GiB (mirror + master), gradients {:.3f} GiB (with staging), "
        "optimizer state {:.3f} GiB",
        memory["weights_gib"].get<double>(), memory["grads_gib"].get<double>(), memory["state_gib"].get<double>());
    if (weight_gather_) {
      spdlog::info("ZeRO-3: samples and task evaluation gather the whole model, {:.3f} GiB per rank while they run",
                   static_cast<double>(weight_gather_->whole_bytes()) / gib);
    }

    if (lead_) {
      // Records of steps after the one resumed from (logged before a crash) are dropped first, so
      // every step appears once.
      drop_records_after(fs::path(config_.run.output_dir) / "metrics.jsonl", progress_.step);
      metrics_.open(fs::path(config_.run.output_dir) / "metrics.jsonl", std::ios::app);
      if (!metrics_) throw core::Error("cannot write metrics.jsonl in " + config_.run.output_dir);
      metrics_ << nlohmann::json({{"memory_per_rank", memory}, {"world", world_}, {"zero_stage", stage}}).dump()
               << "\n";
    }
    summary_.steps = progress_.step;
    summary_.resumed_from = progress_.step;
    batch_.ids.resize(static_cast<std::size_t>(micro_ * seq_));
    batch_.targets.resize(batch_.ids.size());
    start_ = std::chrono::steady_clock::now();
    interval_start_ = start_;
    elapsed_before_ = progress_.elapsed_s;
  }

  // Every micro-batch of the step: forward and backward, gradients accumulated in the slab.
  void forward_backward() {
    for (std::int64_t a = 0; a < accumulation_; ++a) {
      for (std::int64_t s = 0; s < micro_; ++s) {
        train_shard_->read_window(sampler_->next(), {batch_.ids.data() + s * seq_, static_cast<std::size_t>(seq_)},
                                  {batch_.targets.data() + s * seq_, static_cast<std::size_t>(seq_)});
      }
      // Only the last micro-batch's backward communicates (ZeRO-2 overlaps it layer by layer).
      gradient_sync_->begin_micro_batch(a + 1 == accumulation_);
      runner_->micro_step(batch_.ids.data(), batch_.targets.data(), micro_, seq_,
                          1.0f / static_cast<float>(accumulation_));
    }
  }

  // The gradient collectives, the optimizer's update and the weight gather after it (phases of
  // `timer` when a timeline records this step).
  void optimizer_step(double lr, core::PhaseTimer* timer = nullptr) {
    {
      const core::PhaseScope phase(timer, "wait: gradient sync");
      gradient_sync_->finish();
    }
    {
      const core::PhaseScope phase(timer, "optimizer");
      optimizer_->step(lr);
    }
    if (weight_gather_) weight_gather_->weights_changed();  // ZeRO-3: no gathered copy outlives the update
    const core::PhaseScope phase(timer, "wait: weight sync");
    weight_sync_->gather();
  }

  // Each rank's timeline of the step (logging.timeline_step) beside the metrics.
  void write_timeline(std::int64_t step, nlohmann::json timeline) {
    timeline["rank"] = rank_;
    timeline["world"] = world_;
    timeline["step"] = step;
    timeline["zero_stage"] = config_.parallel.zero_stage;
    const fs::path path = fs::path(config_.run.output_dir) / ("timeline_rank" + std::to_string(rank_) + ".json");
    std::ofstream out(path);
    out << timeline.dump() << "\n";
    if (!out) throw core::Error("cannot write " + path.string());
    const auto& s = timeline["summary"];
    spdlog::info(
        "timeline of step {} in {}: step {:.1f} ms, compute {:.1f} ms, communication {:.1f} ms of which {:.1f} "
        "ms under compute",
        step, path.string(), timeline["step_ms"].get<double>(), s["compute_busy_ms"].get<double>(),
        s["comm_busy_ms"].get<double>(), s["comm_under_compute_ms"].get<double>());
  }

  // One small host all-reduce per step: the global mean loss and whether any rank must stop.
  // Advances the progress; returns whether to stop after this step.
  bool agree_loss_and_stop(std::int64_t step) {
    const auto losses = runner_->take_losses();
    double loss = 0;
    for (double l : losses) loss += l;
    loss /= static_cast<double>(losses.size());
    const bool stop_here = StopSignals::requested() || step == options_.stop_after_step;
    const std::vector<double> agreed =
        communicator_->all_reduce_host({loss, stop_here ? 1.0 : 0.0}, comm::ReduceOp::sum, "loss and stop flag");
    loss = agreed[0] / world_;
    if (step == first_step_) communicator_->mark_first_step_done();
    interval_loss_ += loss;
    ++interval_steps_;
    summary_.steps = step;
    summary_.tokens += tokens_per_step_;
    progress_.step = step;
    progress_.tokens_seen += tokens_per_step_;
    return agreed[1] > 0;
  }

  // The log line and metrics record of the interval ending at `step`.
  void log_step(std::int64_t step, double lr) {
    const optim::StepReport report = optimizer_->report();
    const double elapsed = seconds_since(interval_start_);
    const double tokens_per_s = static_cast<double>(interval_steps_ * tokens_per_step_) / elapsed;
    const double mean_loss = interval_loss_ / static_cast<double>(interval_steps_);
    summary_.final_loss = mean_loss;
    double memory_gib = 0;
    if (cuda_) {
      std::size_t free_bytes = 0, total_bytes = 0;
      CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
      memory_gib = static_cast<double>(total_bytes - free_bytes) / (1 << 30);
    }
    // MFU per GPU: every rank does 1/world of the step's tokens.
    const double mfu = cuda_ ? tokens_per_s / world_ * spec_->flops_per_token(seq_) / kPeakBf16Flops : 0.0;
    const double eta = seconds_since(start_) / static_cast<double>(step - first_step_ + 1) *
                       static_cast<double>(config_.training.max_steps - step);
    const std::string device_figures =
        cuda_ ? fmt::format(" | MFU {:.1f}% | {:.1f} GiB", 100 * mfu, memory_gib) : std::string();
    spdlog::info("step {}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.3f}{} | {:.0f} tok/s{} | ETA {}", step,
                 config_.training.max_steps, mean_loss, lr, report.grad_norm,
                 report.skipped_steps > 0 ? " (" + std::to_string(report.skipped_steps) + " skipped)" : std::string(),
                 tokens_per_s, device_figures, format_duration(eta));
    record({{"step", step},
            {"loss", mean_loss},
            {"lr", lr},
            {"grad_norm", report.grad_norm},
            {"tokens_per_s", tokens_per_s},
            {"tokens_per_s_per_rank", tokens_per_s / world_},
            {"world", world_},
            {"zero_stage", config_.parallel.zero_stage},
            {"mfu", mfu},
            {"memory_gib", memory_gib},
            {"skipped_steps", report.skipped_steps},
            {"elapsed_s", elapsed_s()}});
    if (runner_->saw_invalid_ids()) throw core::Error("token ids outside the vocabulary reached the model");
    interval_start_ = std::chrono::steady_clock::now();
    interval_loss_ = 0;
    interval_steps_ = 0;
  }

  // The validation loss, split across the ranks (nothing without validation data).
  void evaluate(std::int64_t step) {
    if (!val_shard_) return;
    const double val = validation_loss(*runner_, *val_shard_, config_.eval.batches, micro_, seq_, *communicator_,
                                       weight_gather_.has_value());
    summary_.final_val_loss = val;
    spdlog::info("step {}/{} | val_loss {:.4f}", step, config_.training.max_steps, val);
    record({{"step", step}, {"val_loss", val}});
  }

  // ZeRO-3: the whole model on every rank while `whole` lives (collective), for decoding and task
  // evaluation; the other stages read the weights in place (once every mirror chunk has arrived)
  // and leave it empty.
  void gather_whole_model(std::optional<WeightGather::WholeModel>& whole) {
    if (weight_gather_) {
      whole.emplace(*weight_gather_);
    } else {
      weight_sync_->wait_all();  // decoders read the whole mirror
    }
  }
  // What decoders read (models::DecoderOptions): the gathered model, or the weights in place.
  const float* decoder_full_weights(const std::optional<WeightGather::WholeModel>& whole) const {
    return whole ? whole->full_weights() : weight_sync_->full_weights();
  }
  static const void* decoder_whole_mirror(const std::optional<WeightGather::WholeModel>& whole) {
    return whole ? whole->whole_mirror() : nullptr;
  }

  // The downstream tasks (eval.tasks), all ranks together, items split over the ranks as at every
  // stage (under ZeRO-3 the scorer reads the gathered model, so uneven shares never communicate).
  void evaluate_tasks(std::int64_t step) {
    if (!tasks_->enabled()) return;
    std::optional<WeightGather::WholeModel> whole;
    gather_whole_model(whole);
    record(tasks_->run(step, *communicator_, decoder_full_weights(whole), decoder_whole_mirror(whole)));
  }

  // A generated sample, logged and recorded (rank 0).
  void sample(std::int64_t step) {
    std::optional<WeightGather::WholeModel> whole;
    gather_whole_model(whole);
    if (!lead_) return;
    std::string decoder;
    const auto continuation =
        sample_text(*spec_, *slab_, *context_, decoder_full_weights(whole), decoder_whole_mirror(whole),
                    sample_tokenizer(), config_.sample, config_.run.seed + step, decoder);
    if (continuation) {
      const std::string text = config_.sample.prompt + *continuation;
      if (sample_decoder_.empty()) spdlog::info("samples decode with the {}", decoder);
      sample_decoder_ = decoder;
      spdlog::info("sample at step {}: {}", step, text);
      record({{"step", step}, {"sample", text}});
    }
  }

  void save() {
    progress_.elapsed_s = elapsed_s();
    progress_.sampler = sampler_->cursor();
    progress_.window_loss = interval_loss_;
    progress_.window_steps = interval_steps_;
    const fs::path checkpoints = checkpoints_root(config_);
    save_checkpoint(checkpoints, config_, progress_, *optimizer_, *context_, &*communicator_);
    if (lead_) prune_checkpoints(checkpoints, config_.checkpoint.keep_last);
  }

  TrainSummary stopped_early(std::int64_t step) {
    if (StopSignals::requested()) {
      spdlog::info("signal {}: stopped after step {} with a checkpoint", StopSignals::signal_number(), step);
    } else {
      spdlog::info("stopped after step {} with a checkpoint (another rank was signalled)", step);
    }
    summary_.stopped_early = true;
    summary_.seconds = seconds_since(start_);
    return summary_;
  }

  // The last evaluation, the summary line and a final sample.
  TrainSummary finish() {
    if (config_.eval.every == 0 || config_.training.max_steps % config_.eval.every != 0)
      evaluate(config_.training.max_steps);
    if (config_.eval.tasks_every == 0 || config_.training.max_steps % config_.eval.tasks_every != 0) {
      evaluate_tasks(config_.training.max_steps);
    }
    summary_.seconds = seconds_since(start_);
    const std::int64_t taken = summary_.steps - summary_.resumed_from;
    const std::int64_t skipped = optimizer_->report().skipped_steps - skipped_before_;
    if (taken > 0 && skipped >= taken) {
      throw core::Error(
          "every one of the " + std::to_string(taken) +
          " steps of this run was skipped: the gradients were "
          "not finite (optimizer.nonfinite: skip_step); check the data, the learning rate and the weights");
    }
    spdlog::info("done: {} steps, {} tokens in {:.1f} s ({:.0f} tok/s), final loss {:.4f}{}", summary_.steps,
                 summary_.tokens, summary_.seconds, static_cast<double>(summary_.tokens) / summary_.seconds,
                 summary_.final_loss,
                 summary_.final_val_loss >= 0 ? fmt::format(", validation loss {:.4f}", summary_.final_val_loss) : "");
    std::optional<WeightGather::WholeModel> whole;
    gather_whole_model(whole);
    if (lead_) {
      std::string decoder;
      const auto text = sample_text(*spec_, *slab_, *context_, decoder_full_weights(whole), decoder_whole_mirror(whole),
                                    sample_tokenizer(), config_.sample, config_.run.seed, decoder);
      if (text) {
        if (sample_decoder_.empty()) spdlog::info("samples decode with the {}", decoder);
        std::printf("\n--- sample ---\n%s%s\n--------------\n", config_.sample.prompt.c_str(), text->c_str());
      }
    }
    communicator_->barrier("end of training");
    return summary_;
  }

  // One metrics.jsonl record, and its numbers as TensorBoard scalars at its step (rank 0).
  void record(const nlohmann::json& j) {
    if (!lead_) return;
    metrics_ << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    metrics_.flush();
    // A record lost to a full disk or a file size limit stops the run, as a checkpoint would.
    if (!metrics_) {
      throw core::Error("writing " + (fs::path(config_.run.output_dir) / "metrics.jsonl").string() + ": " +
                        std::strerror(errno));
    }
    if (!tensorboard_ || !j.contains("step")) return;
    const std::int64_t at = j["step"].get<std::int64_t>();
    for (const auto& [key, value] : j.items()) {
      if (key == "step" || key == "world" || key == "zero_stage" || !value.is_number()) continue;
      tensorboard_->add_scalar(key, at, value.get<double>());
    }
    if (j.contains("sample") && j["sample"].is_string())
      tensorboard_->add_text("sample", at, j["sample"].get<std::string>());
    tensorboard_->flush();
  }

  // The run's tokenizer for the samples, loaded at the first one.
  text::Tokenizer& sample_tokenizer() {
    if (!sample_tokenizer_) {
      sample_tokenizer_ = text::make_tokenizer(config_.data.tokenizer.empty() ? "byte" : config_.data.tokenizer);
    }
    return *sample_tokenizer_;
  }

  const TrainOptions options_;
  const comm::Placement placement_;
  const int world_, rank_;
  const bool lead_;  // writes logs, metrics and the resolved config
  const RunConfig config_;
  const std::unique_ptr<models::ModelSpec> spec_;
  const bool cuda_;
  const std::int64_t seq_, micro_, accumulation_, global_batch_, tokens_per_step_;

  // Members in the order setup creates them (and the reverse of their destruction).
  std::optional<core::DeviceContext> context_;
  std::unique_ptr<comm::Communicator> communicator_;
  std::optional<optim::SlabLayout> layout_;
  std::optional<VerifiedCheckpoint> resume_from_;
  std::optional<StopSignals> stop_signals_;
  std::optional<text::TokenShard> train_shard_, val_shard_;
  std::unique_ptr<text::Tokenizer> sample_tokenizer_;
  std::optional<RunLock> run_lock_;
  std::optional<optim::Slab> slab_;
  std::optional<WeightSync> weight_sync_;
  std::optional<WeightGather> weight_gather_;  // ZeRO-3
  std::optional<TaskEvaluation> tasks_;
  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::optional<GradientSync> gradient_sync_;
  TrainingProgress progress_;
  std::int64_t skipped_before_ = 0;
  std::optional<text::Sampler> sampler_;
  std::int64_t first_step_ = 1;
  double interval_loss_ = 0;  // the logging window's loss sum and step count
  std::int64_t interval_steps_ = 0;
  std::optional<TensorBoardWriter> tensorboard_;
  std::ofstream metrics_;
  TrainSummary summary_;
  std::string sample_decoder_;  // the decoder samples use (logged once)
  Batch batch_;
  std::chrono::steady_clock::time_point start_, interval_start_;
  double elapsed_before_ = 0;  // elapsed_s of the run before this process (a resume)
  // elapsed_s continues across a resume, as the step count does.
  double elapsed_s() const { return elapsed_before_ + seconds_since(start_); }
};

}  // namespace

TrainSummary train(const RunConfig& config, const TrainOptions& options) { return TrainLoop(config, options).run(); }

}  // namespace trainer
