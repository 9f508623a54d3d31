// export_hf CHECKPOINT OUT_FOLDER [--dtype bf16|fp32]: a training checkpoint as a Hugging Face
// folder (trainer/cli.h).
#include "trainer/cli.h"

int main(int argc, char** argv) { return trainer::export_hf_main(argc, argv); }
