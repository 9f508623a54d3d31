// adamw8bit on the cpu backend: the codes (round-trip error bounds, unbiased stochastic rounding,
// no zero v), the work plan over odd layouts and shards, the state kind around min_8bit_size,
// tracking of fp32 AdamW, both non-finite policies, empty and one-element tensors, elements the
// update must not touch, world-size independence of the codes, memory per parameter, and ZeRO-2
// gradients over the owned shard only stepping exactly like gradients over the whole slab.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <gtest/gtest.h>

#include "bench/qwen3_params.h"
#include "core/half.h"
#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "optim/quantization.h"
#include "optim/sharded_grads_support.h"
#include "support/test_support.h"

namespace {

using optim::AdamW8bit;
using optim::ChunkKind;
using optim::NonFinitePolicy;
using optim::OptimizerConfig;
using optim::ParamSpec;
using optim::Quantization;
using Companded = optim::MomentCodec<Quantization::companded>;
using Linear = optim::MomentCodec<Quantization::linear>;

OptimizerConfig config(Quantization q = Quantization::companded, std::int64_t min_8bit_size = 4096, double clip = 0.0,
                       NonFinitePolicy policy = NonFinitePolicy::skip_step) {
  OptimizerConfig c;
  c.type = "adamw8bit";
  c.lr = 1e-2;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.eps = 1e-8;
  c.weight_decay = 0.1;
  c.grad_clip = clip;
  c.nonfinite = policy;
  c.adamw8bit.min_8bit_size = min_8bit_size;
  c.adamw8bit.quantization = q;
  return c;
}

struct Run8 {
  core::DeviceContext context{core::Device::cpu()};
  optim::Slab slab;
  AdamW8bit opt;

  Run8(const optim::SlabLayout& layout, const OptimizerConfig& c, optim::SlabOptions options = {},
       std::int64_t chunk = optim::Optimizer::kDefaultChunkElements)
      : slab(layout, context, options), opt(c, slab, context, chunk) {}

  std::vector<float> master() const { return test::to_host<float>(slab.master()); }
  std::vector<std::uint8_t> q_m() { return test::to_host<std::uint8_t>(opt.q_m()); }
  std::vector<std::uint8_t> q_v() { return test::to_host<std::uint8_t>(opt.q_v()); }
  std::vector<float> scale_m() { return test::to_host<float>(opt.scale_m()); }
  std::vector<float> scale_v() { return test::to_host<float>(opt.scale_v()); }
};

// Random weights for every owned element (padding included: the update must leave it alone).
void random_master(std::mt19937_64& rng, optim::Slab& slab) {
  test::from_host(slab.master(), test::random_normal(rng, slab.master().bytes() / 4));
}

// Exact code values and the pair of codes that brackets a magnitude (brute force, all codes).
template <typename Unit>
std::pair<int, int> bracket(float a, float scale, int top, Unit unit) {
  int lo = 0;
  for (int k = 0; k <= top; ++k) {
    if (optim::fp::mul(scale, unit(k)) <= a) lo = k;
  }
  return {lo, std::min(lo + 1, top)};
}

TEST(AdamW8bitCodes, CompandedRoundTripStaysBetweenNeighbouringCodes) {
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-30.0f, 10.0f);
  for (int trial = 0; trial < 20000; ++trial) {
    const float scale = std::exp2(exponent(rng));
    // Magnitudes spread over the whole code range, including far below the first code.
    const float fraction = trial % 3 == 0 ? std::exp2(-40.0f * unit(rng)) : unit(rng);
    const float a = std::min(scale, scale * fraction);
    const float u = unit(rng);
    const optim::CodeScale cs_m = Companded::code_scale_m(scale), cs_v = Companded::code_scale_v(scale);

    const float m = trial % 2 ? -a : a;
    const std::uint8_t cm = Companded::encode_m(m, cs_m, u);
    const float dm = Companded::decode_m(cm, scale);
    const auto [mlo, mhi] = bracket(a, scale, optim::kCompandedMTop, optim::quant::companded_m_unit);
    const int k = cm & 0x7F;
    ASSERT_TRUE(k == mlo || k == mhi) << "m " << m << " scale " << scale << " code " << k << " not in [" << mlo << ", "
                                      << mhi << "]";
    const float gap_m = scale * (optim::quant::companded_m_unit(mhi) - optim::quant::companded_m_unit(mlo));
    ASSERT_LE(std::fabs(dm - m), gap_m * (1 + 1e-5f)) << "m " << m << " scale " << scale;
    if (dm != 0.0f) {
      ASSERT_EQ(std::signbit(dm), std::signbit(m)) << m;
    }

    const std::uint8_t cv = Companded::encode_v(a, cs_v, u);
    const float dv = Companded::decode_v(cv, scale);
    const auto [vlo, vhi] = bracket(a, scale, optim::kCompandedVTop, optim::quant::companded_v_unit);
    if (a > 0 && vlo == 0) {
      ASSERT_EQ(cv, 1) << "non-zero v below the first code must take code 1";
    } else {
      ASSERT_TRUE(cv == vlo || cv == vhi) << "v " << a << " scale " << scale << " code " << int(cv);
      const float gap_v = scale * (optim::quant::companded_v_unit(vhi) - optim::quant::companded_v_unit(vlo));
      ASSERT_LE(std::fabs(dv - a), gap_v * (1 + 1e-5f)) << "v " << a << " scale " << scale;
    }
  }
  // The top codes are exactly 1 and the block maximum always takes them.
  EXPECT_EQ(optim::quant::companded_m_unit(127), 1.0f);
  EXPECT_EQ(optim::quant::companded_v_unit(255), 1.0f);
  EXPECT_EQ(optim::quant::linear_unit(127), 1.0f);
  EXPECT_EQ(optim::quant::linear_unit(-127), -1.0f);
  EXPECT_EQ(Companded::decode_m(Companded::encode_m(-3.5f, Companded::code_scale_m(3.5f), 0.999f), 3.5f), -3.5f);
  EXPECT_EQ(Companded::decode_v(Companded::encode_v(2e-7f, Companded::code_scale_v(2e-7f), 0.999f), 2e-7f), 2e-7f);
  EXPECT_EQ(Companded::encode_m(0.0f, Companded::code_scale_m(0.0f), 0.5f), 0);
  EXPECT_EQ(Companded::encode_v(0.0f, Companded::code_scale_v(1.0f), 0.5f), 0);
  // Block maxima below kMinScale are stored as 0.
  EXPECT_EQ(optim::block_scale(0x1p-91f), 0.0f);
  EXPECT_EQ(optim::block_scale(0x1p-90f), 0x1p-90f);
}

