#include "trainer/resume_check.h"

#include <string>
#include <vector>

#include <spdlog/spdlog.h>
#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "models/model_config.h"
#include "models/registry.h"

namespace trainer {

namespace {

// A scalar of a resolved config.yaml ("" when absent): both sides come from the same writer, so
// equal values are equal text.
std::string scalar_at(const YAML::Node& root, const char* section, const char* key) {
  const YAML::Node s = root[section];
  if (!s || !s.IsMap() || !s[key] || !s[key].IsScalar()) return "";
  return s[key].Scalar();
}

}  // namespace

void check_resume_config(const VerifiedCheckpoint& checkpoint, const RunConfig& config) {
  const std::string where = (checkpoint.directory / "manifest.json").string();
  const std::string dir = checkpoint.directory.string();
  if (checkpoint.manifest.contains("model")) {
    const ManifestModel saved = manifest_model_of(checkpoint.manifest, where);
    for (const models::ConfigField& f : models::family(config.model.arch).fields()) {
      if (!f.shape || !saved.shape.contains(f.key) || !config.model.shape.contains(f.key)) continue;
      const nlohmann::json& theirs = saved.shape.at(f.key);
      const nlohmann::json& ours = config.model.shape.at(f.key);
      if (theirs == ours) continue;
      if (f.init_only) {
        spdlog::info("model.{}: {} here, {} in {}: unused on resume (it sets only the initial weights)", f.key,
                     models::describe_value(ours), models::describe_value(theirs), dir);
        continue;
      }
      throw core::InputError("model." + f.key + ": the config gives " + models::describe_value(ours) + " but " + dir +
                             " was trained with " + models::describe_value(theirs) +
                             "; a resume continues the same model (start a new run with model.init_from: " + dir +
                             " to change it)");
    }
  }
  if (!checkpoint.manifest.contains("config_yaml") || !checkpoint.manifest["config_yaml"].is_string()) return;
  YAML::Node saved, now;
  try {
    saved = YAML::Load(checkpoint.manifest["config_yaml"].get<std::string>());
    now = YAML::Load(resolved_yaml(config));
  } catch (const YAML::Exception& e) {
    throw core::InputError(where + ": config_yaml: not YAML (" + std::string(e.what()) + ")");
  }
  struct Key {
    const char* section;
    const char* key;
  };
  std::vector<Key> keys = {{"optimizer", "lr"},
                           {"schedule", "type"},
                           {"schedule", "warmup_steps"},
                           {"schedule", "min_lr_ratio"},
                           {"schedule", "decay_ratio"}};
  // A constant schedule does not depend on the run's length: training longer changes nothing.
  if (scalar_at(saved, "schedule", "type") != "constant" || scalar_at(now, "schedule", "type") != "constant") {
    keys.push_back({"training", "max_steps"});
  }
  std::string changes;
  for (const Key& k : keys) {
    const std::string theirs = scalar_at(saved, k.section, k.key), ours = scalar_at(now, k.section, k.key);
    if (theirs.empty() || theirs == ours) continue;
    changes += std::string(changes.empty() ? "" : ", ") + k.section + "." + k.key + " " + theirs + " -> " + ours;
  }
  if (changes.empty()) return;
  if (!config.checkpoint.allow_schedule_change) {
    throw core::InputError(dir + ": resumed with another learning-rate schedule (" + changes +
                           "): the learning rate would jump to the new curve (set checkpoint.allow_schedule_change: "
                           "true to continue on it)");
  }
  spdlog::warn("{}: resumed with another learning-rate schedule ({}): continuing on the new curve", dir, changes);
}

}  // namespace trainer
