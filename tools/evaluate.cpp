// evaluate PATH --tasks A.jsonl[,B.jsonl] [options]: downstream tasks (docs/evaluation.md) on a
// Hugging Face folder or a training checkpoint (a step directory, or a run directory meaning its
// newest complete step), through the same evaluator as the trainer's eval.tasks. Prints a table
// of each task's metrics and seconds; --output writes them with every item's log-likelihoods or
// generated text and the prediction. Exit status: 0, 2 for bad input (named), 1 otherwise.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/log.h"
#include "eval/evaluator.h"
#include "tools/model_source.h"

namespace {

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= list.size()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, comma - at);
    if (item.empty()) throw core::InputError("--tasks: an empty entry in '" + list + "'");
    out.push_back(item);
    at = comma + 1;
  }
  return out;
}

nlohmann::ordered_json task_json(const eval::TaskResult& r, const eval::Task& task) {
  nlohmann::ordered_json j;
  j["task"] = r.name;
  j["path"] = r.path;
  j["kind"] = eval::kind_name(r.kind);
  j["items"] = r.items;
  j["seconds"] = r.seconds;
  if (!r.decoder.empty()) j["decoder"] = r.decoder;
  for (const auto& [name, value] : r.metrics) j["metrics"][name] = value;
  nlohmann::ordered_json items = nlohmann::ordered_json::array();
  for (const eval::ItemResult& item : r.mine) {
    nlohmann::ordered_json e;
    e["line"] = item.line;
    if (r.kind == eval::TaskKind::multiple_choice) {
      e["loglik"] = item.loglik;
      e["label"] = task.choice_items[static_cast<std::size_t>(item.index)].label;
      e["prediction"] = item.choice.prediction;
      e["prediction_norm"] = item.choice.prediction_norm;
    } else {
      e["generated"] = item.generated;
      e["prediction"] = item.prediction;
      e["answers"] = task.generative_items[static_cast<std::size_t>(item.index)].answers;
      e["exact_match"] = item.generation.exact_match;
      e["prefix_share"] = item.generation.prefix_share;
    }
    items.push_back(std::move(e));
  }
  j["results"] = std::move(items);
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Evaluate a Hugging Face folder or a training checkpoint on downstream tasks (docs/evaluation.md)"};
  std::string path, task_list, device, decoder = "auto", output, tokenizer_spec;
  std::int64_t limit = 0, forward_tokens = 4096;
  app.add_option("path", path, "Hugging Face folder, checkpoint step directory or run directory")->required();
  app.add_option("--tasks", task_list, "task files (JSONL), comma-separated")->required();
  app.add_option("--limit", limit, "the first N items of each task (0: all)");
  app.add_option("--device", device, "cpu or cuda (default: cuda when a GPU is present)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--decoder", decoder, "generative tasks: auto, megakernel or plain (default auto)")
      ->check(CLI::IsMember({"auto", "megakernel", "plain"}));
  app.add_option("--output", output, "write the metrics and every item's result to this JSON file");
  app.add_option("--tokenizer", tokenizer_spec, "byte or a tokenizer.json, instead of the model's own");
  app.add_option("--forward-tokens", forward_tokens,
                 "tokens one scoring forward takes (batch x sequence; default 4096, sizes GPU memory)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    core::init_logging(0);
    if (limit < 0) throw core::InputError("--limit must be >= 0");
    if (forward_tokens < 1) throw core::InputError("--forward-tokens must be >= 1");
    // Tasks first: a bad file is reported before any weights are read.
    std::vector<eval::Task> tasks = eval::load_tasks(split_list(task_list));
    tools::ModelSource source = tools::load_model_source(path, device, tokenizer_spec);
    const models::ModelSpec& spec = *source.weights.spec;
    const std::int64_t positions = spec.max_sequence_length();
    eval::EvaluatorOptions options;
    options.max_sequence = std::min(forward_tokens, positions);
    options.max_sequence_name = forward_tokens < positions ? "--forward-tokens" : "the model's positions";
    options.decoder = eval::parse_decoder_choice(decoder);
    options.end_ids = source.eos_ids;
    eval::Evaluator evaluator(spec, *source.tokenizer, options);
    for (const eval::Task& task : tasks) evaluator.add(task, limit);
    const std::int64_t scorer_tokens = options.max_sequence;
    const auto scorer = spec.trainable(*source.slab, *source.context, {.max_tokens = scorer_tokens});
    const eval::ModelAccess access{.spec = &spec,
                                   .slab = source.slab.get(),
                                   .context = source.context.get(),
                                   .scorer = scorer.get(),
                                   .scorer_tokens = scorer_tokens};
    const std::vector<eval::TaskResult> results =
        evaluator.run(access, 0, 1, [](std::vector<double> values) { return values; });

    std::printf("%-28s %-16s %6s  %-13s %8s %9s\n", "task", "kind", "items", "metric", "value", "seconds");
    for (const eval::TaskResult& r : results) {
      for (std::size_t m = 0; m < r.metrics.size(); ++m) {
        if (m == 0) {
          std::printf("%-28s %-16s %6lld  %-13s %8.4f %9.2f\n", r.name.c_str(), eval::kind_name(r.kind),
                      static_cast<long long>(r.items), r.metrics[m].first.c_str(), r.metrics[m].second, r.seconds);
        } else {
          std::printf("%-28s %-16s %6s  %-13s %8.4f\n", "", "", "", r.metrics[m].first.c_str(), r.metrics[m].second);
        }
      }
    }
    std::fflush(stdout);
    if (!output.empty()) {
      nlohmann::ordered_json j;
      j["model"] = path;
      j["device"] = source.device;
      j["decoder"] = decoder;
      j["limit"] = limit;
      j["tasks"] = nlohmann::ordered_json::array();
      for (std::size_t t = 0; t < results.size(); ++t) j["tasks"].push_back(task_json(results[t], tasks[t]));
      std::ofstream out(output);
      if (!out) throw core::InputError("--output: cannot write " + output);
      out << j.dump(1) << "\n";
      if (!out) throw core::InputError("--output: writing " + output + " failed");
    }
    return 0;
  } catch (const core::InputError& e) {
    std::fprintf(stderr, "evaluate: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "evaluate: %s\n", e.what());
    return 1;
  }
}
