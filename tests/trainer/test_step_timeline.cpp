// The step timeline's summary (trainer/step_timeline.h) on hand-made lanes: busy time is the
// union of a lane's intervals (overlapping and nested phases counted once, "wait..." phases not at
// all), communication under compute the overlap of the two unions, exposed communication the rest.
#include <gtest/gtest.h>

#include <vector>

#include "trainer/step_timeline.h"

namespace {

using Interval = core::PhaseTimer::Interval;

TEST(StepTimeline, SummaryCountsUnionsAndOverlap) {
  // Compute: [0, 4] and [3, 6] overlap (one span [0, 6]), [8, 10]; a zero-length phase adds nothing.
  // A wait on the compute stream, [10, 12], is not compute.
  const std::vector<Interval> compute = {
      {"a", 0, 4}, {"b", 3, 6}, {"c", 8, 10}, {"empty", 9, 9}, {"wait: weight sync", 10, 12}};
  // Communication: [5, 9] (1 under [0, 6], 1 under [8, 10]), [2, 3] inside compute, [11, 12] after it.
  const std::vector<Interval> comm = {{"x", 5, 9}, {"y", 2, 3}, {"z", 11, 12}};
  const trainer::TimelineSummary s = trainer::summarize_timeline(compute, comm, 12.5);
  EXPECT_DOUBLE_EQ(s.step_ms, 12.5);
  EXPECT_DOUBLE_EQ(s.compute_busy_ms, 8.0);
  EXPECT_DOUBLE_EQ(s.comm_busy_ms, 6.0);
  EXPECT_DOUBLE_EQ(s.comm_under_compute_ms, 3.0);
  EXPECT_DOUBLE_EQ(s.comm_exposed_ms, 3.0);
}

TEST(StepTimeline, EmptyLanes) {
  const trainer::TimelineSummary none = trainer::summarize_timeline({}, {}, 1.0);
  EXPECT_DOUBLE_EQ(none.compute_busy_ms, 0.0);
  EXPECT_DOUBLE_EQ(none.comm_exposed_ms, 0.0);
  const trainer::TimelineSummary alone = trainer::summarize_timeline({}, {{"x", 1, 3}}, 4.0);
  EXPECT_DOUBLE_EQ(alone.comm_busy_ms, 2.0);
  EXPECT_DOUBLE_EQ(alone.comm_exposed_ms, 2.0);
}

}  // namespace
