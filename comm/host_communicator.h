// What both backends share: the MPI host collectives (barrier, host all-reduces, strings), the
// watchdog and the argument checks, so the cpu (MPI) and cuda (NCCL) communicators only differ
// in their device collectives.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_comm.h"
#include "comm/watchdog.h"

namespace comm::detail {

// "all_reduce 'grads'" for messages.
std::string describe(const char* operation, const char* what);
// Throws core::Error unless `root` is a rank of a job of `world` ranks.
void check_root(int root, int world, const char* operation, const char* what);
// Throws core::Error for an average of a non-floating-point type.
void check_op(core::DType dtype, ReduceOp op, const char* operation, const char* what);
// The MPI reduction of `op` (avg: MPI_SUM, divided by the world afterwards).
MPI_Op mpi_op(ReduceOp op);

class HostCommunicator : public Communicator {
 public:
  void barrier(const char* what) override;
  double all_reduce_host(double value, ReduceOp op, const char* what) override;
  std::vector<double> all_reduce_host(std::vector<double> values, ReduceOp op, const char* what) override;
  std::vector<std::string> gather_strings(const std::string& mine, int root, const char* what) override;
  std::string broadcast_string(const std::string& text, int root, const char* what) override;
  void mark_first_step_done() override { watchdog_.mark_first_step_done(); }

  Watchdog& watchdog() { return watchdog_; }

 protected:
  // `cuda_device` as for Watchdog (-1: the watchdog never touches CUDA).
  HostCommunicator(Placement placement, CommOptions options, int cuda_device, std::size_t max_chunk_bytes);

  MpiComm mpi_;
  Watchdog watchdog_;  // after mpi_: destroyed (joined) first
};

}  // namespace comm::detail
