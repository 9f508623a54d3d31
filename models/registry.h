// The model families a program knows: the explicit list in models/registry.cpp, plus families a
// program adds itself before use (a test-only family, say) with add_family. No static
// initialisers register anything.
#pragma once

#include <string>
#include <vector>

#include "models/model.h"

namespace models {

// The family named `name` (YAML model.arch); core::InputError listing the known names otherwise.
const Family& family(const std::string& name);
// The family whose config.json architecture is `architecture`, or nullptr.
const Family* family_for_hf_architecture(const std::string& architecture);
std::vector<const Family*> families();
// Makes `family` known to this program (it must outlive every use).
void add_family(const Family& family);

// The family a config.json names (architectures[0]); core::InputError naming the file otherwise.
const Family& family_of_hf_config(const nlohmann::json& config, const std::string& where);

}  // namespace models
