// The explicit list of model families.
#include "models/registry.h"

#include <algorithm>

#include "core/error.h"
#include "models/e29a/family.h"
#include "models/qwen3/family.h"

namespace models {

namespace {

std::vector<const Family*>& known() {
  static std::vector<const Family*> list = {&qwen3::qwen3_family(), &e29a::e29a_family()};
  return list;
}

}  // namespace

std::vector<const Family*> families() { return known(); }

void add_family(const Family& family) {
  auto& list = known();
  if (std::find(list.begin(), list.end(), &family) == list.end()) list.push_back(&family);
}

const Family& family(const std::string& name) {
  std::string names;
  for (const Family* f : known()) {
    if (f->name() == name) return *f;
    names += (names.empty() ? "" : ", ") + f->name();
  }
  throw core::InputError("unknown model family '" + name + "' (known: " + names + ")");
}

const Family* family_for_hf_architecture(const std::string& architecture) {
  for (const Family* f : known()) {
    if (f->hf_architecture() == architecture) return f;
  }
  return nullptr;
}

const Family& family_of_hf_config(const nlohmann::json& config, const std::string& where) {
  if (!config.is_object()) throw core::InputError(where + ": expected a JSON object");
  const auto it = config.find("architectures");
  if (it == config.end() || !it->is_array() || it->empty() || !(*it)[0].is_string()) {
    throw core::InputError(where +
                           ": architectures: expected a list naming the model class (e.g. [\"Qwen3ForCausalLM\"])");
  }
  const std::string architecture = (*it)[0].get<std::string>();
  const Family* found = family_for_hf_architecture(architecture);
  if (found == nullptr) {
    std::string known;
    for (const Family* f : families()) known += (known.empty() ? "" : ", ") + f->hf_architecture();
    throw core::InputError(where + ": architectures: '" + architecture + "' is not supported (known: " + known + ")");
  }
  return *found;
}

}  // namespace models
