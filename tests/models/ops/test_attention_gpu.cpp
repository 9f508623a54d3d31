// The CUDA causal GQA attention (bf16 in and out, flash-style) against the CPU reference evaluated
// in double on the same bf16-rounded inputs: out, lse and the gradients over awkward sizes (seq 1 to
// 1000, batch 1 and 3, GQA groups 1, 2 and 4, head dims 64 and 128) and every tile variant; causal
// masking (a changed future key/value leaves earlier rows bit-identical, and so does a changed next
// sequence); the pingpong variants bit-identical to their twins; bit-identical reruns of
// the backward; packed qkv inputs and packed dqkv outputs; argument checks. Every output is
// poisoned with NaN before each run, so an element left unwritten fails.
//
// Tolerances are relative in the 2-norm, ||gpu - ref|| / ||ref||: 1e-2 for out and the gradients
// (bf16 outputs, and P and dS rounded to bf16 as tensor-core operands), 1e-3 for lse (fp32 softmax
// statistics).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/half.h"
#include "models/ops/attention.h"
#include "support/test_support.h"

namespace {

namespace ops = models::ops;
using ops::AttentionShape;

constexpr double kOutputTolerance = 1e-2;
constexpr double kLseTolerance = 1e-3;
constexpr double kGradientTolerance = 1e-2;
constexpr std::uint16_t kBf16Poison = 0xFFFF;  // a NaN; four 0xFF bytes are an fp32 NaN too
constexpr std::int64_t kPackedPadding = 8;     // unused columns at the end of a packed row

std::string describe(const AttentionShape& s) {
  return "B=" + std::to_string(s.batch) + " T=" + std::to_string(s.seq) + " Hq=" + std::to_string(s.q_heads) +
         " Hkv=" + std::to_string(s.kv_heads) + " hd=" + std::to_string(s.head_dim);
}

std::size_t q_size(const AttentionShape& s) {
  return static_cast<std::size_t>(s.batch * s.seq * s.q_heads * s.head_dim);
}
std::size_t kv_size(const AttentionShape& s) {
  return static_cast<std::size_t>(s.batch * s.seq * s.kv_heads * s.head_dim);
}
std::size_t lse_size(const AttentionShape& s) { return static_cast<std::size_t>(s.batch * s.q_heads * s.seq); }

std::vector<std::uint16_t> random_bf16(std::mt19937_64& rng, std::size_t n, float scale) {
  std::vector<std::uint16_t> words(n);
  const auto values = test::random_normal(rng, n, scale);
  for (std::size_t i = 0; i < n; ++i) words[i] = core::float_to_bf16(values[i]);
  return words;
}

std::vector<double> to_double(const std::vector<std::uint16_t>& words) {
  std::vector<double> out(words.size());
  for (std::size_t i = 0; i < words.size(); ++i) out[i] = core::bf16_to_float(words[i]);
  return out;
}

std::vector<double> to_double(const std::vector<float>& values) { return {values.begin(), values.end()}; }

// Dense [batch, seq, heads, head_dim] inputs as bf16 words.
struct Inputs {
  std::vector<std::uint16_t> q, k, v, dout;
};

Inputs random_inputs(std::mt19937_64& rng, const AttentionShape& s) {
  return {random_bf16(rng, q_size(s), 1.5f), random_bf16(rng, kv_size(s), 1.5f), random_bf16(rng, kv_size(s), 1.0f),
          random_bf16(rng, q_size(s), 1.0f)};
}

// What the GPU wrote, in the dense layouts.
struct Outputs {
  std::vector<std::uint16_t> out;
  std::vector<float> lse;
  std::vector<std::uint16_t> dq, dk, dv;
};

struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

// The CPU reference in double on the bf16 values.
Reference reference(const AttentionShape& s, const Inputs& in) {
  const auto q = to_double(in.q), k = to_double(in.k), v = to_double(in.v), dout = to_double(in.dout);
  Reference r;
  r.out.resize(q.size());
  r.lse.resize(lse_size(s));
  r.dq.resize(q.size());
  r.dk.resize(k.size());
  r.dv.resize(v.size());
  ops::attention_forward_cpu<double>(s, q, k, v, r.out, r.lse);
  ops::attention_backward_cpu<double>(s, q, k, v, r.out, r.lse, dout, r.dq, r.dk, r.dv);
  return r;
}

// Device buffers of one case, dense or packed: q, k, v as slices of one [batch * seq, (q_heads +
// 2 kv_heads) * head_dim + padding] buffer and dq, dk, dv as slices of another of the same shape.
class GpuAttention {
 public:
  GpuAttention(const AttentionShape& s, const Inputs& in, bool packed)
      : shape_(s), packed_(packed), gpu_(core::Device::cuda(0)), context_(gpu_) {
    tokens_ = s.batch * s.seq;
    q_width_ = s.q_heads * s.head_dim;
    kv_width_ = s.kv_heads * s.head_dim;
    out_ = core::Buffer(gpu_, q_size(s) * 2);
    lse_ = core::Buffer(gpu_, lse_size(s) * sizeof(float));
    dout_ = core::Buffer(gpu_, q_size(s) * 2);
    workspace_ = core::Buffer(gpu_, ops::attention_backward_workspace_bytes(s));
    test::from_host(dout_, in.dout);
    if (packed_) {
      row_ = q_width_ + 2 * kv_width_ + kPackedPadding;
      std::vector<std::uint16_t> qkv(static_cast<std::size_t>(tokens_ * row_), core::float_to_bf16(1.0f));
      for (std::int64_t t = 0; t < tokens_; ++t) {
        std::copy_n(in.q.begin() + t * q_width_, q_width_, qkv.begin() + t * row_);
        std::copy_n(in.k.begin() + t * kv_width_, kv_width_, qkv.begin() + t * row_ + q_width_);
        std::copy_n(in.v.begin() + t * kv_width_, kv_width_, qkv.begin() + t * row_ + q_width_ + kv_width_);
      }
      qkv_ = core::Buffer(gpu_, qkv.size() * 2);
      dqkv_ = core::Buffer(gpu_, qkv.size() * 2);
      test::from_host(qkv_, qkv);
    } else {
      q_ = core::Buffer(gpu_, in.q.size() * 2);
      k_ = core::Buffer(gpu_, in.k.size() * 2);
      v_ = core::Buffer(gpu_, in.v.size() * 2);
      dq_ = core::Buffer(gpu_, in.q.size() * 2);
      dk_ = core::Buffer(gpu_, in.k.size() * 2);
      dv_ = core::Buffer(gpu_, in.v.size() * 2);
      test::from_host(q_, in.q);
      test::from_host(k_, in.k);
      test::from_host(v_, in.v);
    }
  }

