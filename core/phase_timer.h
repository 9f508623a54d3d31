// Where a step's device time goes: CUDA events recorded on a stream around named phases, summed
// per name over the steps recorded. A null or disabled timer records nothing, so instrumented code
// pays one branch per phase. Events come from a pool that grows during the first step and is
// reused after each collect(), so later steps create nothing. intervals() gives each phase's own
// start and end instead, against an origin event (timers on several streams share one origin:
// a timeline of compute and communication).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <cuda_runtime_api.h>

namespace core {

// Milliseconds and call counts per phase name, in the order names first appear. Kept apart from
// the events so the bookkeeping is testable without a GPU.
class PhaseTotals {
 public:
  struct Entry {
    std::string name;
    double ms = 0.0;
    std::int64_t calls = 0;
  };

  void add(std::string_view name, double ms);
  const std::vector<Entry>& entries() const { return entries_; }
  double total_ms() const;
  void clear();

 private:
  std::vector<Entry> entries_;
  std::unordered_map<std::string, std::size_t> index_;  // name -> position in entries_
};

class PhaseTimer {
 public:
  // Records on `stream`; starts enabled.
  explicit PhaseTimer(cudaStream_t stream);
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }

  // `name` must outlive the next collect() (string literals: phases are a fixed vocabulary).
  // Phases do not nest: begin() while one is open throws core::Error, as does end() without one.
  void begin(const char* name);
  void end();

  // Waits for the stream's recorded events, returns each name's summed milliseconds and call
  // count since the last collect(), and starts over (the events stay in the pool).
  std::vector<PhaseTotals::Entry> collect();

  struct Interval {
    const char* name;
    double start_ms, end_ms;  // since `origin`
  };
  // Waits for the recorded events, returns every phase since the last collect() in recording
  // order, timed from `origin` (an event recorded before them on the same device), and starts over.
  std::vector<Interval> intervals(cudaEvent_t origin);

 private:
  struct Mark {
    const char* name;
    std::size_t start;  // pool indices
    std::size_t stop;
  };
  cudaEvent_t next_event();

  cudaStream_t stream_;
  bool enabled_ = true;
  bool open_ = false;
  std::vector<cudaEvent_t> pool_;
  std::size_t used_ = 0;  // events of pool_ recorded since the last collect()
  std::vector<Mark> marks_;
};

// begin() on construction, end() on destruction; a null or disabled timer does nothing.
class PhaseScope {
 public:
  PhaseScope(PhaseTimer* timer, const char* name) : timer_(timer != nullptr && timer->enabled() ? timer : nullptr) {
    if (timer_ != nullptr) timer_->begin(name);
  }
  ~PhaseScope() {
    if (timer_ != nullptr) timer_->end();
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  PhaseTimer* timer_;
};

}  // namespace core
