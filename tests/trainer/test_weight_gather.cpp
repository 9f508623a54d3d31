// ZeRO-3's whole-model gather (WeightGather::WholeModel) on one cpu process: it holds the fp32
// weights bit for bit, and while it lives acquire() serves any number of ranges from it without a
// collective (an evaluation's ranks run different numbers of forwards); afterwards each acquire
// gathers again into the two range buffers. A second whole model, or one while a range is held,
// is refused. Prefetch hints gather a range into the free buffer ahead of its acquire (at once, or
// when a buffer is released), a wrong hint is dropped, and an update drops an unused gathered copy.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "optim/initialize.h"
#include "optim/slab.h"
#include "support/host_stub_communicator.h"
#include "trainer/weight_gather.h"

namespace {

// One rank whose device collectives are counted (and, with one rank, complete in place).
class CountingCommunicator final : public test::HostStubCommunicator {
 public:
  int collectives = 0;

  void all_reduce(void*, core::DType, std::size_t, comm::ReduceOp, const char*) override { ++collectives; }
  void reduce_scatter(void*, core::DType, std::size_t, comm::ReduceOp, const char*) override { ++collectives; }
  void all_gather(void*, core::DType, std::size_t, const char*) override { ++collectives; }
  void broadcast(void*, core::DType, std::size_t, int, const char*) override { ++collectives; }
  void reduce_into(const void*, void*, core::DType, std::size_t, comm::ReduceOp, int, const char*) override {
    ++collectives;
  }
};

TEST(WeightGather, WholeModelServesEveryRangeWithoutCollectives) {
  const core::DeviceContext cpu(core::Device::cpu());
  const auto spec = models::family("qwen3").spec(models::base_shape(models::family("qwen3"), "qwen3-test"));
  optim::Slab slab(optim::SlabLayout(spec->parameters(), 1), cpu, {.zero_stage = 3});
  optim::initialize_owned(slab, cpu, 5);
  const std::vector<optim::Range> ranges = spec->weight_ranges(slab.layout());
  ASSERT_GE(ranges.size(), 3u);
  std::int64_t largest = 0;
  for (const optim::Range& r : ranges) largest = std::max(largest, r.size());
  CountingCommunicator comm;
  trainer::WeightGather gather(comm, slab, cpu, largest);

  // Per range: a collective each, at most two ranges at once.
  (void)gather.acquire(ranges[0]);
  (void)gather.acquire(ranges[1]);
  EXPECT_THROW((void)gather.acquire(ranges[2]), core::Error);
  EXPECT_THROW(trainer::WeightGather::WholeModel held(gather), core::Error);  // a range is still held
  gather.release(ranges[0]);
  gather.release(ranges[1]);
  EXPECT_EQ(comm.collectives, 2);

  {
    trainer::WeightGather::WholeModel whole(gather);
    EXPECT_EQ(comm.collectives, 3);  // one all-gather
    EXPECT_EQ(whole.bytes(), static_cast<std::size_t>(slab.layout().total_elements()) * sizeof(float));
    EXPECT_EQ(whole.whole_mirror(), nullptr);
    ASSERT_NE(whole.full_weights(), nullptr);
    EXPECT_EQ(std::memcmp(whole.full_weights(), slab.master().data(), slab.master().bytes()), 0);
    EXPECT_THROW(trainer::WeightGather::WholeModel again(gather), core::Error);
    for (const optim::Range& r : ranges) EXPECT_EQ(gather.acquire(r), whole.full_weights() + r.begin);
    for (const optim::Range& r : ranges) gather.release(r);
    EXPECT_EQ(comm.collectives, 3);
  }
  // Gathered range by range again.
  const void* range = gather.acquire(ranges[2]);
  EXPECT_EQ(comm.collectives, 4);
  EXPECT_EQ(std::memcmp(range, slab.master().as<float>() + ranges[2].begin,
                        static_cast<std::size_t>(ranges[2].size()) * sizeof(float)),
            0);
  gather.release(ranges[2]);
}

// The fixture of the prefetch test: a qwen3-test slab on one cpu rank and its gather.
struct GatherFixture {
  core::DeviceContext cpu{core::Device::cpu()};
  std::unique_ptr<models::ModelSpec> spec =
      models::family("qwen3").spec(models::base_shape(models::family("qwen3"), "qwen3-test"));
  optim::Slab slab{optim::SlabLayout(spec->parameters(), 1), cpu, {.zero_stage = 3}};
  std::vector<optim::Range> ranges = spec->weight_ranges(slab.layout());
  CountingCommunicator comm;
  std::unique_ptr<trainer::WeightGather> gather;
  GatherFixture() {
    optim::initialize_owned(slab, cpu, 9);
    std::int64_t largest = 0;
    for (const optim::Range& r : ranges) largest = std::max(largest, r.size());
    gather = std::make_unique<trainer::WeightGather>(comm, slab, cpu, largest);
  }
  // Whether `data` holds range `r` of the master bit for bit.
  bool holds(const void* data, optim::Range r) const {
    return std::memcmp(data, slab.master().as<float>() + r.begin, static_cast<std::size_t>(r.size()) * 4) == 0;
  }
};

TEST(WeightGather, PrefetchGathersAheadAndDropsWrongOrStaleCopies) {
  GatherFixture f;
  trainer::WeightGather& g = *f.gather;
  const auto& r = f.ranges;
  ASSERT_GE(r.size(), 4u);
  // A forward's pattern: the hint is gathered at once into the free buffer, its acquire communicates no more.
  (void)g.acquire(r[0]);
  g.prefetch(r[1]);
  EXPECT_EQ(f.comm.collectives, 2);
  g.release(r[0]);
  const void* one = g.acquire(r[1]);
  EXPECT_EQ(f.comm.collectives, 2);
  EXPECT_TRUE(f.holds(one, r[1]));
  g.prefetch(r[2]);
  EXPECT_EQ(f.comm.collectives, 3);
  g.release(r[1]);
  EXPECT_TRUE(f.holds(g.acquire(r[2]), r[2]));
  EXPECT_EQ(g.prefetched_acquires(), 2);
  EXPECT_EQ(g.gathered_acquires(), 1);
  // Both buffers held: the hint waits for a release.
  (void)g.acquire(r[0]);
  g.prefetch(r[3]);
  EXPECT_EQ(f.comm.collectives, 4);
  g.release(r[0]);
  EXPECT_EQ(f.comm.collectives, 5);
  g.release(r[2]);
  EXPECT_TRUE(f.holds(g.acquire(r[3]), r[3]));
  EXPECT_EQ(f.comm.collectives, 5);
  g.release(r[3]);
  // A wrong hint is dropped: the acquire gathers what it asks for, into either buffer.
  g.prefetch(r[1]);
  EXPECT_EQ(f.comm.collectives, 6);
  (void)g.acquire(r[0]);
  (void)g.acquire(r[2]);
  EXPECT_EQ(f.comm.collectives, 8);
  g.release(r[0]);
  g.release(r[2]);
  // An update between a hint and its acquire: the copy is dropped and the new weights gathered.
  g.prefetch(r[1]);
  EXPECT_EQ(f.comm.collectives, 9);
  f.slab.master().as<float>()[r[1].begin] += 1.0f;
  g.weights_changed();
  const void* fresh = g.acquire(r[1]);
  EXPECT_EQ(f.comm.collectives, 10);
  EXPECT_TRUE(f.holds(fresh, r[1]));
  g.release(r[1]);
  // A whole model drops a gathered copy (its ranges come from the whole model meanwhile).
  g.prefetch(r[2]);
  {
    trainer::WeightGather::WholeModel whole(g);
    g.prefetch(r[3]);  // ignored while the whole model lives
    EXPECT_EQ(g.acquire(r[2]), whole.full_weights() + r[2].begin);
    g.release(r[2]);
  }
  const int before = f.comm.collectives;
  (void)g.acquire(r[2]);
  EXPECT_EQ(f.comm.collectives, before + 1);
  g.release(r[2]);
  // Hints are checked as acquires are.
  EXPECT_THROW(g.prefetch(optim::Range{0, f.slab.layout().total_elements() + 1}), core::Error);
}

}  // namespace
