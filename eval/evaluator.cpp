#include "eval/evaluator.h"

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "core/buffer.h"
#include "core/error.h"
#include "models/generation.h"
#include "models/ops/cross_entropy.h"

namespace eval {

namespace {

using Ids = std::vector<std::int32_t>;

std::string where(const Task& task, std::int64_t line) { return task.path + ":" + std::to_string(line); }

}  // namespace

struct Evaluator::Prepared {
  Task task;
  std::vector<Ids> contexts;                    // multiple choice: per item
  std::vector<std::vector<Ids>> continuations;  // per item, per ending
  std::vector<Ids> prompts;                     // generative: per item
  std::vector<std::int64_t> new_tokens;         // per item
  std::int64_t capacity = 0;                    // generative: the longest prompt + new tokens
};

Evaluator::Evaluator(const models::ModelSpec& spec, text::Tokenizer& tokenizer, EvaluatorOptions options)
    : spec_(spec), tokenizer_(tokenizer), options_(std::move(options)) {
  if (options_.max_sequence <= 0) throw core::Error("Evaluator: max_sequence must be positive");
  if (options_.max_sequence_name.empty()) options_.max_sequence_name = "the evaluation's sequence limit";
}

Evaluator::~Evaluator() = default;

std::size_t Evaluator::task_count() const { return tasks_.size(); }

void Evaluator::add(Task task, std::int64_t limit) {
  if (limit < 0) throw core::InputError("the task limit must be >= 0, got " + std::to_string(limit));
  auto p = std::make_unique<Prepared>();
  const std::int64_t vocab = spec_.vocab_size();
  const std::int64_t positions = spec_.max_sequence_length();
  const std::int64_t longest = std::min(options_.max_sequence, positions);
  const std::string longest_name = options_.max_sequence <= positions
                                       ? options_.max_sequence_name + " (" + std::to_string(options_.max_sequence) + ")"
                                       : "the model's " + std::to_string(positions) + " positions";
  const auto encode = [&](const std::string& text, std::int64_t line) {
    Ids ids;
    for (const std::uint32_t id : tokenizer_.encode(text)) {
      if (static_cast<std::int64_t>(id) >= vocab) {
        throw core::InputError(where(task, line) + ": token id " + std::to_string(id) +
                               " of the tokenizer is outside the "
                               "model's vocabulary of " +
                               std::to_string(vocab));
      }
      ids.push_back(static_cast<std::int32_t>(id));
    }
    return ids;
  };
  const std::size_t count =
      limit > 0 ? std::min<std::size_t>(task.size(), static_cast<std::size_t>(limit)) : task.size();
  if (task.kind == TaskKind::multiple_choice) {
    task.choice_items.resize(count);
    for (const ChoiceItem& item : task.choice_items) {
      // lm-evaluation-harness: trailing whitespace of the context goes to the continuation.
      std::string context = item.context;
      std::string moved;
      while (!context.empty() && (context.back() == ' ' || context.back() == '\n' || context.back() == '\t')) {
        moved.insert(moved.begin(), context.back());
        context.pop_back();
      }
      if (context.empty()) throw core::InputError(where(task, item.line) + ": field 'ctx': only whitespace");
      Ids context_ids = encode(context, item.line);
      std::vector<Ids> rows;
      for (std::size_t e = 0; e < item.endings.size(); ++e) {
        const Ids whole = encode(context + moved + " " + item.endings[e], item.line);
        if (whole.size() <= context_ids.size()) {
          throw core::InputError(where(task, item.line) + ": field 'endings': ending " + std::to_string(e) +
                                 " encodes to no token after the context");
        }
        Ids continuation(whole.begin() + static_cast<std::ptrdiff_t>(context_ids.size()), whole.end());
        const auto inputs = static_cast<std::int64_t>(context_ids.size() + continuation.size()) - 1;
        if (inputs > longest) {
          throw core::InputError(where(task, item.line) + ": the context and ending " + std::to_string(e) + " need " +
                                 std::to_string(inputs) + " positions (" + std::to_string(inputs + 1) +
                                 " tokens), more than " + longest_name + " allows");
        }
        rows.push_back(std::move(continuation));
      }
      p->contexts.push_back(std::move(context_ids));
      p->continuations.push_back(std::move(rows));
    }
  } else {
    task.generative_items.resize(count);
    for (const GenerativeItem& item : task.generative_items) {
      Ids prompt = encode(item.prompt, item.line);
      std::int64_t new_tokens = 0;
      if (item.max_new_tokens) {
        new_tokens = *item.max_new_tokens;
      } else {
        // Enough for the longest answer after a space.
        for (const std::string& answer : item.answers) {
          new_tokens =
              std::max<std::int64_t>(new_tokens, static_cast<std::int64_t>(tokenizer_.encode(" " + answer).size()));
        }
      }
      const std::int64_t total = static_cast<std::int64_t>(prompt.size()) + new_tokens;
      if (total > longest) {
        throw core::InputError(where(task, item.line) + ": the prompt (" + std::to_string(prompt.size()) +
                               " tokens) and max_new_tokens (" + std::to_string(new_tokens) + ") take " +
                               std::to_string(total) + " tokens, more than " + longest_name + " allows");
      }
      p->capacity = std::max(p->capacity, total);
      p->prompts.push_back(std::move(prompt));
      p->new_tokens.push_back(new_tokens);
    }
  }
  p->task = std::move(task);
  tasks_.push_back(std::move(p));
}

std::vector<double> Evaluator::loglikelihoods(const ModelAccess& model, const Ids& context,
                                              const std::vector<Ids>& continuations) {
  if (context.empty()) throw core::InputError("loglikelihoods: the context is empty");
  if (model.spec == nullptr || model.slab == nullptr || model.context == nullptr || model.scorer == nullptr ||
      model.scorer_tokens <= 0) {
    throw core::Error("Evaluator: the model access is incomplete");
  }
  const core::DeviceContext& ctx = *model.context;
  const auto bytes = static_cast<std::size_t>(model.scorer_tokens) * sizeof(std::int32_t);
  if (ids_.bytes() < bytes || !(ids_.device() == ctx.device())) {
    ids_ = core::Buffer(ctx.device(), bytes);
    targets_ = core::Buffer(ctx.device(), bytes);
  }
  std::vector<double> out(continuations.size(), 0.0);
  std::size_t first = 0;
  while (first < continuations.size()) {
    // As many rows as the forward's budget takes, padded to the longest of them.
    std::size_t last = first;
    std::int64_t seq = 0;
    while (last < continuations.size()) {
      const auto row = static_cast<std::int64_t>(context.size() + continuations[last].size()) - 1;
      const std::int64_t widest = std::max(seq, row);
      if (last > first && widest * static_cast<std::int64_t>(last - first + 1) > model.scorer_tokens) break;
      seq = widest;
      ++last;
    }
    const auto batch = static_cast<std::int64_t>(last - first);
    if (batch * seq > model.scorer_tokens) {
      throw core::InputError("loglikelihoods: a continuation of " + std::to_string(seq + 1) +
                             " tokens exceeds the forward's " + std::to_string(model.scorer_tokens));
    }
    std::vector<std::int32_t> ids(static_cast<std::size_t>(batch * seq), 0);
    std::vector<std::int32_t> targets(ids.size(), models::ops::kIgnoreIndex);
    for (std::int64_t b = 0; b < batch; ++b) {
      Ids row = context;
      const Ids& continuation = continuations[first + static_cast<std::size_t>(b)];
      row.insert(row.end(), continuation.begin(), continuation.end());
      for (std::size_t t = 0; t + 1 < row.size(); ++t) {
        ids[static_cast<std::size_t>(b * seq) + t] = row[t];
        // Only the continuation's tokens count: the targets of positions context - 1 onwards.
        if (t + 1 >= context.size()) targets[static_cast<std::size_t>(b * seq) + t] = row[t + 1];
      }
    }
    core::copy_bytes(ids_.data(), ids.data(), ids.size() * sizeof(std::int32_t), ctx.stream());
    core::copy_bytes(targets_.data(), targets.data(), targets.size() * sizeof(std::int32_t), ctx.stream());
    model.scorer->forward_loss(ids_.as<std::int32_t>(), targets_.as<std::int32_t>(), batch, seq);
    const float* device_losses = model.scorer->token_losses();
    if (device_losses == nullptr) {
      throw core::InputError(model.spec->family() + " does not report per-token losses on this backend");
    }
    std::vector<float> losses(ids.size());
    core::copy_bytes(losses.data(), device_losses, losses.size() * sizeof(float), ctx.stream());
    ctx.synchronize();
    for (std::int64_t b = 0; b < batch; ++b) {
      double sum = 0.0;
      for (std::int64_t t = 0; t < seq; ++t) {
        const auto at = static_cast<std::size_t>(b * seq + t);
        if (targets[at] != models::ops::kIgnoreIndex) sum -= static_cast<double>(losses[at]);
      }
      out[first + static_cast<std::size_t>(b)] = sum;
    }
    first = last;
  }
  return out;
}

void Evaluator::ensure_decoder(const ModelAccess& model, std::int64_t capacity) {
  const void* weights = model.whole_mirror != nullptr ? model.whole_mirror : model.full_weights;
  if (decoder_ && decoder_slab_ == model.slab && decoder_weights_ == weights && decoder_->capacity() >= capacity)
    return;
  decoder_.reset();
  decoder_slab_ = model.slab;
  decoder_weights_ = weights;
  std::string note;
  decoder_ = models::choose_decoder(
      spec_, *model.slab, *model.context,
      {.max_tokens = capacity, .full_weights = model.full_weights, .whole_mirror = model.whole_mirror},
      options_.decoder, &note);
  if (!decoder_) {
    throw core::InputError(spec_.family() + " has no decoder on " + (model.context->is_cuda() ? "cuda" : "cpu") +
                           " for the generative tasks");
  }
  const std::string kind = decoder_->kind();
  if (options_.decoder != DecoderChoice::plain && kind != "megakernel") {
    const std::string message = "evaluation decodes with the " + note;
    if (options_.decoder == DecoderChoice::megakernel) {
      spdlog::warn("{} (eval decoder 'megakernel' asked for it)", message);
    } else if (decoder_kind_.empty()) {
      spdlog::info("{}", message);
    }
  }
  decoder_kind_ = kind;
}

TaskResult Evaluator::run_task(const ModelAccess& model, const Prepared& p, int rank, int world,
                               const SumOverRanks& sum) {
  const core::DeviceContext& ctx = *model.context;
  const Task& task = p.task;
  const auto start = std::chrono::steady_clock::now();
  TaskResult result;
  result.name = task.name;
  result.path = task.path;
  result.kind = task.kind;
  result.items = static_cast<std::int64_t>(task.size());
  // Two metrics per item; this rank fills its items' entries, the sum over ranks fills the rest.
  std::vector<double> values(2 * task.size(), 0.0);
  if (task.kind == TaskKind::generative) {
    ensure_decoder(model, p.capacity);
    result.decoder = decoder_kind_;
  }
  for (std::size_t i = static_cast<std::size_t>(rank); i < task.size(); i += static_cast<std::size_t>(world)) {
    ItemResult item;
    item.index = static_cast<std::int64_t>(i);
    if (task.kind == TaskKind::multiple_choice) {
      const ChoiceItem& c = task.choice_items[i];
      item.line = c.line;
      item.loglik = loglikelihoods(model, p.contexts[i], p.continuations[i]);
      item.choice = score_choices(item.loglik, c.endings, c.label);
      values[2 * i] = item.choice.acc;
      values[2 * i + 1] = item.choice.acc_norm;
    } else {
      const GenerativeItem& g = task.generative_items[i];
      item.line = g.line;
      models::GenerationOptions options;
      options.max_new_tokens = p.new_tokens[i];
      const models::GenerationResult generated =
          models::generate(*decoder_, ctx, spec_.vocab_size(), p.prompts[i], options);
      std::vector<std::int32_t> ids = generated.ids;
      const auto end = std::find_if(ids.begin(), ids.end(), [&](std::int32_t id) {
        return std::find(options_.end_ids.begin(), options_.end_ids.end(), id) != options_.end_ids.end();
      });
      ids.erase(end, ids.end());
      item.generated = tokenizer_.display_text(ids);
      item.prediction = cut_at_stop(item.generated, g.stop);
      item.generation = score_generation(item.prediction, g.answers);
      values[2 * i] = item.generation.exact_match;
      values[2 * i + 1] = item.generation.prefix_share;
    }
    result.mine.push_back(std::move(item));
  }
  const std::vector<double> all = sum(std::move(values));
  double first = 0, second = 0;
  for (std::size_t i = 0; i < task.size(); ++i) {
    first += all[2 * i];
    second += all[2 * i + 1];
  }
  const double n = static_cast<double>(task.size());
  if (task.kind == TaskKind::multiple_choice) {
    result.metrics = {{"acc", first / n}, {"acc_norm", second / n}};
  } else {
    result.metrics = {{"exact_match", first / n}, {"prefix_share", second / n}};
  }
  ctx.synchronize();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

std::vector<TaskResult> Evaluator::run(const ModelAccess& model, int rank, int world, const SumOverRanks& sum) {
  if (world < 1 || rank < 0 || rank >= world) throw core::Error("Evaluator::run: bad rank or world");
  if (model.context == nullptr) throw core::Error("Evaluator: the model access is incomplete");
  std::vector<TaskResult> results;
  for (const auto& p : tasks_) results.push_back(run_task(model, *p, rank, world, sum));
  return results;
}

}  // namespace eval