  void forward(int variant = -1) {
    out_.fill_bytes(0xFF, context_.stream());
    lse_.fill_bytes(0xFF, context_.stream());
    ops::attention_forward_cuda(shape_, q(), k(), v(), out_.as<std::uint16_t>(), lse_.as<float>(), context_.stream(),
                                variant);
    context_.synchronize();
  }

  // From the last forward's out and lse.
  void backward(int variant = -1) {
    if (packed_) {
      dqkv_.fill_bytes(0xFF, context_.stream());
    } else {
      dq_.fill_bytes(0xFF, context_.stream());
      dk_.fill_bytes(0xFF, context_.stream());
      dv_.fill_bytes(0xFF, context_.stream());
    }
    workspace_.fill_bytes(0xFF, context_.stream());
    ops::attention_backward_cuda(shape_, q(), k(), v(), out_.as<std::uint16_t>(), lse_.as<float>(),
                                 dout_.as<std::uint16_t>(), dq(), dk(), dv(), workspace_.data(), workspace_.bytes(),
                                 context_.stream(), variant);
    context_.synchronize();
  }

  Outputs results() const {
    Outputs o;
    o.out = test::to_host<std::uint16_t>(out_);
    o.lse = test::to_host<float>(lse_);
    if (!packed_) {
      o.dq = test::to_host<std::uint16_t>(dq_);
      o.dk = test::to_host<std::uint16_t>(dk_);
      o.dv = test::to_host<std::uint16_t>(dv_);
      return o;
    }
    const auto dqkv = test::to_host<std::uint16_t>(dqkv_);
    o.dq.resize(static_cast<std::size_t>(tokens_ * q_width_));
    o.dk.resize(static_cast<std::size_t>(tokens_ * kv_width_));
    o.dv.resize(static_cast<std::size_t>(tokens_ * kv_width_));
    for (std::int64_t t = 0; t < tokens_; ++t) {
      const auto row = dqkv.begin() + t * row_;
      std::copy_n(row, q_width_, o.dq.begin() + t * q_width_);
      std::copy_n(row + q_width_, kv_width_, o.dk.begin() + t * kv_width_);
      std::copy_n(row + q_width_ + kv_width_, kv_width_, o.dv.begin() + t * kv_width_);
    }
    return o;
  }

