#include "core/phase_timer.h"

#include <numeric>

#include "core/error.h"

namespace core {

void PhaseTotals::add(std::string_view name, double ms) {
  auto [it, inserted] = index_.try_emplace(std::string(name), entries_.size());
  if (inserted) entries_.push_back({std::string(name), 0.0, 0});
  Entry& e = entries_[it->second];
  e.ms += ms;
  ++e.calls;
}

double PhaseTotals::total_ms() const {
  return std::accumulate(entries_.begin(), entries_.end(), 0.0, [](double s, const Entry& e) { return s + e.ms; });
}

void PhaseTotals::clear() {
  entries_.clear();
  index_.clear();
}

PhaseTimer::PhaseTimer(cudaStream_t stream) : stream_(stream) {}

PhaseTimer::~PhaseTimer() {
  // A destructor must not throw: a failing destroy leaves nothing to recover.
  for (cudaEvent_t e : pool_) (void)cudaEventDestroy(e);
}

cudaEvent_t PhaseTimer::next_event() {
  if (used_ == pool_.size()) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));
    pool_.push_back(e);
  }
  return pool_[used_++];
}

void PhaseTimer::begin(const char* name) {
  if (!enabled_) return;
  if (open_) throw Error(std::string("PhaseTimer: phase '") + name + "' begun inside '" + marks_.back().name + "'");
  const std::size_t start = used_;
  CUDA_CHECK(cudaEventRecord(next_event(), stream_));
  marks_.push_back({name, start, start});
  open_ = true;
}

void PhaseTimer::end() {
  if (!enabled_) return;
  if (!open_) throw Error("PhaseTimer: end() without begin()");
  const std::size_t stop = used_;
  CUDA_CHECK(cudaEventRecord(next_event(), stream_));
  marks_.back().stop = stop;
  open_ = false;
}

std::vector<PhaseTotals::Entry> PhaseTimer::collect() {
  if (open_) throw Error(std::string("PhaseTimer: collect() with phase '") + marks_.back().name + "' open");
  PhaseTotals totals;
  if (!marks_.empty()) CUDA_CHECK(cudaEventSynchronize(pool_[marks_.back().stop]));
  for (const Mark& m : marks_) {
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, pool_[m.start], pool_[m.stop]));
    totals.add(m.name, static_cast<double>(ms));
  }
  marks_.clear();
  used_ = 0;
  return totals.entries();
}

std::vector<PhaseTimer::Interval> PhaseTimer::intervals(cudaEvent_t origin) {
  if (open_) throw Error(std::string("PhaseTimer: intervals() with phase '") + marks_.back().name + "' open");
  std::vector<Interval> out;
  if (!marks_.empty()) CUDA_CHECK(cudaEventSynchronize(pool_[marks_.back().stop]));
  for (const Mark& m : marks_) {
    float start = 0.0f, stop = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&start, origin, pool_[m.start]));
    CUDA_CHECK(cudaEventElapsedTime(&stop, origin, pool_[m.stop]));
    out.push_back({m.name, static_cast<double>(start), static_cast<double>(stop)});
  }
  marks_.clear();
  used_ = 0;
  return out;
}

}  // namespace core
