// The cuda backend's collectives: NCCL on a dedicated stream, events both ways, watched entries.
#include "comm/nccl_communicator.h"

#include <chrono>
#include <optional>
#include <thread>
#include <utility>

#include "core/error.h"

// Every NCCL return code: a core::Error naming the call, NCCL's error string and its last message.
#define NCCL_CHECK(call) check_nccl((call), #call, __FILE__, __LINE__)

namespace comm {
namespace {

std::optional<ncclDataType_t> nccl_type(core::DType dtype) {
  switch (dtype) {
    case core::DType::f32: return ncclFloat32;
    case core::DType::f64: return ncclFloat64;
    case core::DType::bf16: return ncclBfloat16;
    case core::DType::f16: return ncclFloat16;
    case core::DType::i8: return ncclInt8;
    case core::DType::u8: return ncclUint8;
    case core::DType::i32: return ncclInt32;
    case core::DType::u32: return ncclUint32;
    case core::DType::i64: return ncclInt64;
    case core::DType::u64: return ncclUint64;
    case core::DType::u16: return std::nullopt;
  }
  return std::nullopt;
}

ncclDataType_t checked_type(core::DType dtype, ReduceOp op, const char* operation, const char* what) {
  detail::check_op(dtype, op, operation, what);
  const auto type = nccl_type(dtype);
  if (!type) {
    throw core::Error("comm: " + detail::describe(operation, what) + ": NCCL cannot reduce " +
                      std::string(core::dtype_name(dtype)));
  }
  return *type;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
  }
  return ncclSum;
}

std::string text(const char* what) { return what ? what : ""; }

void append(std::string& list, const std::string& item) {
  if (!list.empty()) list += ", ";
  list += item;
}

}  // namespace

NcclCommunicator::NcclCommunicator(Placement placement, const core::DeviceContext& context, CommOptions options)
    : HostCommunicator(placement, options, context.is_cuda() ? context.device().index : -1,
                       detail::MpiComm::kDefaultMaxChunkBytes),
      device_(context.device().index),
      compute_(context.stream()) {
  if (!context.is_cuda()) throw core::Error("comm: the NCCL communicator needs a cuda device context");
  try {
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&compute_ready_, cudaEventDisableTiming));
    if (world() > 1) {
      ncclUniqueId id{};
      if (rank() == 0) NCCL_CHECK(ncclGetUniqueId(&id));
      auto watch = watchdog_.watch_host("nccl_init", "ncclUniqueId broadcast and ncclCommInitRank");
      mpi_.broadcast(&id, sizeof id, 0);
      NCCL_CHECK(ncclCommInitRank(&comm_, world(), id, rank()));
      ncclComm_t comm = comm_;
      watchdog_.set_abort_hook([this] { abort_from_watchdog(); });
      watchdog_.set_health_check([comm]() -> std::string {
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(comm, &async) != ncclSuccess) return {};
        if (async == ncclSuccess || async == ncclInProgress) return {};
        return std::string("NCCL reported an asynchronous error (") + ncclGetErrorString(async) + ")";
      });
    }
  } catch (...) {
    failed_ = true;
    release();
    throw;
  }
}

NcclCommunicator::~NcclCommunicator() { release(); }

NcclCommunicator::NcclSection::NcclSection(NcclCommunicator& owner) : lock_(owner.nccl_mutex_) {
  owner.park_if_aborted();
}

void NcclCommunicator::abort_from_watchdog() {
  // On the watchdog thread, just before MPI_Abort. A thread blocked inside NCCL keeps the mutex:
  // abort anyway after a second (that is what unblocks it); it parks when its call returns.
  aborted_ = true;
  const bool locked = nccl_mutex_.try_lock_for(std::chrono::seconds(1));
  (void)ncclCommAbort(comm_);
  if (locked) nccl_mutex_.unlock();  // later NCCL sections park on aborted_
}

void NcclCommunicator::park_if_aborted() const {
  if (!aborted_) return;
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));  // MPI_Abort (or the watchdog's last resort) ends us
}

