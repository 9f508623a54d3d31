// Checked, chunked MPI collectives on host memory over a private duplicate of MPI_COMM_WORLD:
// every return code becomes a core::Error naming the call, and any count is split into calls of
// at most `max_chunk_bytes` (MPI counts are `int`), so buffers beyond INT_MAX elements work.
#pragma once

#include <algorithm>
#include <climits>
#include <cstddef>
#include <string>
#include <vector>

#include <mpi.h>

#include "core/dtype.h"

namespace comm::detail {

// Throws core::Error "MPI call `call` failed: <MPI_Error_string>" when `code` is not MPI_SUCCESS.
void check_mpi(int code, const char* call, const char* file, int line);

// Calls fn(offset, n) for consecutive pieces of [0, count), each of at most `max_piece` elements
// (at least 1, at most INT_MAX).
template <typename Fn>
void for_each_chunk(std::size_t count, std::size_t max_piece, Fn&& fn) {
  max_piece = std::clamp<std::size_t>(max_piece, 1, static_cast<std::size_t>(INT_MAX));
  for (std::size_t offset = 0; offset < count; offset += max_piece) fn(offset, std::min(max_piece, count - offset));
}

// The MPI type that reductions of `dtype` use; MPI_DATATYPE_NULL when MPI cannot reduce it (bf16, f16, u16).
MPI_Datatype reduction_type(core::DType dtype);

class MpiComm {
 public:
  static constexpr std::size_t kDefaultMaxChunkBytes = std::size_t{1} << 30;

  // Collective over MPI_COMM_WORLD (MPI_Comm_dup); errors are returned, never fatal.
  explicit MpiComm(std::size_t max_chunk_bytes = kDefaultMaxChunkBytes);
  ~MpiComm();
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  MPI_Comm get() const { return comm_; }
  std::size_t max_chunk_bytes() const { return max_chunk_bytes_; }

  // In place over `count` elements of `dtype` (reduction_type must exist); `op` is MPI_SUM or MPI_MAX.
  void all_reduce(void* data, core::DType dtype, std::size_t count, MPI_Op op);
  // `data` holds world * count_per_rank elements; this rank's reduction ends at data + rank * count_per_rank.
  void reduce_scatter(void* data, core::DType dtype, std::size_t count_per_rank, MPI_Op op);
  // `data` holds world * bytes_per_rank bytes; this rank's part goes to every rank.
  void all_gather(void* data, std::size_t bytes_per_rank);
  // The reduction lands in `data` on `root`.
  void reduce(void* data, core::DType dtype, std::size_t count, MPI_Op op, int root);
  void broadcast(void* data, std::size_t bytes, int root);
  void barrier();
  // Every rank's string on `root` (empty elsewhere).
  std::vector<std::string> gather_strings(const std::string& mine, int root);

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int world_ = 1;
  std::size_t max_chunk_bytes_;
};

}  // namespace comm::detail

#define MPI_CHECK(call) ::comm::detail::check_mpi((call), #call, __FILE__, __LINE__)
