// export_hf (trainer/cli.h): writes a Hugging Face folder (config.json, generation_config.json, model.safetensors
// and the run's tokenizer.json when its data was made with one) from a training checkpoint, so
// transformers can load the weights. The model's family and shape come from the manifest.
//   export_hf CHECKPOINT OUT_FOLDER [--dtype bf16|fp32]
// CHECKPOINT is a step directory (step_NNNNNNNN) or a run directory (its newest complete step),
// as for generate. The manifest's checksum is verified before it is read, then the layout and
// every file; bad input exits 2.
#include <cstdio>
#include <filesystem>
#include <string>

#include <CLI/CLI.hpp>

#include "core/error.h"
#include "core/standard_streams.h"
#include "models/hf_folder.h"
#include "trainer/cli.h"
#include "trainer/pretrained.h"

namespace trainer {

int export_hf_main(int argc, char** argv) {
  core::guard_standard_streams();
  CLI::App app{"Export a training checkpoint as a Hugging Face folder"};
  std::string checkpoint_dir, output, dtype = "bf16";
  app.add_option("checkpoint", checkpoint_dir, "a checkpoint step directory (step_NNNNNNNN) or a run directory")
      ->required();
  app.add_option("output", output, "the folder to write")->required();
  app.add_option("--dtype", dtype, "bf16 or fp32")->check(CLI::IsMember({"bf16", "fp32"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  namespace fs = std::filesystem;
  try {
    std::error_code ec;  // exists() leaves it clear for a path that is not there
    if (!(fs::exists(checkpoint_dir, ec) && fs::is_directory(checkpoint_dir, ec))) {
      throw core::InputError(checkpoint_dir + (ec ? ": cannot be looked up: " + ec.message() : ": no such directory"));
    }
    if (!is_checkpoint_path(checkpoint_dir)) {
      throw core::InputError(checkpoint_dir +
                             ": neither a checkpoint step directory (manifest.json) nor a run "
                             "directory (checkpoints/)");
    }
    if (fs::exists(output, ec) && !fs::is_directory(output, ec)) {
      throw core::InputError(output + ": exists and is not a folder");
    }
    if (fs::exists(output, ec) && fs::equivalent(output, checkpoint_dir, ec)) {
      throw core::InputError(output + ": is the checkpoint itself; give another folder");
    }
    const PretrainedWeights weights = load_pretrained(checkpoint_dir);
    std::printf("read %s\n", weights.checkpoint.c_str());
    std::filesystem::path tokenizer;
    if (!weights.tokenizer.empty() && weights.tokenizer != "byte") {
      tokenizer = weights.tokenizer;
      if (!std::filesystem::is_regular_file(tokenizer, ec)) {
        std::fprintf(stderr, "export_hf: warning: the run's tokenizer %s is gone; the folder has no tokenizer.json\n",
                     weights.tokenizer.c_str());
        tokenizer.clear();
      }
    }
    models::write_hf_folder(output, *weights.spec, weights.layout, weights.master.data(),
                            dtype == "bf16" ? models::ExportDtype::bf16 : models::ExportDtype::fp32,
                            weights.carried_hf_config, tokenizer);
    std::printf("wrote %s (%s %s, %lld parameters)\n", output.c_str(), weights.spec->family().c_str(), dtype.c_str(),
                static_cast<long long>(weights.spec->parameter_count()));
    core::finish_standard_output();
    return 0;
  } catch (const core::InputError& e) {
    std::fprintf(stderr, "export_hf: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "export_hf: %s\n", e.what());
    return 1;
  }
}

}  // namespace trainer
