// Shared by the optimizer test suites: under ZeRO-2 a slab whose gradient buffer covers only the
// owned shard (SlabOptions::shard_gradients) steps bit for bit like the same rank's slab with a
// gradient buffer over the whole slab, and neither reads a gradient outside the owned range.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "optim/optimizer.h"
#include "support/test_support.h"

namespace test {

// Tensors for every path. Rank 1 of 3 owns [18688, 37376): "embed" is cut mid-row at its start
// and "w2" mid-row at its end (factored, columns a multiple of 4: Adafactor's float4 tiles), a
// 256-element block holds the tail of "w1", the small "bias" and the head of "w2" (adamw8bit).
// Rank 1 of 2 owns [27904, 55808): "w1" is cut mid-row (131 columns: the scalar tiles), and the
// shard ends in padding. Small tensors (< 4096 elements) take adamw8bit's fp32 path.
inline std::vector<optim::ParamSpec> sharded_grads_specs() {
  return {{.name = "embed", .shape = {203, 100}, .factored = true},
          {.name = "norm1", .shape = {64}, .decay = false},
          {.name = "w1", .shape = {97, 131}, .factored = true},
          {.name = "bias", .shape = {5}, .decay = false},
          {.name = "w2", .shape = {128, 36}, .factored = true, .lr_scale = 0.5f},
          {.name = "big", .shape = {9001}},
          {.name = "one", .shape = {1}},
          {.name = "empty", .shape = {0}},
          {.name = "row", .shape = {1, 300}, .factored = true},
          {.name = "tall", .shape = {700, 3}, .factored = true},
          {.name = "small", .shape = {130}, .lr_scale = 0.25f},
          {.name = "w4", .shape = {61, 67}, .factored = true},
          {.name = "w5", .shape = {45, 44}, .factored = true}};
}

// Index of the first byte where two buffers' contents differ, or -1 (sizes must match too).
inline std::int64_t first_difference(const core::Buffer& a, const core::Buffer& b, std::size_t a_offset = 0,
                                     std::size_t b_offset = 0, std::size_t bytes = SIZE_MAX) {
  const auto ha = test::to_host<std::uint8_t>(a);
  const auto hb = test::to_host<std::uint8_t>(b);
  if (bytes == SIZE_MAX) {
    if (ha.size() != hb.size()) return 0;
    bytes = ha.size();
  }
  if (a_offset + bytes > ha.size() || b_offset + bytes > hb.size()) return 0;
  for (std::size_t i = 0; i < bytes; ++i) {
    if (ha[a_offset + i] != hb[b_offset + i]) return static_cast<std::int64_t>(i);
  }
  return -1;
}

// Rank `rank` of `world` under ZeRO-2, twice on `device`: slab A with gradients over the whole
// slab, slab B with shard_gradients. Same master; each of 3 steps fills all of A's gradient
// buffer (outside the owned range with large values and a few non-finite ones, which must reach
// neither the norm nor the update) and copies its owned range into B. Clipping is active. After
// every step master, optimizer state, the owned mirror and the report are identical, the
// gradients of every owned tensor element are zero in both, and nothing else of either
// gradient buffer has changed.
inline void check_sharded_gradients_match_full(core::Device device, const optim::OptimizerConfig& config, int world,
                                               int rank, std::int64_t chunk_elements = 1024) {
  const std::string where =
      config.type + " on " + device.str() + ", world " + std::to_string(world) + ", rank " + std::to_string(rank);
  SCOPED_TRACE(where);
  ASSERT_GT(config.grad_clip, 0.0) << "the check wants clipping active";
  std::mt19937_64 rng(test::fresh_seed());
  const optim::SlabLayout layout(sharded_grads_specs(), world);
  const core::DType mirror_dtype = world % 2 ? core::DType::bf16 : core::DType::f16;
  core::DeviceContext context(device);
  optim::Slab a(layout, context, {.rank = rank, .zero_stage = 2, .mirror_dtype = mirror_dtype});
  optim::Slab b(layout, context,
                {.rank = rank, .zero_stage = 2, .mirror_dtype = mirror_dtype, .shard_gradients = true});
  const optim::Range owned = a.owned();
  ASSERT_EQ(a.grad_covers(), a.full());
  ASSERT_EQ(b.grad_covers(), owned);
  ASSERT_EQ(b.grad().bytes(), static_cast<std::size_t>(owned.size()) * sizeof(float));
  const auto opt_a = optim::make_optimizer(config, a, context, chunk_elements);
  const auto opt_b = optim::make_optimizer(config, b, context, chunk_elements);

  const auto master = test::random_normal(rng, static_cast<std::size_t>(owned.size()));
  test::from_host(a.master(), master);
  test::from_host(b.master(), master);
  a.write_mirror(context);
  b.write_mirror(context);

  const auto total = static_cast<std::size_t>(layout.total_elements());
  const auto owned_begin = static_cast<std::size_t>(owned.begin), owned_end = static_cast<std::size_t>(owned.end);
  const std::size_t mirror_bytes = core::dtype_size(mirror_dtype);
  for (int step = 1; step <= 3; ++step) {
    const std::string at = "step " + std::to_string(step);
    auto g = test::random_normal(rng, total, step == 2 ? 3.0f : 0.5f);  // padding and gaps get values too
    std::vector<std::size_t> outside;
    for (std::size_t i = 0; i < total; ++i) {
      if (i < owned_begin || i >= owned_end) {
        g[i] *= 1e4f;
        outside.push_back(i);
      }
    }
    ASSERT_FALSE(outside.empty());
    for (int k = 0; k < 4; ++k) g[outside[rng() % outside.size()]] = k % 2 ? NAN : -INFINITY;
    test::from_host(a.grad(), g);
    test::from_host(b.grad(), std::vector<float>(g.begin() + owned.begin, g.begin() + owned.end));
    opt_a->step(config.lr);
    opt_b->step(config.lr);

    const auto ra = opt_a->report(), rb = opt_b->report();
    EXPECT_FALSE(ra.skipped) << at << ": a gradient outside the owned range was read";
    EXPECT_EQ(ra.nonfinite, 0u) << at;
    EXPECT_GT(ra.grad_norm, config.grad_clip) << at << ": clipping is not active";
    EXPECT_EQ(std::memcmp(&ra.grad_norm, &rb.grad_norm, sizeof(double)), 0)
        << at << ": " << ra.grad_norm << " vs " << rb.grad_norm;
    EXPECT_EQ(ra.step, step) << at;
    EXPECT_EQ(rb.step, ra.step) << at;
    EXPECT_EQ(rb.skipped_steps, ra.skipped_steps) << at;
    EXPECT_EQ(rb.nonfinite, ra.nonfinite) << at;

    EXPECT_EQ(first_difference(a.master(), b.master()), -1) << at << ": master (byte offset)";
    const auto state_a = opt_a->state_buffers(), state_b = opt_b->state_buffers();
    ASSERT_EQ(state_a.size(), state_b.size());
    for (std::size_t k = 0; k < state_a.size(); ++k) {
      EXPECT_EQ(first_difference(*state_a[k].buffer, *state_b[k].buffer), -1) << at << ": state " << state_a[k].name;
    }
    EXPECT_EQ(first_difference(a.mirror(), b.mirror(), owned_begin * mirror_bytes, owned_begin * mirror_bytes,
                               (owned_end - owned_begin) * mirror_bytes),
              -1)
        << at << ": owned mirror";

    // Owned tensor elements zeroed, gaps and padding untouched; A's outside-owned part untouched.
    const auto ga = test::to_host<float>(a.grad());
    const auto gb = test::to_host<float>(b.grad());
    for (const auto& seg : a.segments()) {
      for (std::int64_t i = seg.offset; i < seg.offset + seg.length; ++i) {
        ASSERT_EQ(ga[static_cast<std::size_t>(i)], 0.0f) << at << ": A's gradient " << i << " not zeroed";
        ASSERT_EQ(gb[static_cast<std::size_t>(i - owned.begin)], 0.0f) << at << ": B's gradient " << i << " not zeroed";
      }
    }
    std::vector<float> expected = g;
    for (const auto& seg : a.segments()) {
      std::fill(expected.begin() + seg.offset, expected.begin() + seg.offset + seg.length, 0.0f);
    }
    ASSERT_EQ(std::memcmp(ga.data(), expected.data(), total * sizeof(float)), 0)
        << at << ": A's gradient changed outside the owned tensor elements";
    ASSERT_EQ(std::memcmp(gb.data(), expected.data() + owned.begin, gb.size() * sizeof(float)), 0)
        << at << ": B's gradient changed outside the owned tensor elements";
  }
}

}  // namespace test
