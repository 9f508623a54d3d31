#include "trainer/pretrained.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>

#include "core/error.h"
#include "models/hf_folder.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "trainer/checkpoint.h"

namespace trainer {

namespace fs = std::filesystem;

namespace {

// The family, shape, carried config.json keys and tokenizer of a folder or checkpoint.
struct Source {
  const models::Family* family = nullptr;
  models::Shape shape;
  nlohmann::json carried;
  std::string tokenizer;
  fs::path checkpoint;  // empty for a Hugging Face folder
};

Source read_source(const std::string& path) {
  Source s;
  if (is_checkpoint_path(path)) {
    s.checkpoint = newest_checkpoint_directory(path);
    const nlohmann::json manifest = read_verified_manifest(s.checkpoint);
    const std::string where = (s.checkpoint / "manifest.json").string();
    ManifestModel model = manifest_model_of(manifest, where);
    s.family = &models::family(model.family);
    s.shape = models::base_shape(*s.family, "");
    for (const auto& [key, value] : model.shape.items()) s.shape[key] = value;
    s.carried = model.hf_config;
    s.tokenizer = model.tokenizer;
    return s;
  }
  const models::HfConfig hf = models::read_hf_config(path);
  s.family = hf.family;
  s.shape = hf.shape;
  s.carried = hf.config;
  const fs::path tokenizer = fs::path(path) / "tokenizer.json";
  if (fs::exists(tokenizer)) s.tokenizer = tokenizer.string();
  return s;
}

// A Hugging Face folder's safetensors files must be able to hold the shape its config.json gives
// (at least 2 bytes a weight) before anything of that shape is allocated.
void check_weights_fit(const std::string& folder, const models::ModelSpec& spec) {
  std::uintmax_t bytes = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    if (entry.path().extension() == ".safetensors" && entry.is_regular_file(ec)) bytes += entry.file_size(ec);
  }
  const auto parameters = static_cast<std::uintmax_t>(spec.parameter_count());
  if (bytes / 2 < parameters) {
    throw core::InputError((fs::path(folder) / "config.json").string() + ": its shape has " +
                           std::to_string(parameters) + " parameters but the folder's safetensors files hold only " +
                           std::to_string(bytes) + " bytes (2 or more a parameter)");
  }
}

// The master weights a checkpoint's files hold must cover `elements` fp32 values before they are
// allocated: the manifest's verified file sizes bound them.
void check_master_fits(const VerifiedCheckpoint& checkpoint, std::int64_t elements) {
  std::uint64_t bytes = 0;
  for (const nlohmann::json& entry : checkpoint.manifest.at("files")) {
    if (entry.is_object() && entry.contains("buffer") && entry["buffer"] == "master" && entry.contains("file_bytes") &&
        entry["file_bytes"].is_number_unsigned()) {
      bytes += std::min<std::uint64_t>(entry["file_bytes"].get<std::uint64_t>(), std::uint64_t{1} << 60);
    }
  }
  if (bytes / sizeof(float) < static_cast<std::uint64_t>(elements)) {
    throw core::InputError((checkpoint.directory / "manifest.json").string() + ": files: the master files hold " +
                           std::to_string(bytes) + " bytes, fewer than the " + std::to_string(elements) +
                           " fp32 weights of the model's shape");
  }
}

}  // namespace

bool is_checkpoint_path(const std::string& path) {
  std::error_code ec;
  const fs::path p(path);
  if (fs::is_regular_file(p / "manifest.json", ec) || fs::is_directory(p / "checkpoints", ec)) return true;
  // A run directory before its first checkpoint: the resolved config and metrics, no config.json.
  if (fs::is_regular_file(p / "config.yaml", ec) && !fs::exists(p / "config.json", ec)) return true;
  if (fs::is_regular_file(p / "config.json", ec)) return false;
  if (fs::is_directory(p, ec)) {
    for (const auto& entry : fs::directory_iterator(p, ec)) {
      if (entry.path().filename().string().rfind("step_", 0) == 0) return true;
    }
  }
  return false;
}

PretrainedWeights load_pretrained(const std::string& path) {
  Source source = read_source(path);
  auto spec = source.family->spec(source.shape);
  optim::SlabLayout layout(spec->parameters(), 1);
  PretrainedWeights out{.spec = std::move(spec),
                        .layout = std::move(layout),
                        .master = {},
                        .carried_hf_config = source.carried,
                        .tokenizer = source.tokenizer,
                        .checkpoint = source.checkpoint.string()};
  if (!source.checkpoint.empty()) {
    const nlohmann::json manifest = read_verified_manifest(source.checkpoint);
    const std::string where = (source.checkpoint / "manifest.json").string();
    if (!manifest.contains("world_size") || !manifest["world_size"].is_number_integer() ||
        manifest["world_size"].get<std::int64_t>() < 1 || manifest["world_size"].get<std::int64_t>() > (1 << 20)) {
      throw core::InputError(where + ": world_size: expected an integer in [1, 1048576]");
    }
    if (!manifest.contains("optimizer") || !manifest["optimizer"].is_object() ||
        !manifest["optimizer"].contains("type") || !manifest["optimizer"]["type"].is_string()) {
      throw core::InputError(where + ": optimizer.type: missing");
    }
    const optim::SlabLayout saved(out.spec->parameters(), manifest["world_size"].get<int>());
    const VerifiedCheckpoint verified =
        verify_checkpoint(source.checkpoint, saved, manifest["optimizer"]["type"].get<std::string>());
    check_master_fits(verified, out.layout.used_elements());
    const core::Buffer master = read_master_weights(verified, {0, out.layout.total_elements()});
    out.master.assign(master.as<float>(), master.as<float>() + out.layout.total_elements());
    return out;
  }
  check_weights_fit(path, *out.spec);
  const core::DeviceContext cpu(core::Device::cpu());
  optim::Slab host(out.layout, cpu);
  models::load_hf_weights(path, *out.spec, host);
  out.master.assign(host.master().as<float>(), host.master().as<float>() + out.layout.total_elements());
  return out;
}

RunConfig resolve_init_from(const RunConfig& config) {
  if (config.model.init_from.empty()) return config;
  const Source source = read_source(config.model.init_from);
  const std::string& path = config.model.init_from;
  if (source.checkpoint.empty()) check_weights_fit(path, *source.family->spec(source.shape));
  if (source.family->name() != config.model.arch) {
    throw core::InputError(path + ": holds a " + source.family->name() + " model but model.arch is " +
                           config.model.arch);
  }
  RunConfig out = config;
  const models::Shape preset =
      config.model.preset.empty() ? models::Shape() : source.family->preset(config.model.preset);
  for (const models::ConfigField& f : source.family->fields()) {
    if (!f.shape) continue;
    const models::Shape& theirs = source.shape.at(f.key);  // a json& would bind a converted copy
    const bool given =
        std::find(config.model.given.begin(), config.model.given.end(), f.key) != config.model.given.end();
    const bool from_preset = !given && preset.is_object() && preset.contains(f.key);
    if ((given || from_preset) && config.model.shape.at(f.key) != theirs) {
      throw core::InputError("model." + f.key + ": the config gives " +
                             models::describe_value(config.model.shape.at(f.key)) +
                             (from_preset ? " (preset " + config.model.preset + ")" : std::string()) + " but " + path +
                             " has " + models::describe_value(theirs));
    }
    out.model.shape[f.key] = theirs;
  }
  out.model.carried_hf_config = source.carried;
  return out;
}

}  // namespace trainer