TEST(AdamW8bitCodes, LinearRoundsToNearest) {
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (int trial = 0; trial < 20000; ++trial) {
    const float scale = std::exp2(40.0f * unit(rng));
    const float x = scale * unit(rng);
    const optim::CodeScale cs = Linear::code_scale(scale);
    const std::uint8_t code = Linear::encode_m(x, cs, 0.0f);
    const float decoded = Linear::decode_m(code, scale);
    // Round to nearest: no other code is closer, and the error is at most half a step, up to fp32
    // rounding: x * 127/scale (two roundings) moves a near tie by up to about 1.2e-5 of a step, and
    // the decode's two roundings (q / 127, times scale) add up to 2^-23 scale, 3e-5 of a half step
    // (1e-5 was exceeded by 1.4e-6 on one draw: x 1.4152e-9, scale 1.8434e-9, code 97.5 from a tie).
    float best = INFINITY;
    for (int q = -127; q <= 127; ++q)
      best =
          std::min(best, std::fabs(Linear::decode(static_cast<std::uint8_t>(static_cast<std::int8_t>(q)), scale) - x));
    ASSERT_LE(std::fabs(decoded - x), best + scale / 127.0f * 1e-4f) << x << " scale " << scale;
    ASSERT_LE(std::fabs(decoded - x), scale / 254.0f * (1 + 1e-4f)) << x << " scale " << scale;
  }
  // Ties go away from zero; the end points are exact.
  EXPECT_EQ(static_cast<std::int8_t>(Linear::encode_m(0.5f, Linear::code_scale(127.0f), 0)), 1);
  EXPECT_EQ(static_cast<std::int8_t>(Linear::encode_m(-0.5f, Linear::code_scale(127.0f), 0)), -1);
  EXPECT_EQ(Linear::decode_m(Linear::encode_m(-0.25f, Linear::code_scale(0.25f), 0), 0.25f), -0.25f);
}

TEST(AdamW8bitCodes, StochasticRoundingIsUnbiased) {
  // Between the codes lo and hi a value x rounds to hi with probability p = (x - lo)/(hi - lo);
  // over N draws the mean decoded value has standard deviation gap*sqrt(p(1-p)/N), so it must
  // be within 5 of those of x (plus fp32 slack), and the fraction of hi within 5 sigma of p.
  const std::uint64_t seed = optim::rounding_seed(static_cast<long long>(test::fresh_seed() % 1000000));
  const int n = 200000;
  const float scale = 0.75f;
  const optim::CodeScale cs_m = Companded::code_scale_m(scale), cs_v = Companded::code_scale_v(scale);
  struct Case {
    bool is_v;
    int lo;
    float p;
  };
  const Case cases[] = {{false, 0, 0.3f}, {false, 1, 0.5f},  {false, 40, 0.1f}, {false, 126, 0.77f},
                        {true, 1, 0.6f},  {true, 17, 0.25f}, {true, 200, 0.5f}, {true, 254, 0.9f}};
  for (const Case& c : cases) {
    for (float sign : {1.0f, -1.0f}) {
      if (c.is_v && sign < 0) continue;
      auto value = [&](int k) {
        return scale * (c.is_v ? optim::quant::companded_v_unit(k) : optim::quant::companded_m_unit(k));
      };
      const double lo = value(c.lo), hi = value(c.lo + 1), gap = hi - lo;
      const float x = static_cast<float>(lo + c.p * gap);
      const double p = (x - lo) / gap;
      double sum = 0;
      long hits = 0;
      for (int i = 0; i < n; ++i) {
        const optim::RoundingDraws u = optim::rounding_draws(seed, i);
        double decoded;
        if (c.is_v) {
          decoded = Companded::decode_v(Companded::encode_v(x, cs_v, u.v), scale);
        } else {
          decoded = sign * Companded::decode_m(Companded::encode_m(sign * x, cs_m, u.m), scale);
        }
        sum += decoded;
        hits += decoded > x;
      }
      const double sigma = gap * std::sqrt(p * (1 - p) / n);
      EXPECT_NEAR(sum / n, x, 5 * sigma + 1e-6 * x) << (c.is_v ? "v" : "m") << " code " << c.lo << " p " << p;
      EXPECT_NEAR(static_cast<double>(hits) / n, p, 5 * std::sqrt(p * (1 - p) / n)) << "code " << c.lo;
    }
  }
}

