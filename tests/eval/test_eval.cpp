// The evaluation library on the cpu: task files (good ones of each format; bad ones refused with
// file, line and field), the metrics (whitespace normalisation, prefix share, acc_norm's division by
// characters), per-choice log-likelihoods against a brute-force reference (teacher-forced logits of
// the family's decoder, log-softmax in double) for Qwen3 and E29a, batched or split, generative
// items equal to plain greedy generation, items split over ranks giving the same per-item results,
// the shipped tasks, and the transformers fixture (tests/fixtures/qwen3/*/choices.json, made by
// tests/fixtures/make_eval_fixture.py) when present.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "eval/evaluator.h"
#include "eval/metrics.h"
#include "eval/task.h"
#include "models/generation.h"
#include "text/tokenizer.h"
#include "tiny_model.h"
#include "trainer/pretrained.h"

namespace {

namespace fs = std::filesystem;

const std::string kTasks = std::string(LLMTRAIN_SOURCE_DIR) + "/data/tasks/";

std::string write_file(const std::string& name, const std::string& text) {
  const fs::path dir = fs::temp_directory_path() / ("llmtrain_eval_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path path = dir / name;
  std::ofstream(path, std::ios::binary) << text;
  return path.string();
}

// The message of the InputError that loading `text` as a task raises.
std::string load_error(const std::string& text) {
  const std::string path = write_file("bad.jsonl", text);
  try {
    eval::load_task(path);
  } catch (const core::InputError& e) {
    return e.what();
  }
  return "(no error)";
}

eval::SumOverRanks single() {
  return [](std::vector<double> v) { return v; };
}

eval::ModelAccess access(test::TinyModel& m) {
  return {.spec = m.spec.get(),
          .slab = m.slab.get(),
          .context = &m.context,
          .scorer = m.scorer.get(),
          .scorer_tokens = 4096};
}

TEST(EvalTask, ReadsEachFormat) {
  const std::string mc = write_file("mc.jsonl",
                                    "{\"ctx\": \"A man\", \"endings\": [\"runs.\", \"sits.\", \"x\"], \"label\": 1, "
                                    "\"ind\": 4}\n\n{\"ctx\": \"B\", \"endings\": [\"c\", \"d\"], \"label\": \"0\"}\n");
  const eval::Task t = eval::load_task(mc);
  EXPECT_EQ(t.name, "mc");
  EXPECT_EQ(t.kind, eval::TaskKind::multiple_choice);
  ASSERT_EQ(t.choice_items.size(), 2u);
  EXPECT_EQ(t.choice_items[0].label, 1);
  EXPECT_EQ(t.choice_items[1].label, 0);
  EXPECT_EQ(t.choice_items[1].line, 3);

  const std::string gen =
      write_file("gen.jsonl",
                 "{\"prompt\": \"2+2=\", \"answers\": [\"4\", \"four\"], \"max_new_tokens\": 3, "
                 "\"stop\": \"\\n\"}\n{\"prompt\": \"p\", \"answers\": [\"q\"], \"stop\": [\".\", \"!\"]}\n");
  const eval::Task g = eval::load_task(gen);
  EXPECT_EQ(g.kind, eval::TaskKind::generative);
  ASSERT_EQ(g.generative_items.size(), 2u);
  EXPECT_EQ(*g.generative_items[0].max_new_tokens, 3);
  EXPECT_EQ(g.generative_items[0].stop, std::vector<std::string>{"\n"});
  EXPECT_FALSE(g.generative_items[1].max_new_tokens.has_value());
  EXPECT_EQ(g.generative_items[1].stop.size(), 2u);

  const eval::Task l = eval::load_task(write_file("lambada.jsonl", "{\"text\": \"the cat sat on the  mat \"}\n"));
  ASSERT_EQ(l.generative_items.size(), 1u);
  EXPECT_EQ(l.generative_items[0].prompt, "the cat sat on the");
  EXPECT_EQ(l.generative_items[0].answers, std::vector<std::string>{"mat"});
}

TEST(EvalTask, BadFilesNameFileLineAndField) {
  const auto has = [](const std::string& message, const std::string& part) {
    EXPECT_NE(message.find(part), std::string::npos) << message << "\n  lacks: " << part;
  };
  std::string e =
      load_error("{\"ctx\": \"a\", \"endings\": [\"b\", \"c\"], \"label\": 0}\n{\"ctx\": \"a\", \"label\": 0}\n");
  has(e, "bad.jsonl:2");
  has(e, "field 'endings': missing");
  e = load_error("{\"ctx\": \"a\", \"endings\": [\"b\", \"c\"], \"label\": 2}\n");
  has(e, "bad.jsonl:1");
  has(e, "field 'label': 2 is outside [0, 1]");
  has(load_error("\n  \n"), "the task has no items");
  has(load_error(""), "the task has no items");
  has(load_error("{\"prompt\": \"a\", \"answers\": []}\n"), "field 'answers': expected at least 1");
  has(load_error("{\"prompt\": \"\", \"answers\": [\"b\"]}\n"), "field 'prompt': empty");
  has(load_error("{\"prompt\": \"a\", \"answers\": [\"b\"], \"max_new_tokens\": 0}\n"), "field 'max_new_tokens'");
  has(load_error(
          "{\"prompt\": \"a\", \"answers\": [\"b\"]}\n{\"ctx\": \"a\", \"endings\": [\"b\", \"c\"], \"label\": 0}\n"),
      "bad.jsonl:2: a multiple choice");
  has(load_error("{\"ctx\": \"a\", \"endings\": [\"b\", \"c\"], \"label\": 0}\n{oops\n"),
      "bad.jsonl:2: not valid JSON");
  has(load_error("{\"question\": \"a\"}\n"), "bad.jsonl:1: not a task item");
  has(load_error("{\"text\": \"alone\"}\n"), "field 'text': needs at least two words");
  try {
    eval::load_task("/nonexistent/task.jsonl");
    FAIL() << "no error";
  } catch (const core::InputError& ex) {
    has(ex.what(), "/nonexistent/task.jsonl");
  }
  const std::string a = write_file("same.jsonl", "{\"text\": \"a b\"}\n");
  EXPECT_THROW(eval::load_tasks({a, a}), core::InputError);
}

TEST(EvalMetrics, WhitespacePrefixAndStops) {
  EXPECT_EQ(eval::normalize_whitespace("  a\n b\t\tc  "), "a b c");
  EXPECT_EQ(eval::normalize_whitespace("\n\n"), "");
  EXPECT_EQ(eval::cut_at_stop("abc\n  4 def", {"\n  ", "xyz"}), "abc");
  EXPECT_EQ(eval::cut_at_stop("abc", {}), "abc");
  EXPECT_EQ(eval::character_count("h\xC3\xA9llo"), 5);  // é is one character, two bytes

  auto s = eval::score_generation(" all things\nconsist.", {"all things consist."});
  EXPECT_EQ(s.exact_match, 1.0);
  EXPECT_EQ(s.prefix_share, 1.0);
  s = eval::score_generation("all thin", {"all things consist."});
  EXPECT_EQ(s.exact_match, 0.0);
  EXPECT_DOUBLE_EQ(s.prefix_share, 8.0 / 19.0);
  s = eval::score_generation("zzz", {"abc", "zz top"});  // the best answer counts
  EXPECT_DOUBLE_EQ(s.prefix_share, 2.0 / 6.0);
  s = eval::score_generation("caf\xC3", {"caf\xC3\xA9"});  // half a character is no match
  EXPECT_DOUBLE_EQ(s.prefix_share, 3.0 / 4.0);
}

TEST(EvalMetrics, AccNormDividesByCharacters) {
  // Ending 0 is likelier in total, ending 1 per character (lm-evaluation-harness's acc_norm).
  const std::vector<double> loglik = {-6.0, -8.0, -30.0};
  const std::vector<std::string> endings = {"abc", "abcdefgh", "x"};
  const eval::ChoiceScore s = eval::score_choices(loglik, endings, 1);
  EXPECT_EQ(s.prediction, 0);
  EXPECT_EQ(s.prediction_norm, 1);
  EXPECT_EQ(s.acc, 0.0);
  EXPECT_EQ(s.acc_norm, 1.0);
  const std::vector<double> tied = {-1.0, -1.0};
  EXPECT_EQ(eval::argmax(tied), 0);  // the first of equals, as numpy.argmax
}

// The reference: each continuation's log-likelihood from the decoder's teacher-forced logits of
// the whole sequence, log-softmax in double.
double brute_force(test::TinyModel& m, const std::vector<std::int32_t>& context,
                   const std::vector<std::int32_t>& continuation) {
  std::vector<std::int32_t> row = context;
  row.insert(row.end(), continuation.begin(), continuation.end());
  const auto decoder = m.spec->decoder(*m.slab, m.context, {.max_tokens = static_cast<std::int64_t>(row.size())});
  const std::int64_t vocab = m.spec->vocab_size();
  std::vector<float> logits(row.size() * static_cast<std::size_t>(vocab));
  decoder->prefill(row, logits.data());
  double total = 0.0;
  for (std::size_t t = context.size(); t < row.size(); ++t) {
    const float* z = logits.data() + (t - 1) * static_cast<std::size_t>(vocab);
    double max = -INFINITY, sum = 0.0;
    for (std::int64_t j = 0; j < vocab; ++j) max = std::max(max, static_cast<double>(z[j]));
    for (std::int64_t j = 0; j < vocab; ++j) sum += std::exp(static_cast<double>(z[j]) - max);
    total += static_cast<double>(z[row[t]]) - max - std::log(sum);
  }
  return total;
}

void check_loglikelihoods(test::TinyModel& m) {
  text::ByteTokenizer bytes;
  eval::EvaluatorOptions options{.max_sequence = 200, .max_sequence_name = "test"};
  eval::Evaluator evaluator(*m.spec, bytes, options);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<std::int32_t> context(3 + trial * 5);
    for (auto& id : context) id = static_cast<std::int32_t>(rng() % 256);
    std::vector<std::vector<std::int32_t>> continuations;
    for (int c = 0; c < 4; ++c) {
      continuations.emplace_back(1 + (trial * 3 + c * 7) % 13);
      for (auto& id : continuations.back()) id = static_cast<std::int32_t>(rng() % 256);
    }
    const std::vector<double> batched = evaluator.loglikelihoods(access(m), context, continuations);
    for (std::size_t c = 0; c < continuations.size(); ++c) {
      const double want = brute_force(m, context, continuations[c]);
      EXPECT_NEAR(batched[c], want, 1e-5 * std::max(1.0, std::abs(want)))
          << m.spec->family() << " trial " << trial << " choice " << c;
    }
  }
}

TEST(EvalLoglik, Qwen3MatchesBruteForce) {
  auto m = test::TinyModel::qwen3(21);
  check_loglikelihoods(m);
}

TEST(EvalLoglik, E29aMatchesBruteForce) {
  auto m = test::TinyModel::e29a(22);
  check_loglikelihoods(m);
}

TEST(EvalLoglik, SplitForwardsEqualOneBatch) {
  auto m = test::TinyModel::qwen3(23);
  text::ByteTokenizer bytes;
  eval::Evaluator evaluator(*m.spec, bytes, {.max_sequence = 200, .max_sequence_name = "test"});
  auto narrow = access(m);
  narrow.scorer_tokens = 30;  // one row per forward
  const std::vector<std::int32_t> context = {10, 20, 30, 40, 50};
  const std::vector<std::vector<std::int32_t>> continuations = {{1, 2, 3}, {4}, {5, 6, 7, 8, 9, 10, 11, 12}, {13, 14}};
  const auto a = evaluator.loglikelihoods(access(m), context, continuations);
  const auto b = evaluator.loglikelihoods(narrow, context, continuations);
  for (std::size_t c = 0; c < a.size(); ++c) EXPECT_NEAR(a[c], b[c], 1e-5 * std::abs(a[c]));
}

TEST(EvalRun, ShippedTasksGreedyAndRankSplit) {
  auto m = test::TinyModel::qwen3(24);
  text::ByteTokenizer bytes;
  const eval::EvaluatorOptions options{.max_sequence = 256, .max_sequence_name = "data.seq_len"};
  const std::vector<eval::Task> tasks =
      eval::load_tasks({kTasks + "kjv_next_verse.jsonl", kTasks + "kjv_verse_completion.jsonl"});
  ASSERT_GE(tasks[0].size(), 200u);
  ASSERT_GE(tasks[1].size(), 200u);
  eval::Evaluator one(*m.spec, bytes, options);
  for (const auto& t : tasks) one.add(t, 7);
  const auto results = one.run(access(m), 0, 1, single());
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].metrics[0].first, "acc");
  EXPECT_EQ(results[1].metrics[0].first, "exact_match");
  EXPECT_EQ(results[1].decoder, "plain");  // the megakernel runs on cuda only
  for (const auto& r : results) {
    EXPECT_EQ(r.items, 7);
    ASSERT_EQ(r.mine.size(), 7u);
    for (const auto& [name, value] : r.metrics) EXPECT_TRUE(value >= 0.0 && value <= 1.0) << name;
  }
  // Generative items are plain greedy generation of the encoded prompt.
  for (const eval::ItemResult& item : results[1].mine) {
    const eval::GenerativeItem& g = tasks[1].generative_items[static_cast<std::size_t>(item.index)];
    const auto encoded = bytes.encode(g.prompt);
    const std::vector<std::int32_t> prompt(encoded.begin(), encoded.end());
    const auto new_tokens = static_cast<std::int64_t>(bytes.encode(" " + g.answers[0]).size());
    const auto decoder = m.spec->decoder(*m.slab, m.context, {.max_tokens = 96});
    models::GenerationOptions greedy;
    greedy.max_new_tokens = new_tokens;
    const auto ids = models::generate(*decoder, m.context, 256, prompt, greedy).ids;
    EXPECT_EQ(item.generated, bytes.display_text(ids));
    EXPECT_EQ(item.prediction, eval::cut_at_stop(item.generated, g.stop));
  }
  // Three ranks in turn: every item once, with the same result as on one rank; the per-item
  // sums give the same metrics.
  std::vector<std::vector<double>> sums(2);
  for (int rank = 0; rank < 3; ++rank) {
    eval::Evaluator part(*m.spec, bytes, options);
    for (const auto& t : tasks) part.add(t, 7);
    std::size_t task = 0;
    const auto collect = [&](std::vector<double> v) {
      auto& s = sums[task++];
      if (s.empty()) s.assign(v.size(), 0.0);
      for (std::size_t i = 0; i < v.size(); ++i) s[i] += v[i];
      return v;
    };
    for (const auto& r : part.run(access(m), rank, 3, collect)) {
      const auto& whole = results[r.kind == eval::TaskKind::multiple_choice ? 0 : 1];
      for (const eval::ItemResult& item : r.mine) {
        EXPECT_EQ(item.index % 3, rank);
        const eval::ItemResult& same = whole.mine[static_cast<std::size_t>(item.index)];
        EXPECT_EQ(item.loglik, same.loglik);
        EXPECT_EQ(item.generated, same.generated);
      }
    }
  }
  for (std::size_t t = 0; t < 2; ++t) {
    double first = 0;
    for (std::size_t i = 0; i < 7; ++i) first += sums[t][2 * i];
    EXPECT_EQ(first / 7.0, results[t].metrics[0].second);
  }
}