void NcclCommunicator::release() noexcept {
  // The hooks refer to comm_: no watchdog call into it from here on (set_* waits for a running hook).
  watchdog_.set_abort_hook({});
  watchdog_.set_health_check({});
  park_if_aborted();
  (void)cudaSetDevice(device_);
  if (comm_) {
    ncclResult_t async = ncclSuccess;
    const bool healthy = !failed_ && ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async == ncclSuccess;
    if (healthy) {
      try {
        // Waits for the peers: still watched (an MPI_Abort without ncclCommAbort if it hangs).
        auto watch = watchdog_.watch_host("comm_destroy", "ncclCommDestroy");
        (void)cudaStreamSynchronize(stream_);
        (void)ncclCommDestroy(comm_);
      } catch (...) {
        (void)ncclCommAbort(comm_);
      }
    } else {
      (void)ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }
  if (stream_) {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(std::exchange(stream_, nullptr));
  }
  if (compute_ready_) (void)cudaEventDestroy(std::exchange(compute_ready_, nullptr));
  for (cudaEvent_t& event : markers_) {
    if (event) (void)cudaEventDestroy(std::exchange(event, nullptr));
  }
}

void NcclCommunicator::check_nccl(ncclResult_t result, const char* call, const char* file, int line) {
  if (result == ncclSuccess) return;
  park_if_aborted();  // the failure is the watchdog's abort: comm_ is freed
  failed_ = true;
  std::string detail = ncclGetErrorString(result);
  if (comm_) {
    const char* last = ncclGetLastError(comm_);
    if (last && *last) detail += std::string(" (") + last + ")";
  }
  core::throw_call_error("NCCL", call, detail, file, line);
}

void NcclCommunicator::wait_for_compute() {
  CUDA_CHECK(cudaEventRecord(compute_ready_, compute_));
  CUDA_CHECK(cudaStreamWaitEvent(stream_, compute_ready_, 0));
}

void NcclCommunicator::collective_enqueued(const char* operation, const char* what) {
  if (group_depth_ > 0) {
    append(group_operations_, operation);
    append(group_whats_, text(what));
    return;
  }
  finish(operation, text(what));
}

void NcclCommunicator::timeline_begin(const char* what) {
  if (timeline_ == nullptr || !timeline_->enabled() || timeline_open_) return;
  timeline_->begin(what);
  timeline_open_ = true;
}

core::PhaseTimer* NcclCommunicator::phase_timer() {
  if (world() == 1) return nullptr;
  if (timeline_ == nullptr) {
    timeline_ = std::make_unique<core::PhaseTimer>(stream_);
    timeline_->set_enabled(false);
  }
  return timeline_.get();
}

void NcclCommunicator::finish(const std::string& operation, const std::string& what) {
  if (timeline_open_) {
    timeline_open_ = false;
    timeline_->end();
  }
  cudaEvent_t done = watchdog_.acquire_event();
  try {
    CUDA_CHECK(cudaEventRecord(done, stream_));
    if (!detached_) CUDA_CHECK(cudaStreamWaitEvent(compute_, done, 0));
  } catch (...) {
    watchdog_.release_event(done);
    throw;
  }
  watchdog_.watch_event(done, operation, what);
}

void NcclCommunicator::all_reduce(void* data, core::DType dtype, std::size_t count, ReduceOp op, const char* what) {
  const ncclDataType_t type = checked_type(dtype, op, "all_reduce", what);
  if (world() == 1 || count == 0) return;
  wait_for_compute();
  timeline_begin(what);
  {
    auto watch = watchdog_.watch_host(
        "all_reduce", what, count * core::dtype_size(dtype));  // enqueueing may block (first connection to a peer)
    NcclSection section(*this);
    NCCL_CHECK(ncclAllReduce(data, data, count, type, nccl_op(op), comm_, stream_));
  }
  collective_enqueued("all_reduce", what);
}

void NcclCommunicator::reduce_scatter(void* data, core::DType dtype, std::size_t count_per_rank, ReduceOp op,
                                      const char* what) {
  const ncclDataType_t type = checked_type(dtype, op, "reduce_scatter", what);
  if (world() == 1 || count_per_rank == 0) return;
  auto* mine =
      static_cast<std::byte*>(data) + static_cast<std::size_t>(rank()) * count_per_rank * core::dtype_size(dtype);
  wait_for_compute();
  timeline_begin(what);
  {
    auto watch = watchdog_.watch_host("reduce_scatter", what, count_per_rank * world() * core::dtype_size(dtype));
    NcclSection section(*this);
    NCCL_CHECK(ncclReduceScatter(data, mine, count_per_rank, type, nccl_op(op), comm_, stream_));
  }
  collective_enqueued("reduce_scatter", what);
}

void NcclCommunicator::all_gather(void* data, core::DType dtype, std::size_t count_per_rank, const char* what) {
  if (world() == 1 || count_per_rank == 0) return;
  const std::size_t bytes = count_per_rank * core::dtype_size(dtype);
  auto* mine = static_cast<std::byte*>(data) + static_cast<std::size_t>(rank()) * bytes;
  wait_for_compute();
  timeline_begin(what);
  {
    auto watch = watchdog_.watch_host("all_gather", what, count_per_rank * world() * core::dtype_size(dtype));
    NcclSection section(*this);
    NCCL_CHECK(ncclAllGather(mine, data, bytes, ncclUint8, comm_, stream_));
  }
  collective_enqueued("all_gather", what);
}

void NcclCommunicator::broadcast(void* data, core::DType dtype, std::size_t count, int root, const char* what) {
  detail::check_root(root, world(), "broadcast", what);
  if (world() == 1 || count == 0) return;
  wait_for_compute();
  timeline_begin(what);
  {
    auto watch = watchdog_.watch_host("broadcast", what, count * core::dtype_size(dtype));
    NcclSection section(*this);
    NCCL_CHECK(ncclBroadcast(data, data, count * core::dtype_size(dtype), ncclUint8, root, comm_, stream_));
  }
  collective_enqueued("broadcast", what);
}

void NcclCommunicator::reduce_into(const void* send, void* recv, core::DType dtype, std::size_t count, ReduceOp op,
                                   int root, const char* what) {
  const ncclDataType_t type = checked_type(dtype, op, "reduce", what);
  detail::check_root(root, world(), "reduce", what);
  const bool lands_here = rank() == root;
  if (count == 0) return;
  if (lands_here && recv == nullptr)
    throw core::Error("comm: " + detail::describe("reduce", what) + ": recv is null on the root");
  if (world() == 1) {
    if (send != recv) {
      CUDA_CHECK(cudaMemcpyAsync(recv, send, count * core::dtype_size(dtype), cudaMemcpyDeviceToDevice, compute_));
    }
    return;
  }
  wait_for_compute();
  timeline_begin(what);
  {
    auto watch = watchdog_.watch_host("reduce", what, count * core::dtype_size(dtype));
    NcclSection section(*this);
    NCCL_CHECK(ncclReduce(send, lands_here ? recv : nullptr, count, type, nccl_op(op), root, comm_, stream_));
  }
  collective_enqueued("reduce", what);
}

std::uint64_t NcclCommunicator::marker() {
  if (world() == 1) return 0;
  cudaEvent_t& event = markers_[markers_issued_ % kMarkers];
  if (event == nullptr) CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(event, stream_));
  return ++markers_issued_;
}

