// The MPI environment: MPI_Init_thread / MPI_Finalize around the job and the placement of this
// process (rank, world, node-local rank) under mpirun, srun with PMIx or as a lone process.
#include <mutex>

#include <mpi.h>
#include <spdlog/spdlog.h>

#include "comm/communicator.h"
#include "comm/mpi_comm.h"
#include "core/error.h"

namespace comm {
namespace {

// Environments alive in this process; MPI is initialised by the first and finalised by the last
// (MPI cannot be initialised twice, so a second Environment shares the first one's MPI).
std::mutex environments_mutex;
int environments = 0;
bool we_initialized = false;

}  // namespace

Environment::Environment(int* argc, char*** argv) {
  {
    std::lock_guard lock(environments_mutex);
    int initialized = 0;
    int finalized = 0;
    MPI_CHECK(MPI_Initialized(&initialized));
    MPI_CHECK(MPI_Finalized(&finalized));
    if (finalized) throw core::Error("comm::Environment: MPI was already finalised in this process");
    if (!initialized) {
      // The watchdog thread may call MPI_Abort while the main thread is inside MPI, hence
      // MPI_THREAD_MULTIPLE; a lower level is accepted (the abort path still works in practice).
      int provided = MPI_THREAD_SINGLE;
      MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
      we_initialized = true;
      if (provided < MPI_THREAD_MULTIPLE) {
        spdlog::warn(
            "MPI provides thread level {} below MPI_THREAD_MULTIPLE ({}): the watchdog's MPI_Abort "
            "from its own thread is not guaranteed to work",
            provided, MPI_THREAD_MULTIPLE);
      }
    }
    ++environments;
  }
  try {
    // Every MPI error comes back as a return code and becomes a core::Error (dups inherit this).
    MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &placement_.rank));
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &placement_.world));
    MPI_Comm node = MPI_COMM_NULL;
    MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, placement_.rank, MPI_INFO_NULL, &node));
    const int rank_status = MPI_Comm_rank(node, &placement_.local_rank);
    const int size_status = MPI_Comm_size(node, &placement_.local_world);
    (void)MPI_Comm_free(&node);
    MPI_CHECK(rank_status);
    MPI_CHECK(size_status);
  } catch (...) {
    std::lock_guard lock(environments_mutex);
    --environments;
    throw;
  }
}

Environment::~Environment() {
  std::lock_guard lock(environments_mutex);
  if (--environments > 0 || !we_initialized) return;
  int initialized = 0;
  int finalized = 0;
  (void)MPI_Initialized(&initialized);
  (void)MPI_Finalized(&finalized);
  if (initialized && !finalized) (void)MPI_Finalize();
}

}  // namespace comm
