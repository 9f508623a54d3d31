// The backend choice (NCCL on cuda, MPI on cpu) and the GPU of each process.
#include "comm/communicator.h"

#include "comm/mpi_communicator.h"
#include "comm/nccl_communicator.h"
#include "core/error.h"

namespace comm {

std::unique_ptr<Communicator> make_communicator(const Environment& environment, const core::DeviceContext& context,
                                                CommOptions options) {
  if (context.is_cuda()) return std::make_unique<NcclCommunicator>(environment.placement(), context, options);
  // No CUDA call on this path: it must work on machines without a driver.
  return std::make_unique<MpiCommunicator>(environment.placement(), options);
}

int device_for(const Placement& placement, int cuda_devices) {
  if (cuda_devices < 1) {
    throw core::Error("comm: rank " + std::to_string(placement.rank) + " needs a CUDA device but none is visible");
  }
  return placement.local_rank % cuda_devices;
}

}  // namespace comm
