// The decode megakernel's plan (decode_megakernel_plan.h), on the host: every row of every matrix
// phase belongs to exactly one unit per layer, the pages of a unit cover its rows or cache
// positions exactly once and fit a page, attention chunks cover [0, position] with exactly one
// chunk holding the current position, every block's list is in dependency-rank order, and the
// shared-memory layout keeps its areas apart.
#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "models/qwen3/decode_megakernel_plan.h"

namespace {

namespace mk = models::qwen3::megakernel;

mk::Dims dims(int vocab, int hidden, int ffn, int layers, int heads, int kv_heads, int head_dim) {
  mk::Dims d;
  d.hidden = hidden;
  d.q_size = heads * head_dim;
  d.kv_size = kv_heads * head_dim;
  d.qkv_size = d.q_size + 2 * d.kv_size;
  d.ffn = ffn;
  d.vocab = vocab;
  d.layers = layers;
  d.heads = heads;
  d.kv_heads = kv_heads;
  d.head_dim = head_dim;
  d.group = heads / kv_heads;
  d.eps = 1e-6f;
  return d;
}

mk::Geometry geometry(int blocks, int warps, int page_bytes, int pages, int splits, int min_chunk) {
  return {blocks, warps, page_bytes, pages, splits, min_chunk};
}

int rows_of(mk::UnitKind kind, const mk::Dims& d) {
  switch (kind) {
    case mk::UnitKind::qkv: return d.qkv_size;
    case mk::UnitKind::gate_up: return d.ffn;
    case mk::UnitKind::lm_head: return d.vocab;
    default: return d.hidden;
  }
}

void check_schedule(const mk::Dims& d, const mk::Geometry& g) {
  ASSERT_EQ(mk::check_geometry(d, g), "");
  const mk::Schedule s = mk::build_schedule(d, g);
  ASSERT_EQ(s.block_begin.size(), static_cast<std::size_t>(g.blocks + 1));
  // Rows covered once per (kind, layer); pages cover each unit's rows once and fit.
  std::map<std::pair<int, int>, std::vector<int>> covered;
  std::vector<int> attention_seen(static_cast<std::size_t>(d.layers), 0);
  int argmax = 0;
  for (int b = 0; b < g.blocks; ++b) {
    int last_rank = -1;
    for (int i = s.block_begin[b]; i < s.block_begin[b + 1]; ++i) {
      const mk::Unit& u = s.units[static_cast<std::size_t>(i)];
      const int rank = mk::unit_rank(u);
      EXPECT_LE(last_rank, rank) << "block " << b << " out of rank order";
      last_rank = rank;
      if (u.kind == mk::UnitKind::argmax) {
        ++argmax;
        continue;
      }
      if (u.kind == mk::UnitKind::attention) {
        ++attention_seen[u.layer];
        EXPECT_EQ(b, u.index % g.blocks);
        continue;
      }
      auto& rows = covered[{static_cast<int>(u.kind), u.layer}];
      rows.resize(static_cast<std::size_t>(rows_of(u.kind, d)), 0);
      for (int r = u.a; r < u.b; ++r) ++rows[static_cast<std::size_t>(r)];
      const int pages = mk::unit_pages(u, 0, g, d);
      int next = 0;
      for (int k = 0; k < pages; ++k) {
        const mk::Span span = mk::page_span(u, 0, k, g, d);
        EXPECT_EQ(span.first, next);
        EXPECT_GE(span.count, 1);
        EXPECT_LE(span.count * mk::row_bytes(u.kind, d), g.page_bytes);
        next += span.count;
      }
      EXPECT_EQ(next, u.b - u.a);
    }
  }
  EXPECT_EQ(argmax, 1);
  for (const auto& [key, rows] : covered) {
    for (int v : rows) EXPECT_EQ(v, 1) << "kind " << key.first << " layer " << key.second;
  }
  EXPECT_EQ(covered.size(), static_cast<std::size_t>(4 * d.layers + 1));
  for (int seen : attention_seen) EXPECT_EQ(seen, s.attention_slots);
  // Group counts: the qkv units touching each kv head's rows.
  for (int grp = 0; grp < d.kv_heads; ++grp) EXPECT_GE(s.group_counts[static_cast<std::size_t>(grp)], 1);
  // Shared memory areas in order, the vector planes 16-byte aligned.
  const mk::SmemLayout m = mk::layout_smem(d, g, s);
  EXPECT_GE(m.barriers, g.pages * g.page_bytes);
  EXPECT_GE(m.vec, m.barriers + 16 * g.pages);
  EXPECT_EQ(m.vec % 16, 0);
  EXPECT_EQ(m.vec_floats % 8, 0);
  EXPECT_GE(m.vec_floats, std::max({d.hidden, d.q_size, d.ffn}));
  EXPECT_GE(m.small, m.vec + 4 * m.vec_floats);
  EXPECT_GE(m.vec_floats, (2 * d.group + 4) * d.head_dim + (g.consumer_warps + d.group) * (d.head_dim + 2) +
                              2 * d.group * g.max_splits);
  EXPECT_GE(m.merge_floats, 2 * s.lm_units);
}

TEST(MegakernelPlan, SchedulesCoverEveryRowOnce) {
  check_schedule(dims(151936, 1024, 3072, 28, 16, 8, 128), geometry(132, 8, 32768, 6, 16, 128));
  check_schedule(dims(151936, 2048, 6144, 28, 16, 8, 128), geometry(132, 8, 32768, 5, 16, 128));
  check_schedule(dims(61, 64, 96, 2, 4, 2, 64), geometry(2, 2, 8192, 3, 2, 8));
  check_schedule(dims(301, 328, 200, 2, 4, 4, 64), geometry(3, 1, 16384, 2, 3, 8));
  check_schedule(dims(257, 96, 64, 1, 8, 1, 128), geometry(17, 11, 16384, 4, 32, 1));
  check_schedule(dims(1000, 136, 232, 2, 8, 2, 64), geometry(200, 4, 8192, 3, 5, 16));  // more blocks than rows
}

TEST(MegakernelPlan, AttentionChunksCoverTheContext) {
  const mk::Dims d = dims(100, 64, 64, 1, 4, 2, 64);
  for (const mk::Geometry& g : {geometry(4, 4, 8192, 3, 5, 16), geometry(4, 8, 32768, 3, 16, 128),
                                geometry(4, 2, 16384, 3, 3, 1), geometry(4, 2, 8192, 3, 1, 1)}) {
    for (std::int64_t position = 0; position < 3000; position += (position < 300 ? 1 : 97)) {
      std::vector<int> seen(static_cast<std::size_t>(position + 1), 0);
      int holders = 0;
      for (int chunk = 0; chunk < g.max_splits; ++chunk) {
        mk::Unit u;
        u.kind = mk::UnitKind::attention;
        u.a = 1;
        u.b = chunk;
        const mk::AttentionRange r = mk::attention_range(u, position, g, d);
        if (!r.active) continue;
        if (r.holds_current) {
          ++holders;
          ++seen[static_cast<std::size_t>(position)];
        }
        std::int64_t next = r.first;
        for (int k = 0; k < mk::unit_pages(u, position, g, d); ++k) {
          const mk::Span span = mk::page_span(u, position, k, g, d);
          EXPECT_EQ(span.first, next);
          EXPECT_GE(span.count, 1);
          EXPECT_LE(span.count, mk::positions_per_page(g, d));
          for (int i = 0; i < span.count; ++i) ++seen[static_cast<std::size_t>(span.first + i)];
          next += span.count;
        }
        EXPECT_EQ(next, r.end);
      }
      EXPECT_EQ(holders, 1) << "position " << position;
      for (std::size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << "position " << position << " row " << i;
      EXPECT_LE(mk::attention_chunking(position, g, d).splits, g.max_splits);
    }
  }
}

TEST(MegakernelPlan, GeometryErrorsSayWhy) {
  const mk::Dims d = dims(151936, 2048, 6144, 28, 16, 8, 128);
  EXPECT_NE(mk::check_geometry(d, geometry(132, 8, 8192, 6, 16, 128)), "");  // a down row is 12 KB
  EXPECT_NE(mk::check_geometry(d, geometry(132, 12, 32768, 6, 16, 128)), "");
  EXPECT_NE(mk::check_geometry(d, geometry(132, 8, 32768, 1, 16, 128)), "");
  EXPECT_EQ(mk::check_geometry(d, geometry(132, 8, 16384, 6, 16, 128)), "");
  mk::Geometry g = geometry(132, 8, 32768, 6, 16, 128);
  for (int inflight : {0, 1, 6}) {
    g.inflight = inflight;
    EXPECT_EQ(mk::check_geometry(d, g), "") << inflight;
  }
  for (int inflight : {-1, 7}) {
    g.inflight = inflight;
    EXPECT_NE(mk::check_geometry(d, g), "") << inflight;
  }
}

}  // namespace
