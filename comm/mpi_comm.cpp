// Checked, chunked MPI collectives on host memory (see mpi_comm.h).
#include "comm/mpi_comm.h"

#include <cstring>
#include <numeric>
#include <utility>

#include "core/error.h"

namespace comm::detail {
namespace {

// Frees a derived datatype when the scope ends, also when a later call throws.
class TypeGuard {
 public:
  explicit TypeGuard(MPI_Datatype& type) : type_(type) {}
  ~TypeGuard() {
    if (type_ != MPI_DATATYPE_NULL) (void)MPI_Type_free(&type_);
  }
  TypeGuard(const TypeGuard&) = delete;
  TypeGuard& operator=(const TypeGuard&) = delete;

 private:
  MPI_Datatype& type_;
};

int as_int(std::size_t n) { return static_cast<int>(n); }  // callers keep n <= INT_MAX (for_each_chunk)

}  // namespace

void check_mpi(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  std::string detail;
  if (MPI_Error_string(code, text, &length) == MPI_SUCCESS && length > 0) {
    detail.assign(text, static_cast<std::size_t>(length));
  } else {
    detail = "error code " + std::to_string(code);
  }
  core::throw_call_error("MPI", call, detail, file, line);
}

MPI_Datatype reduction_type(core::DType dtype) {
  switch (dtype) {
    case core::DType::f32: return MPI_FLOAT;
    case core::DType::f64: return MPI_DOUBLE;
    case core::DType::i8: return MPI_INT8_T;
    case core::DType::u8: return MPI_UINT8_T;
    case core::DType::i32: return MPI_INT32_T;
    case core::DType::u32: return MPI_UINT32_T;
    case core::DType::i64: return MPI_INT64_T;
    case core::DType::u64: return MPI_UINT64_T;
    case core::DType::u16: return MPI_UINT16_T;
    case core::DType::bf16:
    case core::DType::f16: return MPI_DATATYPE_NULL;
  }
  return MPI_DATATYPE_NULL;
}

MpiComm::MpiComm(std::size_t max_chunk_bytes) : max_chunk_bytes_(std::max<std::size_t>(max_chunk_bytes, 1)) {
  MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
  try {
    MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MPI_CHECK(MPI_Comm_size(comm_, &world_));
  } catch (...) {
    (void)MPI_Comm_free(&comm_);
    throw;
  }
}

MpiComm::~MpiComm() {
  int initialized = 0;
  int finalized = 0;
  (void)MPI_Initialized(&initialized);
  (void)MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && initialized && !finalized) (void)MPI_Comm_free(&comm_);
}

void MpiComm::all_reduce(void* data, core::DType dtype, std::size_t count, MPI_Op op) {
  const std::size_t size = core::dtype_size(dtype);
  const MPI_Datatype type = reduction_type(dtype);
  auto* bytes = static_cast<std::byte*>(data);
  for_each_chunk(count, max_chunk_bytes_ / size, [&](std::size_t offset, std::size_t n) {
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, bytes + offset * size, as_int(n), type, op, comm_));
  });
}

void MpiComm::reduce_scatter(void* data, core::DType dtype, std::size_t count_per_rank, MPI_Op op) {
  const std::size_t size = core::dtype_size(dtype);
  const MPI_Datatype type = reduction_type(dtype);
  const auto world = static_cast<std::size_t>(world_);
  const auto rank = static_cast<std::size_t>(rank_);
  auto* bytes = static_cast<std::byte*>(data);
  // One call moves world * piece elements.
  const std::size_t piece = std::clamp<std::size_t>(max_chunk_bytes_ / (size * world), 1, INT_MAX);
  if (count_per_rank <= piece) {
    // In place: the input is all of `data`, this rank's result arrives at its start.
    MPI_CHECK(MPI_Reduce_scatter_block(MPI_IN_PLACE, data, as_int(count_per_rank), type, op, comm_));
    if (rank != 0) std::memmove(bytes + rank * count_per_rank * size, bytes, count_per_rank * size);
    return;
  }
  // Too large for one call: each call reduces the same slice [offset, offset + n) of every rank's
  // part, packed contiguously.
  std::vector<std::byte> staging(world * piece * size);
  for_each_chunk(count_per_rank, piece, [&](std::size_t offset, std::size_t n) {
    for (std::size_t r = 0; r < world; ++r) {
      std::memcpy(staging.data() + r * n * size, bytes + (r * count_per_rank + offset) * size, n * size);
    }
    MPI_CHECK(MPI_Reduce_scatter_block(MPI_IN_PLACE, staging.data(), as_int(n), type, op, comm_));
    std::memcpy(bytes + (rank * count_per_rank + offset) * size, staging.data(), n * size);
  });
}