void NcclCommunicator::wait_for(std::uint64_t marker) {
  if (marker == 0) return;
  if (marker > markers_issued_) {
    throw core::Error("comm: marker " + std::to_string(marker) + " has not been issued (" +
                      std::to_string(markers_issued_) + " so far)");
  }
  // An older marker than the ring keeps: the oldest kept one comes after it on the communication
  // stream, so waiting for that one waits for it too.
  if (markers_issued_ - marker >= kMarkers) marker = markers_issued_ - kMarkers + 1;
  CUDA_CHECK(cudaStreamWaitEvent(compute_, markers_[(marker - 1) % kMarkers], 0));
}

void NcclCommunicator::group_start() {
  if (world() > 1) {
    NcclSection section(*this);
    NCCL_CHECK(ncclGroupStart());
  }
  ++group_depth_;
}

void NcclCommunicator::group_end() {
  if (group_depth_ == 0) throw core::Error("comm: group_end() without group_start()");
  --group_depth_;
  std::string operations;
  std::string whats;
  if (group_depth_ == 0) {
    operations = std::exchange(group_operations_, {});
    whats = std::exchange(group_whats_, {});
  }
  if (world() > 1) {
    auto watch = watchdog_.watch_host("group_end", whats.empty() ? "nested group" : whats.c_str());
    NcclSection section(*this);
    NCCL_CHECK(ncclGroupEnd());
  }
  if (!operations.empty()) finish("group(" + operations + ")", whats);
}

void NcclCommunicator::synchronize() {
  const cudaError_t status = cudaStreamSynchronize(stream_);
  park_if_aborted();  // woken by the watchdog's abort
  core::check_cuda(status, "cudaStreamSynchronize(communication stream)", __FILE__, __LINE__);
  if (comm_) {
    NcclSection section(*this);
    ncclResult_t async = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
    check_nccl(async, "asynchronous error of the communicator", __FILE__, __LINE__);
  }
}

}  // namespace comm