TEST(AdamW8bitCodes, DrawsAreUniformAndIndependent) {
  const std::uint64_t seed = optim::rounding_seed(static_cast<long long>(test::fresh_seed() % 1000000));
  const int n = 400000;
  double sm = 0, sv = 0, smv = 0, sm_next = 0;
  float previous = 0;
  for (int i = 0; i < n; ++i) {
    const optim::RoundingDraws u = optim::rounding_draws(seed, i);
    ASSERT_GE(u.m, 0.0f);
    ASSERT_LT(u.m, 1.0f);
    ASSERT_GE(u.v, 0.0f);
    ASSERT_LT(u.v, 1.0f);
    sm += u.m;
    sv += u.v;
    smv += u.m * u.v;
    sm_next += u.m * previous;
    previous = u.m;
  }
  // Means 1/2 (sd 0.289/sqrt(n)), products of independent draws 1/4 (sd ~0.22/sqrt(n)); 5 sigma.
  const double tol_mean = 5 * 0.2887 / std::sqrt(n), tol_product = 5 * 0.22 / std::sqrt(n);
  EXPECT_NEAR(sm / n, 0.5, tol_mean);
  EXPECT_NEAR(sv / n, 0.5, tol_mean);
  EXPECT_NEAR(smv / n, 0.25, tol_product);
  EXPECT_NEAR(sm_next / n, 0.25, tol_product);
  EXPECT_NE(optim::rounding_seed(1), optim::rounding_seed(2));
}

TEST(AdamW8bitCodes, NonZeroVNeverDecodesToZero) {
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const float tiny[] = {1e-40f, 1e-30f, 1e-20f, 1e-12f, 1e-9f, 1e-6f};
  for (float v : tiny) {
    for (int i = 0; i < 1000; ++i) {
      const float u = unit(rng);
      const std::uint8_t c = Companded::encode_v(v, Companded::code_scale_v(1.0f), u);
      ASSERT_GE(c, 1) << v;
      ASSERT_GT(Companded::decode_v(c, 1.0f), 0.0f) << v;
    }
  }
  // The linear code's known weakness: a v far below the block maximum becomes 0.
  EXPECT_EQ(Linear::decode_v(Linear::encode_v(1e-4f, Linear::code_scale(1.0f), 0), 1.0f), 0.0f);
}

