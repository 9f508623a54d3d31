// ZeRO-3's whole-model gather (WeightGather::WholeModel) on one cpu process: it holds the fp32
// weights bit for bit, and while it lives acquire() serves any number of ranges from it without a
// collective (an evaluation's ranks run different numbers of forwards); afterwards each acquire
// gathers again into the two range buffers. A second whole model, or one while a range is held,
// is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "optim/initialize.h"
#include "optim/slab.h"
#include "trainer/weight_gather.h"

namespace {

// One rank whose device collectives are counted (and, with one rank, complete in place).
class CountingCommunicator final : public comm::Communicator {
 public:
  CountingCommunicator() : Communicator(comm::Placement{}) {}
  int collectives = 0;

  void all_reduce(void*, core::DType, std::size_t, comm::ReduceOp, const char*) override { ++collectives; }
  void reduce_scatter(void*, core::DType, std::size_t, comm::ReduceOp, const char*) override { ++collectives; }
  void all_gather(void*, core::DType, std::size_t, const char*) override { ++collectives; }
  void broadcast(void*, core::DType, std::size_t, int, const char*) override { ++collectives; }
  void reduce_into(const void*, void*, core::DType, std::size_t, comm::ReduceOp, int, const char*) override {
    ++collectives;
  }
  void barrier(const char*) override {}
  double all_reduce_host(double value, comm::ReduceOp, const char*) override { return value; }
  std::vector<double> all_reduce_host(std::vector<double> values, comm::ReduceOp, const char*) override {
    return values;
  }
  std::vector<std::string> gather_strings(const std::string& mine, int, const char*) override { return {mine}; }
  std::string broadcast_string(const std::string& text, int, const char*) override { return text; }
  void synchronize() override {}
  void mark_first_step_done() override {}
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

}  // namespace
