// family_programs (trainer | export_hf) ARGS...: the trainer's and the export tool's own command
// lines with the test-only bigram family added, the way a program adds a family of its own.
#include <cstdio>
#include <string>

#include "models/registry.h"
#include "test_family.h"
#include "trainer/cli.h"

int main(int argc, char** argv) {
  models::add_family(test::bigram_family());
  const std::string program = argc > 1 ? argv[1] : "";
  if (program == "trainer") return trainer::trainer_main(argc - 1, argv + 1);
  if (program == "export_hf") return trainer::export_hf_main(argc - 1, argv + 1);
  std::fprintf(stderr, "usage: family_programs (trainer | export_hf) ARGS...\n");
  return 2;
}