// Every element of every owned segment is updated by exactly one chunk, quantised chunks are
// whole blocks in one chunk each, and the quantised-segment ranges of the chunks are exact.
void check_plan(const optim::SlabLayout& layout, const std::vector<optim::Segment>& segments, optim::Range owned,
                std::int64_t min_size, std::int64_t chunk_elements, const std::string& where) {
  const auto plan = optim::plan_adamw8bit(layout, segments, owned, min_size, chunk_elements);
  ASSERT_EQ(plan.owned_elements, owned.size()) << where;
  ASSERT_EQ(plan.owned_blocks * 256, owned.size()) << where;
  const auto& q = plan.quantised_segments;
  std::size_t qi = 0;
  std::int64_t small_total = 0;
  for (const auto& s : segments) {
    const bool quantised = layout.tensors()[static_cast<std::size_t>(s.tensor)].numel >= min_size;
    if (quantised) {
      ASSERT_LT(qi, q.size()) << where;
      ASSERT_EQ(q[qi].offset, s.offset) << where;
      ++qi;
    } else {
      small_total += (s.length + 3) / 4 * 4;
    }
  }
  ASSERT_EQ(qi, q.size()) << where;
  ASSERT_EQ(plan.small_elements, small_total) << where;

  std::map<std::int64_t, int> covered;  // element -> times updated
  std::set<std::int64_t> blocks;
  std::vector<std::pair<std::int64_t, std::int64_t>> state_ranges;
  for (std::size_t c = 0; c < plan.chunks.size(); ++c) {
    const auto& ch = plan.chunks[c];
    if (c > 0) {
      ASSERT_LE(plan.chunks[c - 1].offset, ch.offset) << where << ": chunks not in slab order";
    }
    ASSERT_GT(ch.length, 0) << where;
    if (ch.kind == ChunkKind::quantised) {
      ASSERT_EQ(ch.offset % 256, 0) << where;
      ASSERT_EQ(ch.length % 256, 0) << where;
      ASSERT_LE(ch.length, std::max<std::int64_t>(256, chunk_elements / 256 * 256)) << where;
      ASSERT_GE(ch.offset, owned.begin) << where;
      ASSERT_LE(ch.offset + ch.length, owned.end) << where;
      ASSERT_GE(ch.segment_count, 1) << where;
      ASSERT_LE(ch.segment_count, optim::kMaxChunkSegments) << where;
      for (std::int64_t b = ch.offset / 256; b < (ch.offset + ch.length) / 256; ++b) {
        ASSERT_TRUE(blocks.insert(b).second) << where << ": block " << b << " in two chunks";
      }
      // Exactly the quantised segments [first, first + count) intersect the chunk.
      for (std::size_t k = 0; k < q.size(); ++k) {
        const bool meets = q[k].offset < ch.offset + ch.length && q[k].offset + q[k].length > ch.offset;
        const bool listed = static_cast<std::int32_t>(k) >= ch.first_segment &&
                            static_cast<std::int32_t>(k) < ch.first_segment + ch.segment_count;
        ASSERT_EQ(meets, listed) << where << ": quantised segment " << k << " and chunk at " << ch.offset;
        if (meets) {
          const std::int64_t b = std::max(q[k].offset, ch.offset),
                             e = std::min(q[k].offset + q[k].length, ch.offset + ch.length);
          for (std::int64_t i = b; i < e; ++i) ++covered[i];
        }
      }
    } else {
      ASSERT_EQ(ch.segment_count, 1) << where;
      const auto& s = segments[static_cast<std::size_t>(ch.first_segment)];
      ASSERT_LT(layout.tensors()[static_cast<std::size_t>(s.tensor)].numel, min_size) << where;
      ASSERT_EQ(ch.offset % 4, 0) << where;
      ASSERT_EQ(ch.state_offset % 4, 0) << where;
      ASSERT_LE(ch.length, chunk_elements) << where;
      ASSERT_GE(ch.offset, s.offset) << where;
      ASSERT_LE(ch.offset + ch.length, s.offset + s.length) << where;
      ASSERT_LE(ch.state_offset + ch.length, plan.small_elements) << where;
      state_ranges.push_back({ch.state_offset, ch.state_offset + ch.length});
      for (std::int64_t i = ch.offset; i < ch.offset + ch.length; ++i) ++covered[i];
    }
  }
  std::sort(state_ranges.begin(), state_ranges.end());
  for (std::size_t k = 1; k < state_ranges.size(); ++k) {
    ASSERT_LE(state_ranges[k - 1].second, state_ranges[k].first) << where << ": fp32 state ranges overlap";
  }
  std::int64_t expected = 0;
  for (const auto& s : segments) {
    expected += s.length;
    for (std::int64_t i = s.offset; i < s.offset + s.length; ++i) {
      ASSERT_EQ(covered[i], 1) << where << ": element " << i << " of tensor " << s.tensor;
    }
  }
  ASSERT_EQ(static_cast<std::int64_t>(covered.size()), expected) << where << ": a chunk covers a non-tensor element";
}

TEST(AdamW8bitPlan, CoversEveryElementOnceOverRandomLayoutsAndShards) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t min_sizes[] = {0, 1, 64, 300, 1000, 4096};
  const std::int64_t chunk_sizes[] = {64, 256, 1024, 4096, 16384};
  for (int trial = 0; trial < 60; ++trial) {
    const int world = 1 + static_cast<int>(rng() % 5);
    const optim::SlabLayout layout(test::random_specs(rng, 1 + static_cast<int>(rng() % 40), trial % 4 ? 5000 : 40000),
                                   world);
    const std::int64_t min_size = min_sizes[rng() % std::size(min_sizes)];
    const std::int64_t chunk = chunk_sizes[rng() % std::size(chunk_sizes)];
    for (int rank = 0; rank < world; ++rank) {
      const optim::Range owned = world > 1 ? layout.shard(rank) : optim::Range{0, layout.total_elements()};
      const std::string where = "trial " + std::to_string(trial) + " world " + std::to_string(world) + " rank " +
                                std::to_string(rank) + " min " + std::to_string(min_size) + " chunk " +
                                std::to_string(chunk);
      check_plan(layout, optim::make_segments(layout, owned), owned, min_size, chunk, where);
      if (HasFatalFailure()) return;
    }
  }
  // Many tiny quantised tensors: chunks are cut at kMaxChunkSegments segments.
  std::vector<ParamSpec> tiny;
  for (int i = 0; i < 200; ++i) tiny.push_back({.name = "t" + std::to_string(i), .shape = {1 + i % 50}});
  const optim::SlabLayout layout(tiny, 1);
  check_plan(layout, optim::make_segments(layout, {0, layout.total_elements()}), {0, layout.total_elements()}, 1, 65536,
             "200 tiny tensors");
}