  // In the packed layout: whether the padding columns of dqkv still hold the poison.
  bool padding_untouched() const {
    const auto dqkv = test::to_host<std::uint16_t>(dqkv_);
    for (std::int64_t t = 0; t < tokens_; ++t) {
      for (std::int64_t c = row_ - kPackedPadding; c < row_; ++c) {
        if (dqkv[static_cast<std::size_t>(t * row_ + c)] != kBf16Poison) return false;
      }
    }
    return true;
  }

 private:
  ops::AttentionInput q() const {
    if (packed_) return {qkv_.as<std::uint16_t>(), row_};
    return {q_.as<std::uint16_t>(), q_width_};
  }
  ops::AttentionInput k() const {
    if (packed_) return {qkv_.as<std::uint16_t>() + q_width_, row_};
    return {k_.as<std::uint16_t>(), kv_width_};
  }
  ops::AttentionInput v() const {
    if (packed_) return {qkv_.as<std::uint16_t>() + q_width_ + kv_width_, row_};
    return {v_.as<std::uint16_t>(), kv_width_};
  }
  ops::AttentionGradient dq() {
    if (packed_) return {dqkv_.as<std::uint16_t>(), row_};
    return {dq_.as<std::uint16_t>(), q_width_};
  }
  ops::AttentionGradient dk() {
    if (packed_) return {dqkv_.as<std::uint16_t>() + q_width_, row_};
    return {dk_.as<std::uint16_t>(), kv_width_};
  }
  ops::AttentionGradient dv() {
    if (packed_) return {dqkv_.as<std::uint16_t>() + q_width_ + kv_width_, row_};
    return {dv_.as<std::uint16_t>(), kv_width_};
  }

  AttentionShape shape_;
  bool packed_;
  core::Device gpu_;
  core::DeviceContext context_;
  std::int64_t tokens_ = 0, q_width_ = 0, kv_width_ = 0, row_ = 0;
  core::Buffer q_, k_, v_, dq_, dk_, dv_, qkv_, dqkv_, out_, lse_, dout_, workspace_;
};

// ||actual - expected|| / ||expected|| within `tolerance`, every element finite; `error` gets the
// relative error.
::testing::AssertionResult close_normwise(const std::vector<double>& actual, const std::vector<double>& expected,
                                          double tolerance, double& error) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << "size " << actual.size() << " != " << expected.size();
  }
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) return ::testing::AssertionFailure() << "element " << i << " is " << actual[i];
    diff += (actual[i] - expected[i]) * (actual[i] - expected[i]);
    norm += expected[i] * expected[i];
  }
  error = norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  if (error > tolerance) {
    return ::testing::AssertionFailure() << "relative error " << error << " > " << tolerance;
  }
  return ::testing::AssertionSuccess();
}

