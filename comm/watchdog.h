// The collective watchdog: one thread per communicator that turns a collective still unfinished
// at its deadline into a logged abort of the whole job (ncclCommAbort, then MPI_Abort), so a
// lost rank or a hung NCCL kernel never leaves the other ranks waiting silently.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "comm/communicator.h"
#include "comm/progress_record.h"

namespace comm {

class Watchdog {
 public:
  using Clock = std::chrono::steady_clock;

  // `cuda_device` >= 0: device entries are allowed and the thread makes that device current;
  // -1: host entries only, and the watchdog never calls CUDA (the cpu backend runs without a driver).
  Watchdog(int rank, CommOptions options, int cuda_device = -1,
           std::chrono::milliseconds poll_interval = std::chrono::milliseconds(50));
  ~Watchdog();  // stops and joins the thread, destroys the pooled events
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // A blocking host call (an MPI collective, a possibly blocking NCCL call), watched while the scope lives.
  class HostScope {
   public:
    HostScope(HostScope&& other) noexcept;
    HostScope& operator=(HostScope&&) = delete;
    HostScope(const HostScope&) = delete;
    HostScope& operator=(const HostScope&) = delete;
    ~HostScope();

   private:
    friend class Watchdog;
    HostScope(Watchdog* watchdog, std::uint64_t id) : watchdog_(watchdog), id_(id) {}
    Watchdog* watchdog_;
    std::uint64_t id_;
  };
  // `bytes`: the collective's payload, for the progress record.
  [[nodiscard]] HostScope watch_host(const char* operation, const char* what, std::uint64_t bytes = 0);

  // From now on every host entry is entered in `record` (comm/progress_record.h), and an abort
  // names the ranks behind this one. Set before the first collective.
  void set_progress_record(std::unique_ptr<ProgressRecord> record) { progress_ = std::move(record); }

  // Device entries. acquire_event() hands out a pooled event (created when the pool is empty);
  // the caller records it after the collective and passes it to watch_event(), after which the
  // watchdog owns it: the entry finishes when the event completes and the event returns to the
  // pool. release_event() returns an event that was not handed to watch_event().
  cudaEvent_t acquire_event();
  void release_event(cudaEvent_t event);
  void watch_event(cudaEvent_t event, const std::string& operation, const std::string& what);

  // Runs on the watchdog thread just before MPI_Abort (e.g. ncclCommAbort). Set it empty before
  // destroying what it refers to; once set_* returns, the old hook is not running.
  void set_abort_hook(std::function<void()> hook);
  // Runs on the watchdog thread at every poll; a non-empty answer is a failure that aborts the job.
  void set_health_check(std::function<std::string()> check);

  // Entries registered from now on get options.timeout_s instead of options.first_step_timeout_s.
  void mark_first_step_done();
  double timeout_s() const;  // what an entry registered now gets

  std::size_t pending() const;         // entries not finished yet
  std::size_t events_created() const;  // size of the event pool, for leak checks

 private:
  struct Entry {
    std::string operation;
    std::string what;
    Clock::time_point deadline;
    double timeout_s = 0;
    cudaEvent_t event = nullptr;  // null: a host entry, finished by its scope
  };

  std::uint64_t add(Entry entry);
  void remove(std::uint64_t id);
  // Removes device entries whose event completed (mutex held). Returns a failure message when an
  // event reports an error.
  std::string reap_locked();
  void run();
  [[noreturn]] void abort_job(const std::string& failure);

  const int rank_;
  const CommOptions options_;
  const int cuda_device_;
  const std::chrono::milliseconds poll_interval_;

  mutable std::mutex mutex_;  // entries, pool, flags
  std::condition_variable wake_;
  std::map<std::uint64_t, Entry> entries_;
  std::uint64_t next_id_ = 1;
  std::vector<cudaEvent_t> free_events_;
  std::size_t events_created_ = 0;
  bool first_step_done_ = false;
  bool stop_ = false;

  std::mutex hooks_mutex_;  // held while a hook runs
  std::function<void()> abort_hook_;
  std::function<std::string()> health_check_;

  std::unique_ptr<ProgressRecord> progress_;  // used by the calling thread; read by abort_job
  std::thread thread_;                        // last: starts after everything above exists
};

}  // namespace comm