TEST(AdamW8bitCpu, StateKindFollowsMinSize) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t min_size : {std::int64_t{4096}, std::int64_t{1000}}) {
    const std::vector<ParamSpec> specs = {{.name = "under", .shape = {min_size - 1}},
                                          {.name = "at", .shape = {min_size}},
                                          {.name = "over", .shape = {min_size + 1}}};
    const optim::SlabLayout layout(specs, 1);
    auto c = config(Quantization::companded, min_size, 1.0);
    Run8 run(layout, c);
    ASSERT_EQ(run.opt.plan().quantised_segments.size(), 2u);
    EXPECT_EQ(run.opt.plan().quantised_segments[0].tensor, 1);
    EXPECT_EQ(run.opt.plan().small_elements, (min_size - 1 + 3) / 4 * 4);
    EXPECT_EQ(run.opt.small_m().bytes(), static_cast<std::size_t>((min_size - 1 + 3) / 4 * 4) * 4);

    // The small tensor's update is fp32 AdamW's, bit for bit (same clip: same gradients).
    c.type = "adamw";
    core::DeviceContext cpu(core::Device::cpu());
    optim::Slab slab32(layout, cpu);
    optim::AdamW adamw(c, slab32, cpu);
    random_master(rng, run.slab);
    test::from_host(slab32.master(), run.master());
    for (int step = 0; step < 4; ++step) {
      const auto g = test::random_grads(rng, layout, 0.3f);
      test::from_host(run.slab.grad(), g);
      test::from_host(slab32.grad(), g);
      run.opt.step(c.lr);
      adamw.step(c.lr);
    }
    const auto w8 = run.master(), w32 = test::to_host<float>(slab32.master());
    for (std::int64_t i = 0; i < min_size - 1; ++i)
      ASSERT_EQ(w8[static_cast<std::size_t>(i)], w32[static_cast<std::size_t>(i)]) << i;
    const auto m32 = test::to_host<float>(adamw.exp_avg());
    const auto m8 = test::to_host<float>(run.opt.small_m());
    for (std::int64_t i = 0; i < min_size - 1; ++i)
      ASSERT_EQ(m8[static_cast<std::size_t>(i)], m32[static_cast<std::size_t>(i)]) << i;
    // The quantised ones moved and have codes.
    const auto qm = run.q_m();
    const std::int64_t at = layout.tensors()[1].offset;
    EXPECT_GT(std::count_if(qm.begin() + at, qm.begin() + at + min_size, [](std::uint8_t x) { return x != 0; }),
              min_size / 2);
  }
}

// ||w8 - w32|| / ||w32 - w0|| after `steps` steps on gradients with a persistent mean.
double deviation_from_fp32(Quantization q, std::uint64_t seed, int steps) {
  std::mt19937_64 rng(seed);
  const std::vector<ParamSpec> specs = {{.name = "a", .shape = {97, 131}},
                                        {.name = "b", .shape = {50000}},
                                        {.name = "norm", .shape = {300}, .decay = false},
                                        {.name = "c", .shape = {64, 300}}};
  const optim::SlabLayout layout(specs, 1);
  auto c = config(q, 4096, 1.0);
  c.lr = 1e-3;
  Run8 run(layout, c);
  auto c32 = c;
  c32.type = "adamw";
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab32(layout, cpu);
  optim::AdamW adamw(c32, slab32, cpu);
  random_master(rng, run.slab);
  const auto w0 = run.master();
  test::from_host(slab32.master(), w0);
  // Per-element mean gradient with a wide range of magnitudes, plus noise.
  auto mean = test::random_grads(rng, layout, 1.0f);
  std::uniform_real_distribution<float> log_scale(-2.0f, 0.0f);
  for (float& x : mean) x *= std::pow(10.0f, log_scale(rng));
  for (int step = 0; step < steps; ++step) {
    auto g = test::random_grads(rng, layout, 0.01f);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] += mean[i];
    test::from_host(run.slab.grad(), g);
    test::from_host(slab32.grad(), g);
    run.opt.step(c.lr);
    adamw.step(c.lr);
  }
  const auto w8 = run.master(), w32 = test::to_host<float>(slab32.master());
  double diff = 0, moved = 0;
  for (std::size_t i = 0; i < w0.size(); ++i) {
    diff += (static_cast<double>(w8[i]) - w32[i]) * (static_cast<double>(w8[i]) - w32[i]);
    moved += (static_cast<double>(w32[i]) - w0[i]) * (static_cast<double>(w32[i]) - w0[i]);
  }
  return std::sqrt(diff / moved);
}

TEST(AdamW8bitCpu, TracksFp32AdamW) {
  // Over 30 steps on gradients whose means span two decades inside every block, the companded
  // optimizer's weights stay within 7% of fp32 AdamW's, relative to how far fp32 AdamW moved
  // them (measured: ~4.8%; ~3.5% of it is the code resolution itself, as rounding to the
  // nearest code shows, the rest the stochastic rounding noise). The linear code, whose small
  // v round to 0, is off by orders of magnitude.
  const std::uint64_t seed = test::fresh_seed();
  const double companded = deviation_from_fp32(Quantization::companded, seed, 30);
  const double linear = deviation_from_fp32(Quantization::linear, seed, 30);
  std::printf("[ info     ] deviation from fp32 AdamW after 30 steps: companded %.4f, linear %.4f\n", companded,
              linear);
  EXPECT_LT(companded, 0.07);
  EXPECT_LT(companded, linear) << "the companded code must track fp32 AdamW better than the linear baseline";
}

