// export_hf: writes a Hugging Face Qwen3 folder (config.json + model.safetensors) from a training
// checkpoint, so transformers can load the weights.
//   export_hf RUN/checkpoints/step_NNNNNNNN OUT_FOLDER [--dtype bf16|fp32]
// The checkpoint is verified (DONE, checksums, layout) first; bad input exits 2 with a message.
#include <cstdio>
#include <fstream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "models/qwen3/hf_export.h"
#include "trainer/checkpoint.h"

int main(int argc, char** argv) {
  CLI::App app{"Export a training checkpoint as a Hugging Face Qwen3 folder"};
  std::string checkpoint_dir, output, dtype = "bf16";
  app.add_option("checkpoint", checkpoint_dir, "a checkpoint directory (step_NNNNNNNN)")->required();
  app.add_option("output", output, "the folder to write")->required();
  app.add_option("--dtype", dtype, "bf16 or fp32")->check(CLI::IsMember({"bf16", "fp32"}));
  CLI11_PARSE(app, argc, argv);
  namespace q3 = models::qwen3;
  try {
    const std::string manifest_path = checkpoint_dir + "/manifest.json";
    std::ifstream in(manifest_path);
    if (!in) throw core::InputError(manifest_path + ": cannot open (is this a checkpoint directory?)");
    nlohmann::json manifest;
    try {
      manifest = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      throw core::InputError(manifest_path + ": not valid JSON: " + e.what());
    }
    if (!manifest.contains("model")) throw core::InputError(manifest_path + ": no model configuration to export");
    const q3::Qwen3Config config = q3::config_from_hf_object(manifest["model"], manifest_path + ": model");
    const optim::SlabLayout layout(q3::parameter_specs(config), manifest.at("world_size").get<int>());
    const auto verified =
        trainer::verify_checkpoint(checkpoint_dir, layout, manifest.at("optimizer").at("type").get<std::string>());
    const core::Buffer master = trainer::read_master_weights(verified, {0, layout.total_elements()});
    q3::write_hf_folder(output, config, layout, master.as<float>(),
                        dtype == "bf16" ? q3::ExportDtype::bf16 : q3::ExportDtype::fp32);
    std::printf("wrote %s (%s, %lld parameters, step %lld)\n", output.c_str(), dtype.c_str(),
                static_cast<long long>(config.parameter_count()), static_cast<long long>(verified.progress.step));
    return 0;
  } catch (const core::InputError& e) {
    std::fprintf(stderr, "export_hf: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "export_hf: %s\n", e.what());
    return 1;
  }
}
