// Slab layout invariants over many world sizes and odd tensor lists, segment and chunk tables,
// and the slab's views on the cpu backend (gradients sharded under ZeRO-2 included).
#include <algorithm>
#include <cstdint>
#include <numeric>

#include <gtest/gtest.h>

#include "core/error.h"
#include "core/half.h"
#include "optim/segments.h"
#include "optim/slab.h"
#include "optim/slab_layout.h"
#include "support/test_support.h"

namespace {

using optim::ParamSpec;
using optim::Range;
using optim::SlabLayout;

const int kWorldSizes[] = {1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 64, 100, 1000};

void check_layout(const std::vector<ParamSpec>& specs, int world) {
  const SlabLayout layout(specs, world);
  const SlabLayout reference(specs, 1);
  const auto& tensors = layout.tensors();
  ASSERT_EQ(tensors.size(), specs.size());
  std::int64_t cursor = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    EXPECT_EQ(t.spec.name, specs[i].name);
    EXPECT_EQ(t.numel, core::shape_numel(specs[i].shape));
    EXPECT_EQ(t.offset % optim::kTensorAlignment, 0) << t.spec.name;
    EXPECT_GE(t.offset, cursor) << "tensors overlap or are out of order at " << t.spec.name;
    EXPECT_LT(t.offset - cursor, optim::kTensorAlignment) << "more padding than alignment needs";
    EXPECT_EQ(t.offset, reference.tensors()[i].offset) << "offset depends on the world size";
    cursor = t.offset + t.numel;
  }
  EXPECT_GE(layout.used_elements(), cursor);
  EXPECT_EQ(layout.used_elements(), reference.used_elements());
  EXPECT_GE(layout.total_elements(), layout.used_elements());
  EXPECT_EQ(layout.total_elements() % (static_cast<std::int64_t>(world) * optim::kShardBlock), 0);
  EXPECT_LT(layout.total_elements() - std::max<std::int64_t>(layout.used_elements(), 1),
            static_cast<std::int64_t>(world) * optim::kShardBlock)
      << "more tail padding than needed";

  // Shards: whole 256-blocks, a partition of [0, total).
  std::int64_t next = 0;
  std::vector<std::int64_t> covered(tensors.size(), 0);
  for (int r = 0; r < world; ++r) {
    const Range s = layout.shard(r);
    EXPECT_EQ(s.begin, next);
    EXPECT_EQ(s.size() % optim::kShardBlock, 0);
    EXPECT_EQ(s.size(), layout.shard_elements());
    next = s.end;
    for (const auto& seg : optim::make_segments(layout, s)) {
      EXPECT_TRUE(s.contains({seg.offset, seg.offset + seg.length}));
      EXPECT_EQ(seg.offset % 64, 0);
      covered[static_cast<std::size_t>(seg.tensor)] += seg.length;
    }
  }
  EXPECT_EQ(next, layout.total_elements());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(covered[i], tensors[i].numel) << "shards do not cover tensor " << tensors[i].spec.name << " exactly once";
  }
}

// Parts: stored tensors unchanged, the logical tensors back to back inside them, each seen by the
// segment table as its own tensor on every shard; misaligned parts stay one tensor and are named.
TEST(SlabLayout, PartsAreSeparateTensorsToTheOptimizers) {
  std::vector<ParamSpec> specs = {
      {.name = "norm", .shape = {7}},
      {.name = "qkv", .shape = {48, 64}, .factored = true, .parts = {{"q", 32}, {"k", 8}, {"v", 8}}},
      {.name = "gate_up", .shape = {6, 24}, .factored = true, .parts = {{"gate", 3}, {"up", 3}}},
      {.name = "down", .shape = {24, 3}}};
  for (int world : {1, 2, 3, 7}) {
    const SlabLayout layout(specs, world);
    ASSERT_EQ(layout.tensors().size(), 4u);
    ASSERT_EQ(layout.parameters().size(), 6u);  // norm, q, k, v, gate_up (3 * 24 = 72: unsplit), down
    EXPECT_EQ(layout.unsplit(), std::vector<std::string>{"gate_up"});
    const auto& qkv = layout.tensor("qkv");
    const auto& p = layout.parameters();
    EXPECT_EQ(p[1].spec.name, "q");
    EXPECT_EQ(p[1].offset, qkv.offset);
    EXPECT_EQ(p[2].offset, qkv.offset + 32 * 64);
    EXPECT_EQ(p[3].offset, qkv.offset + 40 * 64);
    EXPECT_EQ(p[3].spec.shape, (core::Shape{8, 64}));
    EXPECT_TRUE(p[2].spec.factored);
    EXPECT_EQ(p[2].stored, 1);
    EXPECT_EQ(p[4].spec.name, "gate_up");
    std::vector<std::int64_t> covered(p.size(), 0);
    for (int r = 0; r < world; ++r) {
      for (const auto& seg : optim::make_segments(layout, layout.shard(r))) {
        const auto& t = p[static_cast<std::size_t>(seg.tensor)];
        EXPECT_TRUE(t.range().contains({seg.offset, seg.offset + seg.length}));
        EXPECT_EQ(seg.tensor_offset, t.offset);
        if (t.spec.factored) EXPECT_EQ(seg.rows, t.spec.shape[0]);
        covered[static_cast<std::size_t>(seg.tensor)] += seg.length;
      }
    }
    for (std::size_t i = 0; i < p.size(); ++i) EXPECT_EQ(covered[i], p[i].numel) << p[i].spec.name;
  }
  specs[1].parts[2].rows = 9;
  EXPECT_THROW(SlabLayout(specs, 1), core::Error);
  specs[1].parts[2] = {"q", 8};
  EXPECT_THROW(SlabLayout(specs, 1), core::Error);
}