TEST(AdamW8bitCpu, SkipStepPolicyLeavesWeightsAndStateAndZeroesGrads) {
  std::mt19937_64 rng(test::fresh_seed());
  const optim::SlabLayout layout({{.name = "big", .shape = {9000}}, {.name = "small", .shape = {70}}}, 1);
  const auto c = config(Quantization::companded, 4096, 1.0, NonFinitePolicy::skip_step);
  Run8 run(layout, c), fresh(layout, c);
  random_master(rng, run.slab);
  test::from_host(fresh.slab.master(), run.master());
  // One finite step first so that the state is not all zero.
  auto g = test::random_grads(rng, layout, 0.1f);
  test::from_host(run.slab.grad(), g);
  run.opt.step(c.lr);
  const auto w = run.master();
  const auto qm = run.q_m(), qv = run.q_v();
  const auto sm = run.scale_m(), sv = run.scale_v();
  const auto small_m = test::to_host<float>(run.opt.small_m());

  g = test::random_grads(rng, layout, 0.1f);
  g[static_cast<std::size_t>(rng() % 9000)] = NAN;
  test::from_host(run.slab.grad(), g);
  run.opt.step(c.lr);
  const auto report = run.opt.report();
  EXPECT_TRUE(report.skipped);
  EXPECT_EQ(report.step, 1);
  EXPECT_EQ(report.skipped_steps, 1);
  EXPECT_EQ(run.master(), w);
  EXPECT_EQ(run.q_m(), qm);
  EXPECT_EQ(run.q_v(), qv);
  EXPECT_EQ(run.scale_m(), sm);
  EXPECT_EQ(run.scale_v(), sv);
  EXPECT_EQ(test::to_host<float>(run.opt.small_m()), small_m);
  for (const auto& t : layout.tensors()) {
    for (std::int64_t i = t.offset; i < t.offset + t.numel; ++i) ASSERT_EQ(run.slab.grad().as<float>()[i], 0.0f) << i;
  }
}

TEST(AdamW8bitCpu, SkippedStepDoesNotAdvanceTheRoundingSeed) {
  // A skipped first step followed by a finite one equals a fresh optimizer's first step, codes included.
  std::mt19937_64 rng(test::fresh_seed());
  const optim::SlabLayout layout({{.name = "big", .shape = {5000}}}, 1);
  const auto c = config(Quantization::companded, 4096, 1.0, NonFinitePolicy::skip_step);
  Run8 run(layout, c), fresh(layout, c);
  random_master(rng, run.slab);
  test::from_host(fresh.slab.master(), run.master());
  auto bad = test::random_grads(rng, layout, 0.1f);
  bad[3] = INFINITY;
  test::from_host(run.slab.grad(), bad);
  run.opt.step(c.lr);
  const auto g = test::random_grads(rng, layout, 0.1f);
  test::from_host(run.slab.grad(), g);
  test::from_host(fresh.slab.grad(), g);
  run.opt.step(c.lr);
  fresh.opt.step(c.lr);
  EXPECT_EQ(run.opt.report().step, 1);
  EXPECT_EQ(run.master(), fresh.master());
  EXPECT_EQ(run.q_m(), fresh.q_m());
  EXPECT_EQ(run.q_v(), fresh.q_v());
}

TEST(AdamW8bitCpu, ZeroElementPolicyEqualsZeroGradients) {
  std::mt19937_64 rng(test::fresh_seed());
  for (Quantization q : {Quantization::companded, Quantization::linear}) {
    const optim::SlabLayout layout({{.name = "big", .shape = {7, 1001}}, {.name = "small", .shape = {33}}}, 1);
    const auto c = config(q, 4096, 1.0, NonFinitePolicy::zero_element);
    Run8 run(layout, c), clean(layout, c);
    random_master(rng, run.slab);
    test::from_host(clean.slab.master(), run.master());
    for (int step = 0; step < 3; ++step) {
      auto g = test::random_grads(rng, layout, 0.2f);
      auto g_clean = g;
      for (std::size_t pos :
           {std::size_t{5}, std::size_t{4000}, static_cast<std::size_t>(layout.tensors()[1].offset + 7)}) {
        g[pos] = step % 2 ? NAN : -INFINITY;
        g_clean[pos] = 0.0f;
      }
      test::from_host(run.slab.grad(), g);
      test::from_host(clean.slab.grad(), g_clean);
      run.opt.step(c.lr);
      clean.opt.step(c.lr);
      const auto report = run.opt.report();
      EXPECT_FALSE(report.skipped);
      EXPECT_EQ(report.nonfinite, 3u);
      EXPECT_EQ(report.grad_norm, clean.opt.report().grad_norm);
    }
    EXPECT_EQ(run.master(), clean.master());
    EXPECT_EQ(run.q_m(), clean.q_m());
    EXPECT_EQ(run.q_v(), clean.q_v());
    EXPECT_EQ(run.scale_m(), clean.scale_m());
    EXPECT_EQ(test::to_host<float>(run.opt.small_v()), test::to_host<float>(clean.opt.small_v()));
    EXPECT_EQ(run.opt.report().step, 3);
  }
}

// One AdamW step from m = v = 0 at t = 1, in double.
double first_step(double w, double g, double lr, double wd, double eps) {
  return w * (1 - lr * wd) - lr * g / (std::fabs(g) + eps);
}

