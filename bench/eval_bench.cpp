// Downstream evaluation speed on one GPU, Qwen3-0.6B shape (random bf16 weights): what the
// trainer's eval.tasks costs, through the same eval::Evaluator and the same kind of model access.
//
// Task sets, synthesised text read with the byte tokenizer (one token per character, so the
// token counts are exact whatever the weights):
//   generative: --gen-items prompts of --prompt-tokens tokens, --new-tokens greedy tokens each
//     (max_new_tokens, no end id: every item makes all of them), once with the decode megakernel
//     and once with the plain decoder (eval.decoder megakernel / plain);
//   multiple choice: --choice-items items of --choices endings; context --context-tokens, each
//     continuation (" " + ending) --ending-tokens tokens, all endings of an item in one forward.
// The scorer is the trainable model sized as the trainer's (--scorer-tokens, configs/qwen3-0.6b.yaml:
// micro_batch_size 8 x seq_len 2048). Each set runs once untimed (it builds the decoder, as the
// first evaluation of a run does; its seconds are reported as first_seconds), then --repeats
// times; the figure is the median wall-clock seconds of Evaluator::run, which synchronises the
// device before it returns.
// Share of a training run evaluating every --every steps of --step-ms each, in percent:
//   100 * eval_seconds / (every * step_seconds + eval_seconds), and each task set's part of it.
// Prints one JSON object to stdout (bench/eval_record.sh adds device, date and commit to
// bench/results/eval.jsonl). Exit status 1 without a CUDA device.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include "core/buffer.h"
#include "core/error.h"
#include "core/log.h"
#include "eval/evaluator.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "bench/random_weights.h"
#include "text/tokenizer.h"

namespace {

using bench::median;
using bench::random_weights;

// `n` characters of lower-case words, starting and ending with a letter (the evaluator moves a
// context's trailing whitespace into the continuation, which would change the token counts).
std::string words(std::int64_t n, std::uint64_t& state) {
  std::string s;
  while (static_cast<std::int64_t>(s.size()) < n) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const auto r = static_cast<unsigned>(state >> 33);
    const bool space = !s.empty() && s.back() != ' ' && static_cast<std::int64_t>(s.size()) + 1 < n && r % 6 == 0;
    s.push_back(space ? ' ' : static_cast<char>('a' + (r >> 3) % 26));
  }
  return s;
}

eval::Task generative_task(std::int64_t items, std::int64_t prompt_tokens, std::int64_t new_tokens) {
  eval::Task task;
  task.path = "synthetic";
  task.name = "generative";
  task.kind = eval::TaskKind::generative;
  std::uint64_t state = 1;
  for (std::int64_t i = 0; i < items; ++i) {
    eval::GenerativeItem item;
    item.line = i + 1;
    item.prompt = words(prompt_tokens, state);
    item.answers = {"answer"};
    item.max_new_tokens = new_tokens;
    task.generative_items.push_back(std::move(item));
  }
  return task;
}

eval::Task choice_task(std::int64_t items, int choices, std::int64_t context_tokens, std::int64_t ending_tokens) {
  eval::Task task;
  task.path = "synthetic";
  task.name = "multiple_choice";
  task.kind = eval::TaskKind::multiple_choice;
  std::uint64_t state = 2;
  for (std::int64_t i = 0; i < items; ++i) {
    eval::ChoiceItem item;
    item.line = i + 1;
    item.context = words(context_tokens, state);
    // The continuation is " " + ending: one token of the ending's budget is that space.
    for (int e = 0; e < choices; ++e) item.endings.push_back(words(ending_tokens - 1, state));
    task.choice_items.push_back(std::move(item));
  }
  return task;
}

struct Timing {
  double seconds = 0;        // median of the timed runs
  double first_seconds = 0;  // the untimed first run (decoder construction included)
  std::vector<double> runs;
  std::string decoder;
};