TEST(SlabLayout, InvariantsOverWorldSizesAndRandomTensorLists) {
  std::mt19937_64 rng(test::fresh_seed());
  for (int trial = 0; trial < 40; ++trial) {
    const auto specs = test::random_specs(rng, 1 + trial % 23);
    for (int world : kWorldSizes) {
      SCOPED_TRACE("trial " + std::to_string(trial) + ", world " + std::to_string(world));
      check_layout(specs, world);
    }
  }
}

TEST(SlabLayout, EdgeCases) {
  check_layout({}, 1);
  check_layout({}, 7);
  check_layout({{.name = "empty", .shape = {0}}}, 3);
  check_layout({{.name = "one", .shape = {1}}}, 4);
  check_layout({{.name = "scalar", .shape = {}}}, 2);
  check_layout({{.name = "a", .shape = {0, 5}}, {.name = "b", .shape = {1}}, {.name = "c", .shape = {0}}}, 5);
  const SlabLayout l({{.name = "a", .shape = {3}}, {.name = "b", .shape = {64}}, {.name = "c", .shape = {1}}}, 1);
  EXPECT_EQ(l.tensors()[1].offset, 64);
  EXPECT_EQ(l.tensors()[2].offset, 128);
  EXPECT_EQ(l.used_elements(), 192);
  EXPECT_EQ(l.total_elements(), 256);
  EXPECT_EQ(l.parameter_count(), 68);
  EXPECT_EQ(l.find("b"), 1);
  EXPECT_EQ(l.find("zz"), -1);
  EXPECT_THROW(l.tensor("zz"), core::Error);
}

TEST(SlabLayout, LargeTensorsUse64BitOffsets) {
  // Layout arithmetic only: 2^31 + 1 elements are never allocated here.
  const std::int64_t big = (std::int64_t{1} << 31) + 1;
  const SlabLayout l({{.name = "big", .shape = {big}}, {.name = "after", .shape = {10}}}, 3);
  EXPECT_EQ(l.tensors()[1].offset, (std::int64_t{1} << 31) + 64);
  EXPECT_EQ(l.total_elements() % (3 * 256), 0);
  check_layout({{.name = "big", .shape = {big}}, {.name = "after", .shape = {10}}}, 3);
}

TEST(SlabLayout, RejectsBadSpecs) {
  EXPECT_THROW(SlabLayout({{.name = "a", .shape = {1}}, {.name = "a", .shape = {2}}}, 1), core::Error);
  EXPECT_THROW(SlabLayout({{.name = "", .shape = {1}}}, 1), core::Error);
  EXPECT_THROW(SlabLayout({{.name = "a", .shape = {-1}}}, 1), core::Error);
  EXPECT_THROW(SlabLayout({{.name = "a", .shape = {4}, .factored = true}}, 1), core::Error);
  EXPECT_THROW(SlabLayout({{.name = "a", .shape = {1}}}, 0), core::Error);
  EXPECT_THROW(SlabLayout({{.name = "a", .shape = {1}}}, 1).shard(1), core::Error);
}