TEST(AdamW8bitCpu, EmptyAndOneElementTensors) {
  for (std::int64_t min_size : {std::int64_t{4096}, std::int64_t{1}, std::int64_t{0}}) {
    const auto c = config(Quantization::companded, min_size);
    const optim::SlabLayout layout({{.name = "empty", .shape = {0}},
                                    {.name = "one", .shape = {1}},
                                    {.name = "empty2", .shape = {3, 0}},
                                    {.name = "scalar", .shape = {}}},
                                   1);
    Run8 run(layout, c);
    EXPECT_EQ(run.opt.plan().quantised_segments.size(), min_size <= 1 ? 2u : 0u);
    run.slab.master_view(1).as<float>()[0] = 0.5f;
    run.slab.grad_view(1).as<float>()[0] = -0.25f;
    run.slab.master_view(3).as<float>()[0] = -1.5f;
    run.slab.grad_view(3).as<float>()[0] = 2.0f;
    run.opt.step(c.lr);
    EXPECT_NEAR(run.slab.master_view(1).as<float>()[0], first_step(0.5, -0.25, c.lr, c.weight_decay, c.eps), 1e-7);
    EXPECT_NEAR(run.slab.master_view(3).as<float>()[0], first_step(-1.5, 2.0, c.lr, c.weight_decay, c.eps), 1e-7);
    EXPECT_EQ(run.slab.grad_view(1).as<float>()[0], 0.0f);
    if (min_size <= 1) {
      // Both one-element tensors share block 0; the larger |m| (the scalar's) is its maximum
      // and takes the top codes.
      const std::size_t at = static_cast<std::size_t>(layout.tensors()[3].offset);
      ASSERT_LT(at, 256u);
      EXPECT_EQ(run.q_m()[at], 127);
      EXPECT_EQ(run.q_v()[at], 255);
      EXPECT_EQ(run.scale_m()[0], optim::fp::mul(static_cast<float>(1 - c.beta1), 2.0f));
      EXPECT_NE(run.q_m()[static_cast<std::size_t>(layout.tensors()[1].offset)] & 0x80, 0) << "negative m";
    }
    EXPECT_EQ(run.opt.report().step, 1);
  }
  // A slab with no parameters at all still counts steps.
  Run8 none(optim::SlabLayout({}, 1), config());
  none.opt.step(1e-3);
  none.opt.step(1e-3);
  EXPECT_EQ(none.opt.report().step, 2);
}

TEST(AdamW8bitCpu, TouchesOnlyTensorElementsAndScalesAreBlockMaxima) {
  // Tensors that end inside blocks and share blocks with small tensors and with each other.
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<ParamSpec> specs = {{.name = "q1", .shape = {4097}},   {.name = "s1", .shape = {5}},
                                        {.name = "q2", .shape = {61, 67}}, {.name = "q3", .shape = {4099}},
                                        {.name = "s2", .shape = {130}},    {.name = "q4", .shape = {8191}}};
  for (Quantization q : {Quantization::companded, Quantization::linear}) {
    const optim::SlabLayout layout(specs, 1);
    const auto c = config(q, 4096, 0.0);
    Run8 run(layout, c, {}, 1024);
    random_master(rng, run.slab);
    const auto w0 = run.master();
    const auto total = static_cast<std::size_t>(layout.total_elements());
    auto grads = test::random_normal(rng, total, 0.5f);  // padding gets gradients too
    auto mirror0 = std::vector<std::uint16_t>(total);
    for (auto& x : mirror0) x = static_cast<std::uint16_t>(rng());
    test::from_host(run.slab.grad(), grads);
    test::from_host(run.slab.mirror(), mirror0);
    run.opt.step(c.lr);
    std::vector<int> owner(total, -1);
    for (std::size_t t = 0; t < specs.size(); ++t) {
      const auto& st = layout.tensors()[t];
      for (std::int64_t i = st.offset; i < st.offset + st.numel; ++i)
        owner[static_cast<std::size_t>(i)] = static_cast<int>(t);
    }
    const auto w = run.master();
    const auto g = test::to_host<float>(run.slab.grad());
    const auto mirror = test::to_host<std::uint16_t>(run.slab.mirror());
    const auto qm = run.q_m(), qv = run.q_v();
    const auto sm = run.scale_m(), sv = run.scale_v();
    std::vector<float> max_m(total / 256, 0.0f), max_v(total / 256, 0.0f);
    for (std::size_t i = 0; i < total; ++i) {
      const bool quantised = owner[i] >= 0 && layout.tensors()[static_cast<std::size_t>(owner[i])].numel >= 4096;
      if (owner[i] < 0) {
        ASSERT_EQ(w[i], w0[i]) << "padding master " << i;
        ASSERT_EQ(g[i], grads[i]) << "padding grad " << i;
        ASSERT_EQ(mirror[i], mirror0[i]) << "padding mirror " << i;
      } else {
        ASSERT_NE(w[i], w0[i]) << i;
        ASSERT_EQ(g[i], 0.0f) << i;
        ASSERT_EQ(mirror[i], core::float_to_bf16(w[i])) << i;
      }
      if (!quantised) {
        ASSERT_EQ(qm[i], 0) << "code of a non-quantised element " << i;
        ASSERT_EQ(qv[i], 0) << i;
        continue;
      }
      // First step from zero state, no clip: m = fl(0.1 g), v = fl(fl(0.05 g) g).
      const float m = optim::fp::mul(static_cast<float>(1 - c.beta1), grads[i]);
      const float v = optim::fp::mul(optim::fp::mul(static_cast<float>(1 - c.beta2), grads[i]), grads[i]);
      max_m[i / 256] = std::max(max_m[i / 256], std::fabs(m));
      max_v[i / 256] = std::max(max_v[i / 256], v);
    }
    EXPECT_EQ(sm, max_m) << "scale_m must be the block maximum of |m| over quantised elements only";
    EXPECT_EQ(sv, max_v);
  }
}