void expect_matches_reference(const AttentionShape& s, const Outputs& gpu, const Reference& ref,
                              const std::string& where) {
  double e_out = 0, e_lse = 0, e_dq = 0, e_dk = 0, e_dv = 0;
  EXPECT_TRUE(close_normwise(to_double(gpu.out), ref.out, kOutputTolerance, e_out)) << where << ": out";
  EXPECT_TRUE(close_normwise(to_double(gpu.lse), ref.lse, kLseTolerance, e_lse)) << where << ": lse";
  EXPECT_TRUE(close_normwise(to_double(gpu.dq), ref.dq, kGradientTolerance, e_dq)) << where << ": dq";
  EXPECT_TRUE(close_normwise(to_double(gpu.dk), ref.dk, kGradientTolerance, e_dk)) << where << ": dk";
  EXPECT_TRUE(close_normwise(to_double(gpu.dv), ref.dv, kGradientTolerance, e_dv)) << where << ": dv";
  std::printf("[ errors   ] %-40s out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", where.c_str(), e_out, e_lse, e_dq, e_dk,
              e_dv);
}

Outputs run(const AttentionShape& s, const Inputs& in, bool packed, int forward_variant = -1,
            int backward_variant = -1) {
  GpuAttention gpu(s, in, packed);
  gpu.forward(forward_variant);
  gpu.backward(backward_variant);
  return gpu.results();
}

TEST(AttentionGpu, MatchesReferenceOnAwkwardShapes) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const AttentionShape shapes[] = {{1, 1, 2, 1, 64},    {3, 1, 4, 4, 128},  {1, 17, 4, 2, 128},   {3, 17, 4, 1, 64},
                                   {3, 63, 4, 1, 128},  {1, 63, 2, 2, 64},  {1, 64, 4, 2, 64},    {3, 64, 4, 4, 128},
                                   {3, 65, 8, 2, 64},   {1, 65, 4, 1, 128}, {3, 129, 4, 2, 128},  {1, 200, 4, 1, 128},
                                   {3, 200, 2, 1, 64},  {1, 200, 8, 2, 64}, {1, 1000, 4, 2, 128}, {1, 1000, 4, 1, 64},
                                   {1, 1000, 2, 2, 128}};
  for (const auto& s : shapes) {
    const Inputs in = random_inputs(rng, s);
    expect_matches_reference(s, run(s, in, false), reference(s, in), describe(s));
  }
}

TEST(AttentionGpu, EveryTileVariantMatchesReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  int device = 0, smem_limit = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), cudaSuccess);
  for (const AttentionShape& s : {AttentionShape{2, 301, 4, 1, 64}, AttentionShape{2, 301, 4, 2, 128}}) {
    const Inputs in = random_inputs(rng, s);
    const Reference ref = reference(s, in);
    for (const bool backward : {false, true}) {
      for (int i = 0; i < ops::attention_cuda_variant_count(s.head_dim, backward); ++i) {
        const std::string where = describe(s) + (backward ? " backward [" : " forward [") +
                                  ops::attention_cuda_variant_name(s.head_dim, backward, i) + "]";
        if (ops::attention_cuda_variant_smem_bytes(s.head_dim, backward, i) > static_cast<std::size_t>(smem_limit)) {
          std::printf("[ skipped  ] %s: needs more shared memory than this device has\n", where.c_str());
          continue;
        }
        if (!ops::attention_cuda_variant_available(s.head_dim, backward, i)) {
          std::printf("[ skipped  ] %s: needs a Hopper GPU and a build with sm_90a code\n", where.c_str());
          continue;
        }
        expect_matches_reference(s, run(s, in, false, backward ? -1 : i, backward ? i : -1), ref, where);
      }
    }
  }
}

