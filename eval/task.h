// Evaluation tasks read from JSONL, one item per non-blank line, every item of a file of one kind:
//   multiple choice (HellaSwag's format): "ctx" (string), "endings" (two or more strings),
//     "label" (the index of the right ending: an integer or a string of digits);
//   generative: "prompt" (string), "answers" (one or more strings), optional "max_new_tokens"
//     (a positive integer) and "stop" (a string or a list of strings: the output ends before the
//     first one);
//   LAMBADA's format: "text", whose last word is the answer to the text before it (generative).
// Other keys are ignored. Anything malformed is a core::InputError naming the file, the line and
// the field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace eval {

enum class TaskKind { multiple_choice, generative };

struct ChoiceItem {
  std::int64_t line = 0;  // 1-based line of the file
  std::string context;
  std::vector<std::string> endings;
  int label = 0;
};

struct GenerativeItem {
  std::int64_t line = 0;
  std::string prompt;
  std::vector<std::string> answers;
  std::optional<std::int64_t> max_new_tokens;
  std::vector<std::string> stop;
};

struct Task {
  std::string path;
  std::string name;  // the file name without .jsonl
  TaskKind kind = TaskKind::multiple_choice;
  std::vector<ChoiceItem> choice_items;
  std::vector<GenerativeItem> generative_items;
  std::size_t size() const { return kind == TaskKind::multiple_choice ? choice_items.size() : generative_items.size(); }
};

// Reads and checks a task file (core::InputError "PATH:LINE: field 'F': ..." on the first problem;
// a file without items is refused too).
Task load_task(const std::string& path);

// Task names from paths: the file stems, which must differ (core::InputError otherwise).
std::vector<Task> load_tasks(const std::vector<std::string>& paths);

const char* kind_name(TaskKind kind);

}  // namespace eval
