// trainer CONFIG.yaml [a.b=value ...]: the training program. A bad configuration or input stops
// the run before any work with a message naming the file, line and key, and exit code 2; other
// failures exit 1.
#include <cstdio>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "trainer/config.h"
#include "trainer/train.h"

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::fprintf(stderr, "usage: trainer CONFIG.yaml [section.key=value ...]\n");
    return argc < 2 ? 2 : 0;
  }
  core::init_logging(0);
  const std::vector<std::string> overrides(argv + 2, argv + argc);
  try {
    const trainer::RunConfig config = trainer::load_run_config(argv[1], overrides);
    trainer::train(config);
    return 0;
  } catch (const core::InputError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer failed: %s\n", e.what());
    return 1;
  }
}
