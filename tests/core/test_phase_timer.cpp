// The phase timer's bookkeeping on the host: per-name totals and counts in order of first
// appearance, reset; a disabled timer records nothing and needs no device.
#include <gtest/gtest.h>

#include "core/phase_timer.h"

namespace {

TEST(PhaseTotals, SumsPerNameInOrderOfFirstAppearance) {
  core::PhaseTotals t;
  // Two "steps" of three phases, the same names each time, as layers repeat them.
  for (int step = 0; step < 2; ++step) {
    t.add("attn.qkv.fwd", 1.5);
    t.add("attn.core.fwd", 2.0);
    t.add("attn.qkv.fwd", 0.5);
    t.add("mlp.down.bwd", 0.25);
  }
  const auto& e = t.entries();
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0].name, "attn.qkv.fwd");
  EXPECT_DOUBLE_EQ(e[0].ms, 4.0);
  EXPECT_EQ(e[0].calls, 4);
  EXPECT_EQ(e[1].name, "attn.core.fwd");
  EXPECT_DOUBLE_EQ(e[1].ms, 4.0);
  EXPECT_EQ(e[1].calls, 2);
  EXPECT_EQ(e[2].name, "mlp.down.bwd");
  EXPECT_DOUBLE_EQ(e[2].ms, 0.5);
  EXPECT_EQ(e[2].calls, 2);
  EXPECT_DOUBLE_EQ(t.total_ms(), 8.5);
}

TEST(PhaseTotals, ClearStartsOver) {
  core::PhaseTotals t;
  t.add("a", 1.0);
  t.add("b", 2.0);
  t.clear();
  EXPECT_TRUE(t.entries().empty());
  EXPECT_DOUBLE_EQ(t.total_ms(), 0.0);
  t.add("b", 3.0);
  t.add("a", 1.0);
  ASSERT_EQ(t.entries().size(), 2u);
  EXPECT_EQ(t.entries()[0].name, "b");  // order restarts with the new first appearance
  EXPECT_EQ(t.entries()[0].calls, 1);
  EXPECT_DOUBLE_EQ(t.entries()[0].ms, 3.0);
  EXPECT_EQ(t.entries()[1].name, "a");
}

TEST(PhaseTimer, DisabledOrNullRecordsNothing) {
  // No event is created or recorded while disabled, so this runs without a GPU.
  core::PhaseTimer timer(nullptr);
  timer.set_enabled(false);
  for (int i = 0; i < 3; ++i) {
    core::PhaseScope scope(&timer, "mlp.silu.fwd");
    timer.begin("attn.norm.fwd");
    timer.end();
  }
  { core::PhaseScope null_scope(nullptr, "embedding.fwd"); }
  EXPECT_TRUE(timer.collect().empty());
}

}  // namespace