Timing time_task(const models::ModelSpec& spec, text::Tokenizer& tokenizer, const eval::ModelAccess& access,
                 eval::Task task, eval::DecoderChoice decoder, std::int64_t max_sequence, int repeats) {
  eval::EvaluatorOptions options;
  options.max_sequence = max_sequence;
  options.max_sequence_name = "--seq";
  options.decoder = decoder;
  eval::Evaluator evaluator(spec, tokenizer, options);
  evaluator.add(std::move(task));
  const auto one_rank = [](std::vector<double> values) { return values; };
  Timing t;
  for (int r = 0; r <= repeats; ++r) {
    access.context->synchronize();
    const auto start = std::chrono::steady_clock::now();
    const std::vector<eval::TaskResult> results = evaluator.run(access, 0, 1, one_rank);
    access.context->synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (r == 0) {
      t.first_seconds = s;
    } else {
      t.runs.push_back(s);
    }
    t.decoder = results.at(0).decoder;
  }
  t.seconds = median(t.runs);
  return t;
}

nlohmann::ordered_json timing_json(const Timing& t) {
  nlohmann::ordered_json j;
  j["seconds"] = t.seconds;
  j["first_seconds"] = t.first_seconds;
  j["runs"] = t.runs;
  if (!t.decoder.empty()) j["decoder"] = t.decoder;
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Downstream evaluation speed (eval::Evaluator) on one GPU"};
  std::string preset = "qwen3-0.6b";
  std::int64_t gen_items = 200, prompt_tokens = 64, new_tokens = 32;
  std::int64_t choice_items = 200, context_tokens = 60, ending_tokens = 40;
  int choices = 4, repeats = 3;
  std::int64_t seq = 2048, scorer_tokens = 8 * 2048, every = 500;
  // configs/qwen3-0.6b.yaml on one H100: 256 x 2048 tokens a step, 32 micro-batches of 8 x 2048 at
  // 189.2 ms each (bench/results/qwen3.jsonl, qwen3_train_bench, commit 5e54486); that bench's
  // step includes AdamW, which a step of 32 micro-batches runs once, so this is slightly high.
  double step_ms = 32 * 189.2;
  app.add_option("--preset", preset);
  app.add_option("--gen-items", gen_items);
  app.add_option("--prompt-tokens", prompt_tokens);
  app.add_option("--new-tokens", new_tokens);
  app.add_option("--choice-items", choice_items);
  app.add_option("--choices", choices);
  app.add_option("--context-tokens", context_tokens);
  app.add_option("--ending-tokens", ending_tokens, "per continuation, its leading space included");
  app.add_option("--repeats", repeats, "timed runs of each task set (median reported)");
  app.add_option("--seq", seq, "the longest item (the trainer's data.seq_len)");
  app.add_option("--scorer-tokens", scorer_tokens, "tokens of the scoring model's forward (micro batch x seq)");
  app.add_option("--step-ms", step_ms, "one optimizer step of the training run, ms (default: see the source)");
  app.add_option("--every", every, "training steps between evaluations");
  CLI11_PARSE(app, argc, argv);
  try {
    if (core::cuda_device_count() == 0) {
      std::fprintf(stderr, "eval_bench: no CUDA device is available (this benchmark needs a GPU)\n");
      return 1;
    }
    if (gen_items < 1 || choice_items < 1 || choices < 2 || prompt_tokens < 1 || new_tokens < 1 || context_tokens < 1 ||
        ending_tokens < 2 || repeats < 1 || step_ms <= 0 || every < 1) {
      throw core::InputError(
          "item counts, token counts, --repeats, --step-ms and --every must be positive "
          "(--choices >= 2, --ending-tokens >= 2)");
    }
    core::init_logging(0);
    const core::DeviceContext ctx(core::Device::cuda(0));
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, ctx.device().index));

    // Through the model interface, as the trainer builds it.
    const models::Family& family = models::family("qwen3");
    const models::Shape shape = models::base_shape(family, preset);
    models::check_shape(family, shape, "eval_bench");
    const auto spec = family.spec(shape);
    optim::Slab slab(optim::SlabLayout(spec->parameters(), 1), ctx);
    const auto scorer = spec->trainable(slab, ctx, {.max_tokens = scorer_tokens});
    random_weights(slab, ctx);
    const eval::ModelAccess access{
        .spec = spec.get(), .slab = &slab, .context = &ctx, .scorer = scorer.get(), .scorer_tokens = scorer_tokens};
    text::ByteTokenizer tokenizer;

    const Timing mega = time_task(*spec, tokenizer, access, generative_task(gen_items, prompt_tokens, new_tokens),
                                  eval::DecoderChoice::megakernel, seq, repeats);
    std::fprintf(stderr, "generative, %s decoder: %.3f s (first run %.3f s)\n", mega.decoder.c_str(), mega.seconds,
                 mega.first_seconds);
    const Timing plain = time_task(*spec, tokenizer, access, generative_task(gen_items, prompt_tokens, new_tokens),
                                   eval::DecoderChoice::plain, seq, repeats);
    std::fprintf(stderr, "generative, %s decoder: %.3f s (first run %.3f s)\n", plain.decoder.c_str(), plain.seconds,
                 plain.first_seconds);
    const Timing choice =
        time_task(*spec, tokenizer, access, choice_task(choice_items, choices, context_tokens, ending_tokens),
                  eval::DecoderChoice::automatic, seq, repeats);
    std::fprintf(stderr, "multiple choice: %.3f s (first run %.3f s)\n", choice.seconds, choice.first_seconds);

    // Share of the run's time, in percent, of `part` seconds in an evaluation of `eval_seconds`.
    const double between = static_cast<double>(every) * step_ms * 1e-3;
    const auto share = [&](double part, double eval_seconds) { return 100.0 * part / (between + eval_seconds); };
    const double generated = static_cast<double>(gen_items * new_tokens);
    const double scored = static_cast<double>(choice_items * choices * ending_tokens);

    nlohmann::ordered_json report;
    report["bench"] = preset + " evaluation speed";
    report["device"] = prop.name;
    report["timing"] = "median of " + std::to_string(repeats) +
                       " runs of Evaluator::run after one untimed run, wall clock, device synchronised";
    report["tokenizer"] = "byte (one token per character)";
    report["generative"] = {{"items", gen_items}, {"prompt_tokens", prompt_tokens}, {"new_tokens", new_tokens}};
    report["generative_megakernel"] = timing_json(mega);
    report["generative_megakernel"]["new_tok_s"] = generated / mega.seconds;
    report["generative_plain"] = timing_json(plain);
    report["generative_plain"]["new_tok_s"] = generated / plain.seconds;
    report["multiple_choice"] = {{"items", choice_items},
                                 {"choices", choices},
                                 {"context_tokens", context_tokens},
                                 {"ending_tokens", ending_tokens},
                                 {"item_tokens", context_tokens + ending_tokens}};
    const nlohmann::ordered_json choice_timing = timing_json(choice);
    for (const auto& [k, v] : choice_timing.items()) report["multiple_choice"][k] = v;
    report["multiple_choice"]["scored_tok_s"] = scored / choice.seconds;
    report["scorer_tokens"] = scorer_tokens;
    report["step_ms"] = step_ms;
    report["every"] = every;
    // The run's evaluation: both task sets, generating with the decoder eval.decoder auto takes
    // on a Hopper GPU (the megakernel), and for comparison with the plain decoder.
    const double total = mega.seconds + choice.seconds, total_plain = plain.seconds + choice.seconds;
    report["eval_seconds"] = total;
    report["share_pct"] = share(total, total);
    report["share_generative_pct"] = share(mega.seconds, total);  // the two parts sum to share_pct
    report["share_multiple_choice_pct"] = share(choice.seconds, total);
    report["eval_seconds_plain"] = total_plain;
    report["share_plain_pct"] = share(total_plain, total_plain);
    std::printf("%s\n", report.dump(1).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "eval_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