TEST(WorkChunks, CoverEverySegmentExactly) {
  std::mt19937_64 rng(test::fresh_seed());
  for (int trial = 0; trial < 20; ++trial) {
    const SlabLayout layout(test::random_specs(rng, 17, 40000), 1);
    const auto segments = optim::make_segments(layout, {0, layout.total_elements()});
    for (std::int64_t chunk : {64, 128, 1024, 16384}) {
      const auto chunks = optim::make_work_chunks(segments, chunk);
      std::vector<std::int64_t> covered(segments.size(), 0);
      std::int64_t previous_end = -1;
      for (const auto& c : chunks) {
        const auto& s = segments[static_cast<std::size_t>(c.segment)];
        EXPECT_GT(c.length, 0);
        EXPECT_LE(c.length, chunk);
        EXPECT_EQ(c.offset % 4, 0);
        EXPECT_GE(c.offset, s.offset);
        EXPECT_LE(c.offset + c.length, s.offset + s.length);
        EXPECT_GE(c.offset, previous_end);
        previous_end = c.offset + c.length;
        covered[static_cast<std::size_t>(c.segment)] += c.length;
      }
      for (std::size_t i = 0; i < segments.size(); ++i) EXPECT_EQ(covered[i], segments[i].length);
    }
  }
  EXPECT_THROW(optim::make_work_chunks({}, 100), core::Error);
  EXPECT_THROW(optim::make_work_chunks({}, 0), core::Error);
}

TEST(Slab, CpuViewsAndShardedMaster) {
  core::DeviceContext cpu(core::Device::cpu());
  const std::vector<ParamSpec> specs = {{.name = "w", .shape = {10, 30}},
                                        {.name = "n", .shape = {7}, .decay = false},
                                        {.name = "e", .shape = {300}},
                                        {.name = "f", .shape = {200}}};
  optim::Slab full(SlabLayout(specs, 1), cpu);
  EXPECT_EQ(full.owned(), full.full());
  auto w = full.master_view(0);
  EXPECT_EQ(w.numel(), 300);
  EXPECT_EQ(w.shape, (core::Shape{10, 30}));
  EXPECT_EQ(w.as<float>(), full.master().as<float>());
  EXPECT_EQ(full.grad_view(2).as<float>(), full.grad().as<float>() + 384);
  EXPECT_EQ(full.mirror_view(1).dtype, core::DType::bf16);
  EXPECT_EQ(full.segments().size(), 4u);
  EXPECT_EQ(full.segments()[1].decay, 0.0f);
  for (float x : test::to_host<float>(full.master())) EXPECT_EQ(x, 0.0f);

  // ZeRO-1 on 2 ranks: total 1024, shards [0,512) and [512,1024): tensor "e" [384,684) is cut,
  // tensor "f" [704,904) is wholly rank 1's.
  optim::Slab rank1(SlabLayout(specs, 2), cpu, {.rank = 1, .zero_stage = 1});
  EXPECT_EQ(rank1.owned(), (Range{512, 1024}));
  EXPECT_EQ(rank1.master().bytes(), 512 * sizeof(float));
  EXPECT_EQ(rank1.master_view(3).as<float>(), rank1.master().as<float>() + (704 - 512));
  EXPECT_THROW(rank1.master_view(2), core::Error);
  EXPECT_THROW(rank1.master_view(0), core::Error);
  ASSERT_EQ(rank1.segments().size(), 2u);
  EXPECT_EQ(rank1.segments()[0].offset, 512);
  EXPECT_EQ(rank1.segments()[0].length, 684 - 512);
  EXPECT_EQ(rank1.segments()[0].tensor_offset, 384);
  EXPECT_NO_THROW(rank1.grad_view(0));
  EXPECT_THROW(optim::Slab(SlabLayout(specs, 2), cpu, {.rank = 2, .zero_stage = 1}), core::Error);
  EXPECT_THROW(optim::Slab(SlabLayout(specs, 1), cpu, {.zero_stage = 4}), core::Error);
  EXPECT_THROW(optim::Slab(SlabLayout(specs, 1), cpu, {.zero_stage = 1, .shard_gradients = true}), core::Error);

  // ZeRO-3: the mirror is the owned shard too, addressed by global element through its origin.
  optim::Slab zero3(SlabLayout(specs, 2), cpu, {.rank = 1, .zero_stage = 3});
  EXPECT_EQ(zero3.mirror_covers(), (Range{512, 1024}));
  EXPECT_EQ(zero3.mirror().bytes(), 512 * sizeof(std::uint16_t));
  EXPECT_EQ(static_cast<std::uint16_t*>(zero3.mirror_origin()) + 512, zero3.mirror().as<std::uint16_t>());
  EXPECT_EQ(zero3.grad_covers(), zero3.full());
  EXPECT_THROW(zero3.mirror_view(0), core::Error);
  EXPECT_NO_THROW(zero3.mirror_view(3));
  const optim::SlabCoverage coverage = optim::slab_coverage(SlabLayout(specs, 2), {.rank = 1, .zero_stage = 3});
  EXPECT_EQ(coverage.mirror, zero3.mirror_covers());
  EXPECT_EQ(coverage.owned, zero3.owned());
}

