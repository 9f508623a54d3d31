// A training step's compute and communication timeline (step_timeline.h).
#include "trainer/step_timeline.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "core/error.h"

namespace trainer {

namespace {

using Spans = std::vector<std::pair<double, double>>;

// The union of the intervals as sorted, disjoint spans, without the "wait..." phases.
Spans merged(const std::vector<core::PhaseTimer::Interval>& intervals) {
  Spans spans;
  for (const core::PhaseTimer::Interval& i : intervals) {
    if (i.end_ms > i.start_ms && !std::string_view(i.name).starts_with("wait"))
      spans.emplace_back(i.start_ms, i.end_ms);
  }
  std::sort(spans.begin(), spans.end());
  Spans out;
  for (const auto& s : spans) {
    if (!out.empty() && s.first <= out.back().second) {
      out.back().second = std::max(out.back().second, s.second);
    } else {
      out.push_back(s);
    }
  }
  return out;
}

double length(const Spans& spans) {
  double total = 0;
  for (const auto& [a, b] : spans) total += b - a;
  return total;
}

nlohmann::json lane(const std::vector<core::PhaseTimer::Interval>& intervals) {
  nlohmann::json out = nlohmann::json::array();
  for (const core::PhaseTimer::Interval& i : intervals) out.push_back({i.name, i.start_ms, i.end_ms});
  return out;
}

}  // namespace

TimelineSummary summarize_timeline(const std::vector<core::PhaseTimer::Interval>& compute,
                                   const std::vector<core::PhaseTimer::Interval>& comm, double step_ms) {
  const Spans busy = merged(compute), talk = merged(comm);
  double overlap = 0;
  for (std::size_t i = 0, j = 0; i < busy.size() && j < talk.size();) {
    const double lo = std::max(busy[i].first, talk[j].first), hi = std::min(busy[i].second, talk[j].second);
    if (hi > lo) overlap += hi - lo;
    if (busy[i].second < talk[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  TimelineSummary s;
  s.step_ms = step_ms;
  s.compute_busy_ms = length(busy);
  s.comm_busy_ms = length(talk);
  s.comm_under_compute_ms = overlap;
  s.comm_exposed_ms = s.comm_busy_ms - overlap;
  return s;
}

StepTimeline::StepTimeline(const core::DeviceContext& context, comm::Communicator& comm, models::TrainableModel& model)
    : stream_(context.stream()), comm_(comm), model_(model), compute_(context.stream()) {
  if (!context.is_cuda()) throw core::InputError("logging.timeline_step: the timeline needs device: cuda");
  compute_.set_enabled(false);
  CUDA_CHECK(cudaEventCreate(&origin_));
  CUDA_CHECK(cudaEventCreate(&end_));
}

StepTimeline::~StepTimeline() {
  model_.set_phase_timer(nullptr);
  if (core::PhaseTimer* timer = comm_.phase_timer()) timer->set_enabled(false);
  (void)cudaEventDestroy(origin_);
  (void)cudaEventDestroy(end_);
}

void StepTimeline::begin() {
  CUDA_CHECK(cudaEventRecord(origin_, stream_));
  compute_.set_enabled(true);
  model_.set_phase_timer(&compute_);
  if (core::PhaseTimer* timer = comm_.phase_timer()) timer->set_enabled(true);
}

nlohmann::json StepTimeline::finish() {
  CUDA_CHECK(cudaEventRecord(end_, stream_));
  model_.set_phase_timer(nullptr);
  comm_.synchronize();
  CUDA_CHECK(cudaEventSynchronize(end_));
  float step_ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&step_ms, origin_, end_));
  const std::vector<core::PhaseTimer::Interval> compute = compute_.intervals(origin_);
  compute_.set_enabled(false);
  std::vector<core::PhaseTimer::Interval> comm;
  if (core::PhaseTimer* timer = comm_.phase_timer()) {
    comm = timer->intervals(origin_);
    timer->set_enabled(false);
  }
  const TimelineSummary s = summarize_timeline(compute, comm, step_ms);
  return {{"step_ms", step_ms},
          {"compute", lane(compute)},
          {"comm", lane(comm)},
          {"summary",
           {{"compute_busy_ms", s.compute_busy_ms},
            {"comm_busy_ms", s.comm_busy_ms},
            {"comm_under_compute_ms", s.comm_under_compute_ms},
            {"comm_exposed_ms", s.comm_exposed_ms}}}};
}

}  // namespace trainer
