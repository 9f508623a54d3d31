#include "eval/task.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace eval {

namespace {

using json = nlohmann::json;

constexpr std::int64_t kMaxNewTokens = 1 << 20;

class ItemReader {
 public:
  ItemReader(const std::string& path, std::int64_t line, const json& object)
      : path_(path), line_(line), object_(object) {}

  [[noreturn]] void fail(const std::string& field, const std::string& message) const {
    throw core::InputError(path_ + ":" + std::to_string(line_) + ": field '" + field + "': " + message);
  }
  bool has(const char* key) const { return object_.contains(key) && !object_[key].is_null(); }
  const json& at(const char* key) const {
    if (!has(key)) fail(key, "missing");
    return object_[key];
  }
  std::string text(const char* key) const {
    const json& v = at(key);
    if (!v.is_string()) fail(key, "expected a string, got " + std::string(v.type_name()));
    std::string s = v.get<std::string>();
    if (s.empty()) fail(key, "empty");
    return s;
  }
  std::vector<std::string> texts(const char* key, std::size_t at_least) const {
    const json& v = at(key);
    if (!v.is_array()) fail(key, "expected a list of strings, got " + std::string(v.type_name()));
    if (v.size() < at_least) {
      fail(key, "expected at least " + std::to_string(at_least) + " entries, got " + std::to_string(v.size()));
    }
    std::vector<std::string> out;
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_string() || v[i].get<std::string>().empty()) {
        fail(key, "entry " + std::to_string(i) + " is not a non-empty string");
      }
      out.push_back(v[i].get<std::string>());
    }
    return out;
  }
  std::int64_t integer(const char* key, std::int64_t min, std::int64_t max) const {
    const json& v = at(key);
    std::int64_t value = 0;
    const std::string digits = v.is_string() ? v.get<std::string>() : std::string();
    if (v.is_number_integer()) {
      value = v.get<std::int64_t>();
    } else if (!digits.empty() && digits.size() < 18 &&
               std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      value = std::stoll(digits);  // HellaSwag copies give the label as "2"
    } else {
      fail(key, "expected an integer, got " + v.dump());
    }
    if (value < min || value > max) {
      fail(key, std::to_string(value) + " is outside [" + std::to_string(min) + ", " + std::to_string(max) + "]");
    }
    return value;
  }

 private:
  const std::string& path_;
  std::int64_t line_;
  const json& object_;
};

ChoiceItem read_choice(const ItemReader& r, std::int64_t line) {
  ChoiceItem item;
  item.line = line;
  item.context = r.text("ctx");
  item.endings = r.texts("endings", 2);
  item.label = static_cast<int>(r.integer("label", 0, static_cast<std::int64_t>(item.endings.size()) - 1));
  return item;
}

GenerativeItem read_generative(const ItemReader& r, std::int64_t line) {
  GenerativeItem item;
  item.line = line;
  item.prompt = r.text("prompt");
  item.answers = r.texts("answers", 1);
  if (r.has("max_new_tokens")) item.max_new_tokens = r.integer("max_new_tokens", 1, kMaxNewTokens);
  if (r.has("stop")) {
    if (r.at("stop").is_string()) {
      item.stop = {r.text("stop")};
    } else {
      item.stop = r.texts("stop", 0);
    }
  }
  return item;
}

// LAMBADA: the text before the last word is the prompt, the word the answer.
GenerativeItem read_lambada(const ItemReader& r, std::int64_t line) {
  const std::string text = r.text("text");
  const auto is_space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  std::size_t end = text.size();
  while (end > 0 && is_space(text[end - 1])) --end;
  std::size_t start = end;
  while (start > 0 && !is_space(text[start - 1])) --start;
  std::size_t prompt_end = start;
  while (prompt_end > 0 && is_space(text[prompt_end - 1])) --prompt_end;
  if (end == 0 || prompt_end == 0) r.fail("text", "needs at least two words (the last one is the answer)");
  GenerativeItem item;
  item.line = line;
  item.prompt = text.substr(0, prompt_end);
  item.answers = {text.substr(start, end - start)};
  return item;
}

}  // namespace

const char* kind_name(TaskKind kind) { return kind == TaskKind::multiple_choice ? "multiple_choice" : "generative"; }

Task load_task(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw core::InputError(path + ": cannot read the task file");
  Task task;
  task.path = path;
  task.name = std::filesystem::path(path).stem().string();
  std::optional<TaskKind> kind;
  std::string line_text;
  std::int64_t line = 0;
  while (std::getline(in, line_text)) {
    ++line;
    if (!line_text.empty() && line_text.back() == '\r') line_text.pop_back();
    if (line_text.find_first_not_of(" \t") == std::string::npos) continue;
    json object;
    try {
      object = json::parse(line_text);
    } catch (const json::parse_error& e) {
      throw core::InputError(path + ":" + std::to_string(line) + ": not valid JSON (" + e.what() + ")");
    }
    if (!object.is_object()) throw core::InputError(path + ":" + std::to_string(line) + ": expected a JSON object");
    const ItemReader reader(path, line, object);
    // The item's kind from its keys; every item of a file must be of the first one's kind.
    TaskKind item_kind;
    const char* format;
    if (object.contains("ctx") || object.contains("endings")) {
      item_kind = TaskKind::multiple_choice;
      format = "multiple choice (ctx, endings, label)";
    } else if (object.contains("prompt") || object.contains("answers")) {
      item_kind = TaskKind::generative;
      format = "generative (prompt, answers)";
    } else if (object.contains("text")) {
      item_kind = TaskKind::generative;
      format = "LAMBADA (text)";
    } else {
      throw core::InputError(path + ":" + std::to_string(line) +
                             ": not a task item: expected the fields ctx, endings and label (multiple choice), "
                             "prompt and answers (generative), or text (LAMBADA)");
    }
    if (kind && *kind != item_kind) {
      throw core::InputError(path + ":" + std::to_string(line) + ": a " + format + " item in a " + kind_name(*kind) +
                             " task (a file holds one kind)");
    }
    kind = item_kind;
    if (item_kind == TaskKind::multiple_choice) {
      task.choice_items.push_back(read_choice(reader, line));
    } else if (object.contains("prompt") || object.contains("answers")) {
      task.generative_items.push_back(read_generative(reader, line));
    } else {
      task.generative_items.push_back(read_lambada(reader, line));
    }
  }
  if (in.bad()) throw core::InputError(path + ": read error");
  if (!kind) throw core::InputError(path + ": the task has no items");
  task.kind = *kind;
  return task;
}

std::vector<Task> load_tasks(const std::vector<std::string>& paths) {
  std::vector<Task> tasks;
  std::map<std::string, std::string> names;
  for (const std::string& path : paths) {
    Task task = load_task(path);
    const auto [it, fresh] = names.emplace(task.name, path);
    if (!fresh) {
      throw core::InputError("tasks " + it->second + " and " + path + " have the same name '" + task.name +
                             "' (the file name names a task's metrics)");
    }
    tasks.push_back(std::move(task));
  }
  return tasks;
}

}  // namespace eval