void MpiComm::all_gather(void* data, std::size_t bytes_per_rank) {
  auto* bytes = static_cast<std::byte*>(data);
  const std::size_t piece = std::clamp<std::size_t>(max_chunk_bytes_ / static_cast<std::size_t>(world_), 1, INT_MAX);
  if (bytes_per_rank <= piece) {
    MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, as_int(bytes_per_rank), MPI_BYTE, comm_));
    return;
  }
  // Too large for one call: gather the slice [offset, offset + n) of every rank's part at once,
  // with a datatype of n bytes whose extent is a whole part (no copies).
  for_each_chunk(bytes_per_rank, piece, [&](std::size_t offset, std::size_t n) {
    MPI_Datatype slice = MPI_DATATYPE_NULL;
    MPI_CHECK(MPI_Type_contiguous(as_int(n), MPI_BYTE, &slice));
    TypeGuard slice_guard(slice);
    MPI_Datatype strided = MPI_DATATYPE_NULL;
    MPI_CHECK(MPI_Type_create_resized(slice, 0, static_cast<MPI_Aint>(bytes_per_rank), &strided));
    TypeGuard strided_guard(strided);
    MPI_CHECK(MPI_Type_commit(&strided));
    MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, bytes + offset, 1, strided, comm_));
  });
}

void MpiComm::reduce(void* data, core::DType dtype, std::size_t count, MPI_Op op, int root) {
  const std::size_t size = core::dtype_size(dtype);
  const MPI_Datatype type = reduction_type(dtype);
  auto* bytes = static_cast<std::byte*>(data);
  for_each_chunk(count, max_chunk_bytes_ / size, [&](std::size_t offset, std::size_t n) {
    void* chunk = bytes + offset * size;
    if (rank_ == root) {
      MPI_CHECK(MPI_Reduce(MPI_IN_PLACE, chunk, as_int(n), type, op, root, comm_));
    } else {
      MPI_CHECK(MPI_Reduce(chunk, nullptr, as_int(n), type, op, root, comm_));
    }
  });
}

void MpiComm::broadcast(void* data, std::size_t bytes, int root) {
  auto* p = static_cast<std::byte*>(data);
  for_each_chunk(bytes, max_chunk_bytes_, [&](std::size_t offset, std::size_t n) {
    MPI_CHECK(MPI_Bcast(p + offset, as_int(n), MPI_BYTE, root, comm_));
  });
}

void MpiComm::barrier() { MPI_CHECK(MPI_Barrier(comm_)); }

std::vector<std::string> MpiComm::gather_strings(const std::string& mine, int root) {
  // Every rank learns every length, so all of them refuse an oversized total alike.
  unsigned long long length = mine.size();
  std::vector<unsigned long long> lengths(static_cast<std::size_t>(world_));
  MPI_CHECK(MPI_Allgather(&length, 1, MPI_UNSIGNED_LONG_LONG, lengths.data(), 1, MPI_UNSIGNED_LONG_LONG, comm_));
  const unsigned long long total = std::accumulate(lengths.begin(), lengths.end(), 0ull);
  if (total > static_cast<unsigned long long>(INT_MAX)) {
    throw core::Error("gather_strings: " + std::to_string(total) + " bytes in all, more than one MPI_Gatherv carries");
  }
  std::vector<int> counts;
  std::vector<int> displacements;
  std::string all;
  if (rank_ == root) {
    all.resize(total);
    int offset = 0;
    for (unsigned long long l : lengths) {
      counts.push_back(static_cast<int>(l));
      displacements.push_back(offset);
      offset += static_cast<int>(l);
    }
  }
  MPI_CHECK(MPI_Gatherv(mine.data(), static_cast<int>(length), MPI_CHAR, all.data(), counts.data(),
                        displacements.data(), MPI_CHAR, root, comm_));
  std::vector<std::string> out;
  if (rank_ == root) {
    out.reserve(lengths.size());
    std::size_t offset = 0;
    for (unsigned long long l : lengths) {
      out.push_back(all.substr(offset, l));
      offset += l;
    }
  }
  return out;
}

}  // namespace comm::detail