TEST(Slab, WriteMirrorRoundsMaster) {
  core::DeviceContext cpu(core::Device::cpu());
  std::mt19937_64 rng(test::fresh_seed());
  for (core::DType dtype : {core::DType::bf16, core::DType::f16}) {
    optim::Slab slab(SlabLayout(test::random_specs(rng, 9), 1), cpu, {.mirror_dtype = dtype});
    const auto master = test::random_normal(rng, slab.master().bytes() / 4, 3.0f);
    test::from_host(slab.master(), master);
    slab.write_mirror(cpu);
    const auto mirror = test::to_host<std::uint16_t>(slab.mirror());
    for (std::size_t i = 0; i < master.size(); ++i) {
      const std::uint16_t expected =
          dtype == core::DType::bf16 ? core::float_to_bf16(master[i]) : core::float_to_fp16(master[i]);
      ASSERT_EQ(mirror[i], expected) << i;
    }
  }
}

TEST(Slab, ShardedGradientsCoverTheOwnedRange) {
  core::DeviceContext cpu(core::Device::cpu());
  const std::vector<ParamSpec> specs = {{.name = "w", .shape = {10, 30}},
                                        {.name = "n", .shape = {7}, .decay = false},
                                        {.name = "e", .shape = {300}},
                                        {.name = "f", .shape = {200}}};
  // Only ZeRO-2 may shard the gradients; the error names the option.
  for (int stage : {0, 1}) {
    try {
      optim::Slab bad(SlabLayout(specs, 2), cpu, {.rank = 1, .zero_stage = stage, .shard_gradients = true});
      ADD_FAILURE() << "shard_gradients accepted with zero_stage " << stage;
    } catch (const core::Error& e) {
      EXPECT_NE(std::string(e.what()).find("shard_gradients"), std::string::npos) << e.what();
    }
  }

  // ZeRO-2 on 2 ranks, rank 1 owns [512, 1024): "e" [384, 684) is cut, "f" [704, 904) is wholly its own.
  optim::Slab sharded(SlabLayout(specs, 2), cpu, {.rank = 1, .zero_stage = 2, .shard_gradients = true});
  EXPECT_TRUE(sharded.shard_gradients());
  EXPECT_EQ(sharded.grad_covers(), sharded.owned());
  EXPECT_EQ(sharded.grad_covers(), (Range{512, 1024}));
  EXPECT_EQ(sharded.grad().bytes(), static_cast<std::size_t>(sharded.owned().size()) * sizeof(float));
  EXPECT_EQ(sharded.mirror().bytes(), 1024 * sizeof(std::uint16_t));  // the mirror still spans the slab
  EXPECT_EQ(sharded.grad_view(3).as<float>(), sharded.grad().as<float>() + (704 - 512));
  EXPECT_THROW(sharded.grad_view(2), core::Error);  // cut by the shard boundary
  EXPECT_THROW(sharded.grad_view(0), core::Error);  // rank 0's
  // The origin is owned().begin elements before the buffer: origin[i] is global element i.
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(sharded.grad_origin()) + 512 * sizeof(float),
            reinterpret_cast<std::uintptr_t>(sharded.grad().data()));
  const optim::Slab& read_only = sharded;
  EXPECT_EQ(read_only.grad_origin(), sharded.grad_origin());
  for (float x : test::to_host<float>(sharded.grad())) EXPECT_EQ(x, 0.0f);

  // ZeRO-2 without it: gradients over the whole slab, origin at the buffer's start.
  optim::Slab full(SlabLayout(specs, 2), cpu, {.rank = 1, .zero_stage = 2});
  EXPECT_FALSE(full.shard_gradients());
  EXPECT_EQ(full.grad_covers(), full.full());
  EXPECT_EQ(full.grad().bytes(), 1024 * sizeof(float));
  EXPECT_EQ(full.grad_origin(), full.grad().as<float>());
  EXPECT_EQ(full.grad_view(2).as<float>(), full.grad().as<float>() + 384);
}

}  // namespace
