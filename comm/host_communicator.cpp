// The MPI host collectives and argument checks shared by both backends (see host_communicator.h).
#include "comm/host_communicator.h"

#include <chrono>
#include <cstdint>
#include <cstdio>

#include <unistd.h>

#include "core/error.h"

namespace comm::detail {

std::string describe(const char* operation, const char* what) {
  return std::string(operation) + " '" + (what ? what : "") + "'";
}

void check_root(int root, int world, const char* operation, const char* what) {
  if (root < 0 || root >= world) {
    throw core::Error("comm: " + describe(operation, what) + ": root " + std::to_string(root) +
                      " is not a rank of this job (world " + std::to_string(world) + ")");
  }
}

void check_op(core::DType dtype, ReduceOp op, const char* operation, const char* what) {
  const bool floating =
      dtype == core::DType::f32 || dtype == core::DType::f64 || dtype == core::DType::bf16 || dtype == core::DType::f16;
  if (op == ReduceOp::avg && !floating) {
    throw core::Error("comm: " + describe(operation, what) + ": avg needs a floating-point type, got " +
                      std::string(core::dtype_name(dtype)));
  }
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::max ? MPI_MAX : MPI_SUM; }

HostCommunicator::HostCommunicator(Placement placement, CommOptions options, int cuda_device,
                                   std::size_t max_chunk_bytes)
    : Communicator(placement), mpi_(max_chunk_bytes), watchdog_(placement.rank, options, cuda_device) {
  if (mpi_.rank() != placement.rank || mpi_.world() != placement.world) {
    throw core::Error("comm: placement rank " + std::to_string(placement.rank) + " of " +
                      std::to_string(placement.world) + " does not match MPI_COMM_WORLD (rank " +
                      std::to_string(mpi_.rank()) + " of " + std::to_string(mpi_.world()) + ")");
  }
  // The job's token for the progress records: rank 0's pid and start time, broadcast.
  char token[64] = {};
  if (placement.rank == 0) {
    std::snprintf(token, sizeof token, "%lld-%lld", static_cast<long long>(::getpid()),
                  static_cast<long long>(std::chrono::system_clock::now().time_since_epoch().count()));
  }
  if (placement.world > 1 && MPI_Bcast(token, sizeof token, MPI_CHAR, 0, MPI_COMM_WORLD) != MPI_SUCCESS) {
    throw core::Error("comm: MPI_Bcast of the job token failed");
  }
  watchdog_.set_progress_record(std::make_unique<ProgressRecord>(token, placement.rank, placement.world));
}

void HostCommunicator::barrier(const char* what) {
  auto watch = watchdog_.watch_host("barrier", what);
  mpi_.barrier();
}

double HostCommunicator::all_reduce_host(double value, ReduceOp op, const char* what) {
  std::vector<double> values{value};
  return all_reduce_host(std::move(values), op, what)[0];
}

std::vector<double> HostCommunicator::all_reduce_host(std::vector<double> values, ReduceOp op, const char* what) {
  {
    auto watch = watchdog_.watch_host("all_reduce_host", what, values.size() * sizeof(double));
    mpi_.all_reduce(values.data(), core::DType::f64, values.size(), mpi_op(op));
  }
  if (op == ReduceOp::avg) {
    for (double& v : values) v /= static_cast<double>(world());
  }
  return values;
}

std::vector<std::string> HostCommunicator::gather_strings(const std::string& mine, int root, const char* what) {
  check_root(root, world(), "gather_strings", what);
  auto watch = watchdog_.watch_host("gather_strings", what);
  return mpi_.gather_strings(mine, root);
}

std::string HostCommunicator::broadcast_string(const std::string& text, int root, const char* what) {
  check_root(root, world(), "broadcast_string", what);
  auto watch = watchdog_.watch_host("broadcast_string", what);
  std::uint64_t length = text.size();
  mpi_.broadcast(&length, sizeof length, root);
  std::string out = rank() == root ? text : std::string(length, '\0');
  mpi_.broadcast(out.data(), out.size(), root);
  return out;
}

}  // namespace comm::detail
