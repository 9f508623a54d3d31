// The cpu backend's device collectives: MPI on host buffers, averages as a sum divided by the world.
#include "comm/mpi_communicator.h"

#include <cstring>

#include "core/error.h"

namespace comm {
namespace {

// The MPI type for reducing `dtype` with `op`; throws when MPI cannot (bf16, f16; avg of integers).
MPI_Datatype checked_type(core::DType dtype, ReduceOp op, const char* operation, const char* what) {
  detail::check_op(dtype, op, operation, what);
  const MPI_Datatype type = detail::reduction_type(dtype);
  if (type == MPI_DATATYPE_NULL) {
    throw core::Error("comm: " + detail::describe(operation, what) + ": the cpu backend cannot reduce " +
                      std::string(core::dtype_name(dtype)));
  }
  return type;
}

template <typename T>
void divide(T* data, std::size_t count, int world) {
  const auto divisor = static_cast<T>(world);
  for (std::size_t i = 0; i < count; ++i) data[i] /= divisor;
}

// Turns the sum over `count` elements at `data` into the average (checked_type admits only f32, f64).
void finish_average(void* data, core::DType dtype, std::size_t count, int world) {
  if (dtype == core::DType::f32) divide(static_cast<float*>(data), count, world);
  if (dtype == core::DType::f64) divide(static_cast<double*>(data), count, world);
}

}  // namespace

MpiCommunicator::MpiCommunicator(Placement placement, CommOptions options, std::size_t max_chunk_bytes)
    : HostCommunicator(placement, options, /*cuda_device=*/-1, max_chunk_bytes) {}

void MpiCommunicator::all_reduce(void* data, core::DType dtype, std::size_t count, ReduceOp op, const char* what) {
  (void)checked_type(dtype, op, "all_reduce", what);
  if (world() == 1 || count == 0) return;
  {
    auto watch = watchdog_.watch_host("all_reduce", what, count * core::dtype_size(dtype));
    mpi_.all_reduce(data, dtype, count, detail::mpi_op(op));
  }
  if (op == ReduceOp::avg) finish_average(data, dtype, count, world());
}

void MpiCommunicator::reduce_scatter(void* data, core::DType dtype, std::size_t count_per_rank, ReduceOp op,
                                     const char* what) {
  (void)checked_type(dtype, op, "reduce_scatter", what);
  if (world() == 1 || count_per_rank == 0) return;
  {
    auto watch = watchdog_.watch_host("reduce_scatter", what, count_per_rank * world() * core::dtype_size(dtype));
    mpi_.reduce_scatter(data, dtype, count_per_rank, detail::mpi_op(op));
  }
  if (op == ReduceOp::avg) {
    auto* mine =
        static_cast<std::byte*>(data) + static_cast<std::size_t>(rank()) * count_per_rank * core::dtype_size(dtype);
    finish_average(mine, dtype, count_per_rank, world());
  }
}

void MpiCommunicator::all_gather(void* data, core::DType dtype, std::size_t count_per_rank, const char* what) {
  if (world() == 1 || count_per_rank == 0) return;
  auto watch = watchdog_.watch_host("all_gather", what, count_per_rank * world() * core::dtype_size(dtype));
  mpi_.all_gather(data, count_per_rank * core::dtype_size(dtype));
}

void MpiCommunicator::broadcast(void* data, core::DType dtype, std::size_t count, int root, const char* what) {
  detail::check_root(root, world(), "broadcast", what);
  if (world() == 1 || count == 0) return;
  auto watch = watchdog_.watch_host("broadcast", what, count * core::dtype_size(dtype));
  mpi_.broadcast(data, count * core::dtype_size(dtype), root);
}

void MpiCommunicator::reduce_into(const void* send, void* recv, core::DType dtype, std::size_t count, ReduceOp op,
                                  int root, const char* what) {
  (void)checked_type(dtype, op, "reduce", what);
  detail::check_root(root, world(), "reduce", what);
  const bool lands_here = rank() == root;
  if (count == 0) return;
  if (lands_here && recv == nullptr)
    throw core::Error("comm: " + detail::describe("reduce", what) + ": recv is null on the root");
  const std::size_t bytes = count * core::dtype_size(dtype);
  // The root reduces in place in `recv`, so its own contribution goes there first.
  if (lands_here && send != recv) std::memmove(recv, send, bytes);
  if (world() == 1) return;
  {
    auto watch = watchdog_.watch_host("reduce", what, count * core::dtype_size(dtype));
    if (lands_here) {
      mpi_.reduce(recv, dtype, count, detail::mpi_op(op), root);
    } else {
      // MpiComm::reduce sends from its buffer on non-roots and does not write it.
      mpi_.reduce(const_cast<void*>(send), dtype, count, detail::mpi_op(op), root);
    }
  }
  if (op == ReduceOp::avg && lands_here) finish_average(recv, dtype, count, world());
}

}  // namespace comm