// The forward variants whose two warpgroups take turns issuing their products ("..., pingpong)")
// run the products of their twin (the same name without ", pingpong") in the same order: on awkward
// shapes their results equal the twin's bit for bit.
TEST(AttentionGpu, PingpongVariantsEqualTheirTwinsBitForBit) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  const std::string marker = ", pingpong";
  const AttentionShape shapes[] = {{1, 1, 2, 1, 64},    {3, 17, 4, 1, 64},   {3, 65, 4, 2, 128}, {2, 129, 8, 2, 64},
                                   {3, 200, 4, 4, 128}, {2, 301, 4, 2, 128}, {1, 1000, 2, 2, 64}};
  int compared = 0;
  for (const auto& s : shapes) {
    const Inputs in = random_inputs(rng, s);
    const Reference ref = reference(s, in);
    for (const bool backward : {false, true}) {
      const int count = ops::attention_cuda_variant_count(s.head_dim, backward);
      for (int i = 0; i < count; ++i) {
        const std::string name = ops::attention_cuda_variant_name(s.head_dim, backward, i);
        const std::size_t at = name.find(marker);
        if (at == std::string::npos || !ops::attention_cuda_variant_available(s.head_dim, backward, i)) continue;
        const std::string twin_name = name.substr(0, at) + name.substr(at + marker.size());
        int twin = -1;
        for (int j = 0; j < count; ++j) {
          if (twin_name == ops::attention_cuda_variant_name(s.head_dim, backward, j)) twin = j;
        }
        ASSERT_GE(twin, 0) << name << " has no twin named " << twin_name;
        const std::string where = describe(s) + (backward ? " backward [" : " forward [") + name + "]";
        SCOPED_TRACE(where);
        const Outputs pingpong = run(s, in, false, backward ? -1 : i, backward ? i : -1);
        const Outputs other = run(s, in, false, backward ? -1 : twin, backward ? twin : -1);
        expect_matches_reference(s, pingpong, ref, where);
        EXPECT_EQ(pingpong.out, other.out);
        EXPECT_EQ(pingpong.lse, other.lse);
        EXPECT_EQ(pingpong.dq, other.dq);
        EXPECT_EQ(pingpong.dk, other.dk);
        EXPECT_EQ(pingpong.dv, other.dv);
        ++compared;
      }
    }
  }
  if (compared == 0)
    GTEST_SKIP() << "no pingpong variant runs here: it needs a Hopper GPU and a build with sm_90a code";
}

// What a block reads past its sequence's end changes nothing (the Hopper variants read the next
// sequence's rows there): with every input of batch 1 replaced, batch 0's outputs, lse and
// gradients are bit-identical, for every variant.
TEST(AttentionGpu, NextSequenceDoesNotLeak) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  int device = 0, smem_limit = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), cudaSuccess);
  for (const AttentionShape& s : {AttentionShape{2, 150, 4, 2, 64}, AttentionShape{2, 150, 4, 1, 128}}) {
    const Inputs in = random_inputs(rng, s);
    Inputs changed = in;
    const Inputs fresh = random_inputs(rng, s);
    auto replace_batch_1 = [](std::vector<std::uint16_t>& to, const std::vector<std::uint16_t>& from) {
      std::copy(from.begin() + static_cast<std::ptrdiff_t>(from.size() / 2), from.end(),
                to.begin() + static_cast<std::ptrdiff_t>(to.size() / 2));
    };
    replace_batch_1(changed.q, fresh.q);
    replace_batch_1(changed.k, fresh.k);
    replace_batch_1(changed.v, fresh.v);
    replace_batch_1(changed.dout, fresh.dout);
    for (const bool backward : {false, true}) {
      for (int i = 0; i < ops::attention_cuda_variant_count(s.head_dim, backward); ++i) {
        if (ops::attention_cuda_variant_smem_bytes(s.head_dim, backward, i) > static_cast<std::size_t>(smem_limit) ||
            !ops::attention_cuda_variant_available(s.head_dim, backward, i)) {
          continue;
        }
        SCOPED_TRACE(describe(s) + (backward ? " backward [" : " forward [") +
                     ops::attention_cuda_variant_name(s.head_dim, backward, i) + "]");
        const Outputs before = run(s, in, false, backward ? -1 : i, backward ? i : -1);
        const Outputs after = run(s, changed, false, backward ? -1 : i, backward ? i : -1);
        auto first_half_equal = [](const auto& a, const auto& b) {
          return std::equal(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(a.size() / 2), b.begin());
        };
        EXPECT_TRUE(first_half_equal(before.out, after.out)) << "out of batch 0";
        EXPECT_TRUE(first_half_equal(before.lse, after.lse)) << "lse of batch 0";
        EXPECT_TRUE(first_half_equal(before.dq, after.dq)) << "dq of batch 0";
        EXPECT_TRUE(first_half_equal(before.dk, after.dk)) << "dk of batch 0";
        EXPECT_TRUE(first_half_equal(before.dv, after.dv)) << "dv of batch 0";
        EXPECT_FALSE(std::equal(before.out.begin(), before.out.end(), after.out.begin())) << "batch 1 did not change";
      }
    }
  }
}

