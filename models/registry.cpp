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

}  // namespace models
