// ZeRO-1/2's mirror gather after an update (trainer/gradient_sync.h, WeightSync): the chunks cover
// the slab in order, cut only between the ranges the model acquires, at most as many as the
// communicator keeps markers; on cuda each chunk is broadcast piece by piece by the ranks owning
// it, detached, and acquiring a range makes the compute stream wait for the marker of the last
// chunk it spans, once (a recording communicator stands in for the other rank).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "optim/slab.h"
#include "support/host_stub_communicator.h"
#include "support/test_support.h"
#include "trainer/gradient_sync.h"

namespace {

void expect_chunks_cover(const std::vector<optim::Range>& chunks, const std::vector<optim::Range>& ranges,
                         std::int64_t total, int max_chunks) {
  ASSERT_FALSE(chunks.empty());
  EXPECT_LE(static_cast<int>(chunks.size()), max_chunks);
  EXPECT_EQ(chunks.front().begin, 0);
  EXPECT_EQ(chunks.back().end, total);
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    EXPECT_FALSE(chunks[c].empty());
    if (c > 0) {
      EXPECT_EQ(chunks[c].begin, chunks[c - 1].end);
    }
    // A cut inside a range would make its acquire wait for a chunk too early or too late.
    for (const optim::Range& r : ranges) {
      EXPECT_FALSE(r.begin < chunks[c].begin && chunks[c].begin < r.end)
          << "chunk " << c << " starts inside [" << r.begin << ", " << r.end << ")";
    }
  }
}

TEST(WeightChunks, CoverTheSlabInOrderCutOnlyBetweenRanges) {
  const auto spec = models::family("qwen3").spec(models::base_shape(models::family("qwen3"), "qwen3-test"));
  const optim::SlabLayout layout(spec->parameters(), 2);
  const std::vector<optim::Range> ranges = spec->weight_ranges(layout);
  const std::int64_t total = layout.total_elements();
  for (int max_chunks : {1, 2, 3, 5, 16, 100}) {
    SCOPED_TRACE("max_chunks " + std::to_string(max_chunks));
    const std::vector<optim::Range> chunks = trainer::weight_chunks(ranges, total, max_chunks);
    expect_chunks_cover(chunks, ranges, total, max_chunks);
    if (max_chunks >= static_cast<int>(ranges.size()) + 2) {
      // Room for every range: each range's begin is a chunk boundary.
      for (const optim::Range& r : ranges) {
        EXPECT_TRUE(
            std::any_of(chunks.begin(), chunks.end(), [&](const optim::Range& c) { return c.begin == r.begin; }));
      }
    }
  }
}

TEST(WeightChunks, OneLargeRangeStaysWholeAndGapsAreCovered) {
  // A vocabulary-sized range first, small ranges after it, a gap before the last one.
  const std::vector<optim::Range> ranges = {{0, 1000}, {1000, 1010}, {1010, 1020}, {1020, 1030}, {1040, 1047}};
  const std::vector<optim::Range> chunks = trainer::weight_chunks(ranges, 1049, 4);
  expect_chunks_cover(chunks, ranges, 1049, 4);
  EXPECT_EQ(chunks.front(), (optim::Range{0, 1000}));
  EXPECT_EQ(trainer::weight_chunks({}, 7, 3), (std::vector<optim::Range>{{0, 7}}));
  EXPECT_TRUE(trainer::weight_chunks(ranges, 0, 3).empty());
}

// Rank 0 of two: records the device collectives' roots and spans, hands out markers and records
// which the compute stream waits for.
class RecordingCommunicator final : public test::HostStubCommunicator {
 public:
  RecordingCommunicator() : HostStubCommunicator(comm::Placement{.rank = 0, .world = 2}) {}
  struct Broadcast {
    const void* data;
    std::size_t count;
    int root;
    bool detached;
  };
  std::vector<Broadcast> broadcasts;
  std::vector<std::uint64_t> waits;
  std::uint64_t markers = 0;
  bool detached = false;
  int other = 0;

