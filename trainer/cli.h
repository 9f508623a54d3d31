// The command lines of the training program and of the export tool, as functions, so a program
// that adds families of its own (models::add_family) runs exactly the same code.
#pragma once

namespace trainer {

// trainer CONFIG.yaml [section.key=value ...]; returns the exit code (2: bad input).
int trainer_main(int argc, char** argv);
// export_hf CHECKPOINT OUT_FOLDER [--dtype bf16|fp32]; returns the exit code (2: bad input).
int export_hf_main(int argc, char** argv);

}  // namespace trainer