TEST(EvalRun, TooLongItemsAreRefusedWithFileAndLine) {
  auto m = test::TinyModel::qwen3(25);
  text::ByteTokenizer bytes;
  eval::Evaluator evaluator(*m.spec, bytes, {.max_sequence = 16, .max_sequence_name = "data.seq_len"});
  const std::string mc =
      write_file("long_mc.jsonl",
                 "{\"ctx\": \"short\", \"endings\": [\"a\", \"b\"], \"label\": 0}\n"
                 "{\"ctx\": \"a much longer context\", \"endings\": [\"a\", \"b\"], \"label\": 0}\n");
  try {
    evaluator.add(eval::load_task(mc));
    FAIL() << "no error";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("long_mc.jsonl:2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("data.seq_len (16)"), std::string::npos) << e.what();
  }
  const std::string gen = write_file("long_gen.jsonl",
                                     "{\"prompt\": \"0123456789\", \"answers\": [\"x\"], "
                                     "\"max_new_tokens\": 7}\n");
  EXPECT_THROW(evaluator.add(eval::load_task(gen)), core::InputError);
  // --limit keeps the first items, so the long one is not read.
  EXPECT_NO_THROW(evaluator.add(eval::load_task(mc), 1));
}

// transformers' per-choice log-likelihoods on the committed fixture models (fp32 cpu).
TEST(EvalLoglik, MatchesTransformersFixture) {
  for (const std::string name : {"tied", "untied"}) {
    const std::string folder = std::string(LLMTRAIN_FIXTURES_DIR) + "/qwen3/" + name;
    const fs::path fixture = fs::path(folder) / "choices.json";
    if (!fs::exists(fixture)) {
      GTEST_SKIP() << "SKIPPED: " << fixture.string() << " is missing (python3 tests/fixtures/make_eval_fixture.py "
                   << "makes it with torch and transformers)";
    }
    const nlohmann::json j = nlohmann::json::parse(std::ifstream(fixture));
    trainer::PretrainedWeights w = trainer::load_pretrained(folder);
    const core::DeviceContext cpu(core::Device::cpu());
    optim::Slab slab(w.layout, cpu);
    std::copy(w.master.begin(), w.master.end(), slab.master().as<float>());
    const auto scorer = w.spec->trainable(slab, cpu, {.max_tokens = 4096});
    text::ByteTokenizer unused;
    eval::Evaluator evaluator(*w.spec, unused,
                              {.max_sequence = w.spec->max_sequence_length(), .max_sequence_name = "positions"});
    const eval::ModelAccess model{
        .spec = w.spec.get(), .slab = &slab, .context = &cpu, .scorer = scorer.get(), .scorer_tokens = 4096};
    int agreed = 0;
    for (const auto& item : j.at("items")) {
      const auto context = item.at("context_ids").get<std::vector<std::int32_t>>();
      const auto continuations = item.at("continuation_ids").get<std::vector<std::vector<std::int32_t>>>();
      const auto want = item.at("loglik").get<std::vector<double>>();
      const auto got = evaluator.loglikelihoods(model, context, continuations);
      ASSERT_EQ(got.size(), want.size());
      for (std::size_t c = 0; c < got.size(); ++c) {
        EXPECT_NEAR(got[c], want[c], 1e-5 * std::abs(want[c])) << name << " choice " << c;
      }
      agreed += eval::argmax(got) == eval::argmax(want) ? 1 : 0;
    }
    EXPECT_EQ(agreed, static_cast<int>(j.at("items").size())) << name << ": predictions differ";
  }
}

}  // namespace
