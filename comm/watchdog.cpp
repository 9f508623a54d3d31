// The collective watchdog (see watchdog.h): registered entries, the polling thread and the abort.
#include "comm/watchdog.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include <mpi.h>
#include <spdlog/spdlog.h>

#include "core/error.h"

namespace comm {
namespace {

std::string format_seconds(double seconds) {
  char text[64];
  std::snprintf(text, sizeof text, "%g", seconds);
  return text;
}

Watchdog::Clock::time_point deadline_after(double seconds) {
  // No timeout (<= 0) or one too large to represent: never due.
  if (!(seconds > 0) || seconds > 1e9) return Watchdog::Clock::time_point::max();
  return Watchdog::Clock::now() +
         std::chrono::duration_cast<Watchdog::Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

Watchdog::Watchdog(int rank, CommOptions options, int cuda_device, std::chrono::milliseconds poll_interval)
    : rank_(rank), options_(options), cuda_device_(cuda_device), poll_interval_(poll_interval) {
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Events of unfinished entries too: their communicator is gone, nobody waits for them any more.
  for (auto& [id, entry] : entries_) {
    if (entry.event) (void)cudaEventDestroy(entry.event);
  }
  for (cudaEvent_t event : free_events_) (void)cudaEventDestroy(event);
}

Watchdog::HostScope::HostScope(HostScope&& other) noexcept
    : watchdog_(std::exchange(other.watchdog_, nullptr)), id_(other.id_) {}

Watchdog::HostScope::~HostScope() {
  if (!watchdog_) return;
  if (watchdog_->progress_) watchdog_->progress_->leave();
  watchdog_->remove(id_);
}

Watchdog::HostScope Watchdog::watch_host(const char* operation, const char* what, std::uint64_t bytes) {
  if (progress_) progress_->enter(operation, what, bytes);
  Entry entry;
  entry.operation = operation ? operation : "";
  entry.what = what ? what : "";
  return HostScope(this, add(std::move(entry)));
}

cudaEvent_t Watchdog::acquire_event() {
  if (cuda_device_ < 0) throw core::Error("watchdog: device entries on a host-only watchdog");
  std::lock_guard lock(mutex_);
  if (free_events_.empty()) (void)reap_locked();  // an error stays registered: the thread reports it
  if (!free_events_.empty()) {
    cudaEvent_t event = free_events_.back();
    free_events_.pop_back();
    return event;
  }
  cudaEvent_t event = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  ++events_created_;
  return event;
}

void Watchdog::release_event(cudaEvent_t event) {
  if (!event) return;
  std::lock_guard lock(mutex_);
  free_events_.push_back(event);
}

void Watchdog::watch_event(cudaEvent_t event, const std::string& operation, const std::string& what) {
  Entry entry;
  entry.operation = operation;
  entry.what = what;
  entry.event = event;
  (void)add(std::move(entry));
}

void Watchdog::set_abort_hook(std::function<void()> hook) {
  std::lock_guard lock(hooks_mutex_);
  abort_hook_ = std::move(hook);
}

void Watchdog::set_health_check(std::function<std::string()> check) {
  std::lock_guard lock(hooks_mutex_);
  health_check_ = std::move(check);
}

void Watchdog::mark_first_step_done() {
  std::lock_guard lock(mutex_);
  first_step_done_ = true;
}

double Watchdog::timeout_s() const {
  std::lock_guard lock(mutex_);
  return first_step_done_ ? options_.timeout_s : options_.first_step_timeout_s;
}

std::size_t Watchdog::pending() const {
  std::lock_guard lock(mutex_);
  return entries_.size();
}

std::size_t Watchdog::events_created() const {
  std::lock_guard lock(mutex_);
  return events_created_;
}

std::uint64_t Watchdog::add(Entry entry) {
  std::lock_guard lock(mutex_);
  entry.timeout_s = first_step_done_ ? options_.timeout_s : options_.first_step_timeout_s;
  entry.deadline = deadline_after(entry.timeout_s);
  const std::uint64_t id = next_id_++;
  entries_.emplace(id, std::move(entry));
  return id;
}

void Watchdog::remove(std::uint64_t id) {
  std::lock_guard lock(mutex_);
  entries_.erase(id);
}

std::string Watchdog::reap_locked() {
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& entry = it->second;
    if (!entry.event) {
      ++it;
      continue;
    }
    const cudaError_t status = cudaEventQuery(entry.event);
    if (status == cudaSuccess) {
      free_events_.push_back(entry.event);
      it = entries_.erase(it);
    } else if (status == cudaErrorNotReady) {
      // Not an error; make sure it does not linger as this thread's "last error".
      if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
      ++it;
    } else {
      return "rank " + std::to_string(rank_) + ": " + entry.operation + " '" + entry.what + "' failed on the device (" +
             cudaGetErrorName(status) + ": " + cudaGetErrorString(status) + "); aborting the job";
    }
  }
  return {};
}

void Watchdog::run() {
  if (cuda_device_ >= 0) (void)cudaSetDevice(cuda_device_);
  std::unique_lock lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, poll_interval_, [this] { return stop_; });
    if (stop_) break;
    std::string failure = reap_locked();
    if (failure.empty()) {
      const auto now = Clock::now();
      const Entry* late = nullptr;
      for (const auto& [id, entry] : entries_) {
        if (now >= entry.deadline && (!late || entry.deadline < late->deadline)) late = &entry;
      }
      if (late) {
        failure = "rank " + std::to_string(rank_) + ": " + late->operation + " '" + late->what +
                  "' did not finish within " + format_seconds(late->timeout_s) + " s; aborting the job";
      }
    }
    if (failure.empty()) {
      lock.unlock();
      {
        std::lock_guard hooks(hooks_mutex_);
        if (health_check_) {
          try {
            failure = health_check_();
          } catch (const std::exception& e) {
            failure = e.what();
          }
        }
      }
      lock.lock();
      if (!failure.empty()) failure = "rank " + std::to_string(rank_) + ": " + failure + "; aborting the job";
    }
    if (!failure.empty()) {
      lock.unlock();
      abort_job(failure);
    }
  }
}

void Watchdog::abort_job(const std::string& failure) {
  const std::string diagnosis = progress_ ? progress_->diagnose() : std::string();
  const std::string message =
      diagnosis.empty() ? failure : failure + "\n  rank " + std::to_string(rank_) + ": " + diagnosis;
  spdlog::critical("{}", message);
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  // Last resort should the abort itself hang (e.g. ncclCommAbort waiting on a wedged device).
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(60));
    std::fputs("watchdog: the abort did not end the process within 60 s; exiting\n", stderr);
    std::_Exit(3);
  }).detach();
  {
    std::lock_guard hooks(hooks_mutex_);
    if (abort_hook_) {
      try {
        abort_hook_();
      } catch (...) {
        // Aborting anyway.
      }
    }
  }
  int initialized = 0;
  int finalized = 0;
  (void)MPI_Initialized(&initialized);
  (void)MPI_Finalized(&finalized);
  if (initialized && !finalized) (void)MPI_Abort(MPI_COMM_WORLD, 3);
  std::_Exit(3);
}

}  // namespace comm