  void set_detached(bool d) override { detached = d; }
  std::uint64_t marker() override { return ++markers; }
  void wait_for(std::uint64_t m) override { waits.push_back(m); }
  void broadcast(void* data, core::DType, std::size_t count, int root, const char*) override {
    broadcasts.push_back({data, count, root, detached});
  }
  void all_reduce(void*, core::DType, std::size_t, comm::ReduceOp, const char*) override { ++other; }
  void reduce_scatter(void*, core::DType, std::size_t, comm::ReduceOp, const char*) override { ++other; }
  void all_gather(void*, core::DType, std::size_t, const char*) override { ++other; }
  void reduce_into(const void*, void*, core::DType, std::size_t, comm::ReduceOp, int, const char*) override { ++other; }
};

TEST(WeightSyncGpu, ChunksArriveInOrderAndEachAcquireWaitsForItsLastChunk) {
  REQUIRE_GPU();
  const core::DeviceContext gpu(core::Device::cuda(0));
  const auto spec = models::family("qwen3").spec(models::base_shape(models::family("qwen3"), "qwen3-test"));
  for (int stage : {1, 2}) {
    SCOPED_TRACE("ZeRO-" + std::to_string(stage));
    optim::Slab slab(optim::SlabLayout(spec->parameters(), 2), gpu, {.rank = 0, .zero_stage = stage});
    const std::vector<optim::Range> ranges = spec->weight_ranges(slab.layout());
    RecordingCommunicator comm;
    trainer::WeightSync sync(comm, slab, gpu, ranges);
    ASSERT_EQ(sync.source(), &sync);
    EXPECT_EQ(sync.full_weights(), nullptr);
    const std::vector<optim::Range>& chunks = sync.chunks();
    expect_chunks_cover(chunks, ranges, slab.layout().total_elements(), static_cast<int>(comm::Communicator::kMarkers));

    sync.gather();
    EXPECT_EQ(comm.other, 0);  // no whole-mirror all-gather
    EXPECT_EQ(comm.markers, chunks.size());
    // Every broadcast is detached, by the owner of its piece, in slab order, covering everything.
    const auto* mirror = static_cast<const std::byte*>(slab.mirror_origin());
    const std::size_t element = core::dtype_size(slab.mirror_dtype());
    std::int64_t next = 0;
    for (const auto& b : comm.broadcasts) {
      EXPECT_TRUE(b.detached);
      const std::int64_t begin = (static_cast<const std::byte*>(b.data) - mirror) / static_cast<std::int64_t>(element);
      EXPECT_EQ(begin, next);
      const optim::Range piece{begin, begin + static_cast<std::int64_t>(b.count)};
      EXPECT_TRUE(slab.layout().shard(b.root).contains(piece));
      next = piece.end;
    }
    EXPECT_EQ(next, slab.layout().total_elements());

    // In the forward's order: each acquire waits for the marker of its last chunk, and only when
    // that is later than what the stream already waited for.
    std::uint64_t waited = 0;
    for (const optim::Range& r : ranges) {
      const auto* data = static_cast<const std::byte*>(sync.acquire(r));
      EXPECT_EQ(data, mirror + static_cast<std::size_t>(r.begin) * element);
      std::size_t last = 0;
      while (chunks[last].end < r.end) ++last;
      const std::uint64_t expected = last + 1;  // the markers were 1, 2, ... in chunk order
      if (expected > waited) {
        ASSERT_FALSE(comm.waits.empty());
        EXPECT_EQ(comm.waits.back(), expected);
        waited = expected;
      }
      sync.release(r);
    }
    const std::size_t waits = comm.waits.size();
    (void)sync.acquire(ranges.front());  // already waited for: no new wait
    EXPECT_EQ(comm.waits.size(), waits);
    sync.wait_all();
    EXPECT_EQ(comm.waits.back(), chunks.size());
    EXPECT_THROW((void)sync.acquire({0, slab.layout().total_elements() + 1}), core::Error);

    // The next update's chunks get new markers, waited for again.
    sync.gather();
    (void)sync.acquire(ranges.front());
    EXPECT_GT(comm.waits.back(), chunks.size());
  }
}

}  // namespace