TEST(AttentionGpu, PackedQkvMatchesDenseBitForBit) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  for (const AttentionShape& s :
       {AttentionShape{2, 97, 4, 2, 128}, AttentionShape{3, 130, 8, 2, 64}, AttentionShape{1, 33, 4, 1, 128}}) {
    SCOPED_TRACE(describe(s));
    const Inputs in = random_inputs(rng, s);
    const Outputs dense = run(s, in, false);
    GpuAttention packed_run(s, in, true);
    packed_run.forward();
    packed_run.backward();
    const Outputs packed = packed_run.results();
    EXPECT_EQ(packed.out, dense.out);
    EXPECT_EQ(packed.lse, dense.lse);
    EXPECT_EQ(packed.dq, dense.dq);
    EXPECT_EQ(packed.dk, dense.dk);
    EXPECT_EQ(packed.dv, dense.dv);
    EXPECT_TRUE(packed_run.padding_untouched()) << "a kernel wrote into the padding of the packed dqkv rows";
    expect_matches_reference(s, packed, reference(s, in), describe(s) + " packed");
  }
}

TEST(AttentionGpu, FutureTokensDoNotLeak) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  for (const AttentionShape& s : {AttentionShape{2, 150, 4, 2, 64}, AttentionShape{2, 150, 4, 1, 128}}) {
    SCOPED_TRACE(describe(s));
    Inputs in = random_inputs(rng, s);
    const Outputs before = run(s, in, false);
    const std::int64_t changed = 77, kv_row = s.kv_heads * s.head_dim;
    for (std::int64_t b = 0; b < s.batch; ++b) {
      for (std::int64_t i = 0; i < kv_row; ++i) {
        const auto at = static_cast<std::size_t>((b * s.seq + changed) * kv_row + i);
        in.k[at] = core::float_to_bf16(core::bf16_to_float(in.k[at]) + 3.0f);
        in.v[at] = core::float_to_bf16(-2.0f * core::bf16_to_float(in.v[at]) + 1.0f);
      }
    }
    const Outputs after = run(s, in, false);
    const std::int64_t q_row = s.q_heads * s.head_dim;
    for (std::int64_t b = 0; b < s.batch; ++b) {
      for (std::int64_t t = 0; t < s.seq; ++t) {
        const auto first = static_cast<std::size_t>((b * s.seq + t) * q_row);
        const bool out_same =
            std::equal(before.out.begin() + first, before.out.begin() + first + q_row, after.out.begin() + first);
        const bool dq_same =
            std::equal(before.dq.begin() + first, before.dq.begin() + first + q_row, after.dq.begin() + first);
        if (t < changed) {
          EXPECT_TRUE(out_same) << "out changed at batch " << b << " position " << t;
          EXPECT_TRUE(dq_same) << "dq changed at batch " << b << " position " << t;
          for (std::int64_t h = 0; h < s.q_heads; ++h) {
            const auto at = static_cast<std::size_t>((b * s.q_heads + h) * s.seq + t);
            EXPECT_EQ(before.lse[at], after.lse[at]) << "lse batch " << b << " head " << h << " position " << t;
          }
        } else if (t == changed) {
          EXPECT_FALSE(out_same) << "out did not change at the changed position, batch " << b;
        }
      }
    }
  }
}

TEST(AttentionGpu, BackwardIsBitwiseDeterministic) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  for (const AttentionShape& s : {AttentionShape{2, 700, 8, 2, 128}, AttentionShape{2, 700, 8, 2, 64}}) {
    SCOPED_TRACE(describe(s));
    const Inputs in = random_inputs(rng, s);
    GpuAttention gpu(s, in, true);
    gpu.forward();
    gpu.backward();
    const Outputs first = gpu.results();
    for (int run_index = 0; run_index < 3; ++run_index) {
      gpu.forward();
      gpu.backward();
      const Outputs again = gpu.results();
      EXPECT_EQ(again.out, first.out);
      EXPECT_EQ(again.lse, first.lse);
      EXPECT_EQ(again.dq, first.dq);
      EXPECT_EQ(again.dk, first.dk);
      EXPECT_EQ(again.dv, first.dv);
    }
  }
}

