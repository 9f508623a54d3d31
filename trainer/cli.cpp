// trainer CONFIG.yaml [a.b=value ...]: the training program, one process per rank under mpirun
// or srun (or a lone process). A bad configuration or input stops the run before any work with a
// message naming the file, line and key, and exit code 2; other failures exit 1. With several
// ranks a failure on any rank aborts the whole job, so no rank waits for one that has given up.
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include <mpi.h>

#include "comm/communicator.h"
#include "core/error.h"
#include "core/log.h"
#include "trainer/cli.h"
#include "trainer/config.h"
#include "trainer/memory_plan.h"
#include "trainer/train.h"

namespace {

int fail(const comm::Placement& placement, int code) {
  std::fflush(stderr);
  if (placement.world > 1) MPI_Abort(MPI_COMM_WORLD, code);
  return code;
}

}  // namespace

namespace trainer {

namespace {

// trainer --plan CONFIG [overrides] [--world N]: the memory plan, without MPI or a GPU; the
// config's paths need not exist (it may be written for another machine).
int plan_command(int argc, char** argv) {
  std::string config_path;
  std::vector<std::string> overrides;
  int world = 1;
  try {
    for (int i = 2; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--world") {
        if (i + 1 >= argc) throw core::InputError("--world: expected a number of ranks");
        const std::string value = argv[++i];
        std::size_t used = 0;
        try {
          world = std::stoi(value, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != value.size() || world < 1 || world > 1 << 20) {
          throw core::InputError("--world: expected a number of ranks >= 1, got '" + value + "'");
        }
      } else if (config_path.empty()) {
        config_path = arg;
      } else {
        overrides.push_back(arg);
      }
    }
    if (config_path.empty()) throw core::InputError("--plan: expected a config file");
    const RunConfig config = load_run_config(config_path, overrides, {.check_paths = false});
    validate_for_world(config, world);
    std::fputs(plan_memory(config, *model_spec(config), world).table().c_str(), stdout);
    return 0;
  } catch (const core::InputError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}

}  // namespace

int trainer_main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help") {
    std::fprintf(stderr,
                 "usage: trainer CONFIG.yaml [section.key=value ...]\n"
                 "       mpirun -np N trainer CONFIG.yaml [...]   (one rank per GPU)\n"
                 "       trainer --plan CONFIG.yaml [section.key=value ...] [--world N]   (memory per rank)\n");
    return argc < 2 ? 2 : 0;
  }
  if (std::string(argv[1]) == "--plan") return plan_command(argc, argv);
  const comm::Environment environment(&argc, &argv);
  const comm::Placement& placement = environment.placement();
  core::init_logging(placement.rank);
  // Rank 0 speaks for the job; the others report only warnings and errors.
  if (placement.rank != 0 && std::getenv("LLMTRAIN_LOG_LEVEL") == nullptr) spdlog::set_level(spdlog::level::warn);
  const std::vector<std::string> overrides(argv + 2, argv + argc);
  try {
    const trainer::RunConfig config = load_run_config(argv[1], overrides);
    train(config, {.environment = &environment});
    return 0;
  } catch (const core::InputError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return fail(placement, 2);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "trainer failed on rank %d: out of host memory (a smaller training.micro_batch_size, "
                 "data.seq_len or model may fit)\n",
                 placement.rank);
    return fail(placement, 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer failed on rank %d: %s\n", placement.rank, e.what());
    return fail(placement, 1);
  }
}

}  // namespace trainer
