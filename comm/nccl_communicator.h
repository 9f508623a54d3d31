// The cuda backend's communicator: NCCL collectives on their own stream, ordered against the
// compute stream with events both ways and watched through pooled events.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "comm/host_communicator.h"
#include "core/device.h"
#include "core/phase_timer.h"

namespace comm {

class NcclCommunicator final : public detail::HostCommunicator {
 public:
  // Collective over all ranks: rank 0's ncclUniqueId is broadcast over MPI. `context` (its
  // stream) must outlive the communicator. With world 1 no NCCL communicator is created and the
  // device collectives are no-ops.
  NcclCommunicator(Placement placement, const core::DeviceContext& context, CommOptions options);
  ~NcclCommunicator() override;

  void all_reduce(void* data, core::DType dtype, std::size_t count, ReduceOp op, const char* what) override;
  void reduce_scatter(void* data, core::DType dtype, std::size_t count_per_rank, ReduceOp op,
                      const char* what) override;
  void all_gather(void* data, core::DType dtype, std::size_t count_per_rank, const char* what) override;
  void broadcast(void* data, core::DType dtype, std::size_t count, int root, const char* what) override;
  void reduce_into(const void* send, void* recv, core::DType dtype, std::size_t count, ReduceOp op, int root,
                   const char* what) override;
  void set_detached(bool detached) override { detached_ = detached; }
  std::uint64_t marker() override;
  void wait_for(std::uint64_t marker) override;
  void group_start() override;
  void group_end() override;
  void synchronize() override;
  core::PhaseTimer* phase_timer() override;

  cudaStream_t stream() const { return stream_; }

 private:
  // Serialises this thread's NCCL calls against the watchdog's ncclCommAbort; after an abort the
  // calling thread parks (never touches the freed communicator) until MPI_Abort ends the process.
  class NcclSection {
   public:
    explicit NcclSection(NcclCommunicator& owner);

   private:
    std::lock_guard<std::timed_mutex> lock_;
  };
  void abort_from_watchdog();
  void park_if_aborted() const;
  void check_nccl(ncclResult_t result, const char* call, const char* file, int line);
  // The communication stream waits for the work queued so far on the compute stream.
  void wait_for_compute();
  // The timer's phase of a collective (or of the group it is in) starts here, after its wait.
  void timeline_begin(const char* what);
  // After an enqueued collective: the compute stream waits for it (unless detached) and the
  // watchdog watches it (inside a group: once the group ends).
  void collective_enqueued(const char* operation, const char* what);
  void finish(const std::string& operation, const std::string& what);
  void release() noexcept;

  int device_;
  cudaStream_t compute_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t compute_ready_ = nullptr;
  cudaEvent_t markers_[kMarkers] = {};  // ring: marker m is event (m - 1) % kMarkers
  std::uint64_t markers_issued_ = 0;
  bool detached_ = false;
  ncclComm_t comm_ = nullptr;
  int group_depth_ = 0;
  std::string group_operations_;  // of the collectives in the open group
  std::string group_whats_;
  bool failed_ = false;                         // an NCCL call failed: abort instead of destroy
  std::unique_ptr<core::PhaseTimer> timeline_;  // phase_timer(), made on first use
  bool timeline_open_ = false;
  std::timed_mutex nccl_mutex_;
  std::atomic<bool> aborted_{false};  // the watchdog called ncclCommAbort: comm_ is gone
};

}  // namespace comm