TEST(AdamW8bitCpu, CodesDoNotDependOnWorldSize) {
  std::mt19937_64 rng(test::fresh_seed());
  const auto specs = test::random_specs(rng, 30, 20000);
  const auto c = config(Quantization::companded, 1000, 0.0);  // no clip: each shard's norm is its own
  const optim::SlabLayout single(specs, 1);
  Run8 one(single, c, {}, 4096);
  const auto w0 = test::random_normal(rng, static_cast<std::size_t>(single.total_elements()));
  test::from_host(one.slab.master(), w0);
  std::vector<std::vector<float>> grads;
  for (int step = 0; step < 3; ++step) grads.push_back(test::random_grads(rng, single, 0.1f));
  for (const auto& g : grads) {
    test::from_host(one.slab.grad(), g);
    one.opt.step(c.lr);
  }
  const auto w1 = one.master();
  const auto qm1 = one.q_m(), qv1 = one.q_v();
  const auto sm1 = one.scale_m();
  for (int world : {2, 3}) {
    const optim::SlabLayout layout(specs, world);
    for (int rank = 0; rank < world; ++rank) {
      Run8 shard(layout, c, {.rank = rank, .zero_stage = 1}, 1024);
      const optim::Range owned = shard.slab.owned();
      auto w = std::vector<float>(static_cast<std::size_t>(owned.size()), 0.0f);
      for (std::int64_t i = owned.begin; i < std::min(owned.end, single.total_elements()); ++i) {
        w[static_cast<std::size_t>(i - owned.begin)] = w0[static_cast<std::size_t>(i)];
      }
      test::from_host(shard.slab.master(), w);
      for (const auto& g : grads) {
        auto full = std::vector<float>(static_cast<std::size_t>(layout.total_elements()), 0.0f);
        std::copy(g.begin(), g.end(), full.begin());
        test::from_host(shard.slab.grad(), full);
        shard.opt.step(c.lr);
      }
      const auto ws = shard.master();
      const auto qm = shard.q_m(), qv = shard.q_v();
      const auto sm = shard.scale_m();
      for (std::int64_t i = owned.begin; i < std::min(owned.end, single.total_elements()); ++i) {
        const auto l = static_cast<std::size_t>(i - owned.begin), k = static_cast<std::size_t>(i);
        ASSERT_EQ(ws[l], w1[k]) << "world " << world << " rank " << rank << " element " << i;
        ASSERT_EQ(qm[l], qm1[k]) << "world " << world << " rank " << rank << " element " << i;
        ASSERT_EQ(qv[l], qv1[k]) << "world " << world << " rank " << rank << " element " << i;
        if (i % 256 == 0) {
          ASSERT_EQ(sm[l / 256], sm1[k / 256]) << "block " << i / 256;
        }
      }
    }
  }
}

TEST(AdamW8bitCpu, StateBytesPerParameterOnQwen3) {
  const optim::SlabLayout layout(bench::qwen3_0_6b_params(), 1);
  const auto segments = optim::make_segments(layout, {0, layout.total_elements()});
  const auto plan = optim::plan_adamw8bit(layout, segments, {0, layout.total_elements()}, 4096,
                                          optim::Optimizer::kDefaultChunkElements);
  const double per_param = static_cast<double>(plan.state_bytes()) / static_cast<double>(layout.parameter_count());
  std::printf("[ info     ] adamw8bit state on Qwen3-0.6B: %lld bytes, %.4f bytes/parameter (fp32 AdamW: 8)\n",
              static_cast<long long>(plan.state_bytes()), per_param);
  EXPECT_LE(per_param, 2.05);
  EXPECT_EQ(plan.small_elements, 28 * (1024 + 128 + 128 + 1024) + 1024);  // the norm weights

  // The optimizer allocates exactly what the plan says.
  std::mt19937_64 rng(test::fresh_seed());
  const optim::SlabLayout small(test::random_specs(rng, 40, 20000), 1);
  Run8 run(small, config());
  std::size_t bytes = 0;
  for (const auto& b : run.opt.state_buffers()) bytes += b.buffer->bytes();
  EXPECT_EQ(static_cast<std::int64_t>(bytes), run.opt.plan().state_bytes());
}

TEST(AdamW8bitCpu, MakeOptimizerBuildsIt) {
  const optim::SlabLayout layout({{.name = "w", .shape = {5000}}}, 1);
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(layout, cpu);
  const auto opt = optim::make_optimizer(config(), slab, cpu);
  EXPECT_NE(dynamic_cast<AdamW8bit*>(opt.get()), nullptr);
  EXPECT_EQ(opt->state_buffers().size(), 6u);
}

TEST(AdamW8bitCpu, ShardedGradientsMatchFullGradients) {
  for (Quantization q : {Quantization::companded, Quantization::linear}) {
    for (int world : {3, 2})
      test::check_sharded_gradients_match_full(core::Device::cpu(), config(q, 4096, 1.0), world, 1);
  }
}

}  // namespace