TEST(AttentionGpu, EmptyShapesLaunchNothing) {
  REQUIRE_GPU();
  for (const AttentionShape& s : {AttentionShape{0, 16, 4, 2, 64}, AttentionShape{2, 0, 4, 2, 128}}) {
    EXPECT_EQ(ops::attention_backward_workspace_bytes(s), 0u);
    EXPECT_NO_THROW(ops::attention_forward_cuda(s, {}, {}, {}, nullptr, nullptr, nullptr));
    EXPECT_NO_THROW(
        ops::attention_backward_cuda(s, {}, {}, {}, nullptr, nullptr, nullptr, {}, {}, {}, nullptr, 0, nullptr));
  }
}

TEST(AttentionGpu, RejectsUnsupportedArguments) {
  REQUIRE_GPU();
  const core::Device gpu = core::Device::cuda(0);
  const AttentionShape s{1, 16, 4, 2, 64};
  core::Buffer q(gpu, q_size(s) * 2), k(gpu, kv_size(s) * 2), v(gpu, kv_size(s) * 2), out(gpu, q_size(s) * 2),
      lse(gpu, lse_size(s) * 4), workspace(gpu, ops::attention_backward_workspace_bytes(s));
  const ops::AttentionInput qi{q.as<std::uint16_t>(), 4 * 64}, ki{k.as<std::uint16_t>(), 2 * 64},
      vi{v.as<std::uint16_t>(), 2 * 64};
  auto* o = out.as<std::uint16_t>();
  auto* l = lse.as<float>();
  auto expect_error = [](auto&& call, const std::string& fragment) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one containing '" << fragment << "'";
    } catch (const core::Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_error(
      [&] {
        ops::attention_forward_cuda({1, 16, 4, 2, 96}, qi, ki, vi, o, l, nullptr);
      },
      "head_dim must be 64 or 128");
  expect_error(
      [&] {
        ops::attention_forward_cuda({1, 16, 4, 3, 64}, qi, ki, vi, o, l, nullptr);
      },
      "must be a multiple of kv_heads");
  expect_error(
      [&] {
        ops::attention_forward_cuda(s, {q.as<std::uint16_t>() + 1, 256}, ki, vi, o, l, nullptr);
      },
      "q must be 16-byte aligned");
  expect_error(
      [&] {
        ops::attention_forward_cuda(s, qi, {k.as<std::uint16_t>(), 132}, vi, o, l, nullptr);
      },
      "k token_stride must be a multiple of 8");
  expect_error(
      [&] {
        ops::attention_forward_cuda(s, qi, {k.as<std::uint16_t>(), 64}, vi, o, l, nullptr);
      },
      "at least 128");
  expect_error([&] { ops::attention_forward_cuda(s, qi, ki, vi, q.as<std::uint16_t>(), l, nullptr); },
               "out overlaps the input q");
  expect_error([&] { ops::attention_forward_cuda(s, qi, ki, vi, o, l, nullptr, 99); }, "no tile variant 99");
  expect_error(
      [&] {
        ops::attention_backward_cuda(s, qi, ki, vi, o, l, o, {q.as<std::uint16_t>(), 256}, {k.as<std::uint16_t>(), 128},
                                     {v.as<std::uint16_t>(), 128}, workspace.data(), workspace.bytes(), nullptr);
      },
      "dq overlaps the input q");
  core::Buffer dq(gpu, q_size(s) * 2), dk(gpu, kv_size(s) * 2), dv(gpu, kv_size(s) * 2);
  expect_error(
      [&] {
        ops::attention_backward_cuda(s, qi, ki, vi, o, l, o, {dq.as<std::uint16_t>(), 256},
                                     {dk.as<std::uint16_t>(), 128}, {dv.as<std::uint16_t>(), 128}, workspace.data(),
                                     workspace.bytes() - 4, nullptr);
      },
      "workspace holds");
}

}  // namespace
