// The CUDA kernels of embedding, RMSNorm (and the per-head norm of q/k), RoPE and SwiGLU against
// their CPU references on fresh random bf16 inputs. The reference runs in fp32/fp64 on the exact
// fp32 values of the same bf16 words, so a kernel's bf16 output may differ from it only by its own
// rounding: tolerances are stated in bf16 ulps of the reference value (1 ulp = 2^-7 relative at
// most), plus a small absolute term where the formula cancels; fp32 weight gradients must agree
// normwise within 1e-5. Outputs are filled with NaN before every run, so an element a kernel
// forgets fails; every op is run twice and must be bit-identical; weight gradients accumulate
// onto random values; rope runs in place and inside a packed qkv buffer; the fused q/k norm + rope
// equals the separate kernels.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/buffer.h"
#include "core/device.h"
#include "core/half.h"
#include "models/ops/embedding.h"
#include "models/ops/qk_norm_rope.h"
#include "models/ops/rmsnorm.h"
#include "models/ops/rope.h"
#include "models/ops/swiglu.h"
#include "support/op_test_support.h"

namespace {

namespace ops = models::ops;
using Bits = std::vector<std::uint16_t>;

constexpr double kEps = 1e-6;
constexpr std::uint16_t kPoisonBf16 = 0xFFFF;  // a bf16 NaN; 0xFFFFFFFF is an fp32 NaN

// bf16 words for the GPU and their exact fp32 values for the reference.
struct Bf16Data {
  Bits bits;
  std::vector<float> values;
};

Bf16Data random_bf16(std::mt19937_64& rng, std::size_t n, float scale = 1.0f) {
  Bf16Data out;
  const auto raw = test::random_normal(rng, n, scale);
  out.bits.resize(n);
  out.values.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    out.bits[i] = core::float_to_bf16(raw[i]);
    out.values[i] = core::bf16_to_float(out.bits[i]);
  }
  return out;
}

std::vector<float> bf16_values(const Bits& bits) {
  std::vector<float> out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) out[i] = core::bf16_to_float(bits[i]);
  return out;
}

template <typename T>
core::Buffer to_device(const std::vector<T>& values) {
  core::Buffer buffer(core::Device::cuda(), values.size() * sizeof(T));
  test::from_host(buffer, values);
  return buffer;
}

// A device buffer of `bytes` filled with 0xFF bytes (NaN as bf16 and as fp32).
// The fill runs on the legacy default stream, which the library's non-blocking streams do not
// wait for: finish it before any kernel may write the buffer.
core::Buffer poisoned(std::size_t bytes) {
  core::Buffer buffer(core::Device::cuda(), bytes);
  buffer.fill_bytes(0xFF);
  CUDA_CHECK(cudaDeviceSynchronize());
  return buffer;
}

void poison(core::Buffer& buffer, cudaStream_t stream) { buffer.fill_bytes(0xFF, stream); }

__nv_bfloat16* bf16(core::Buffer& buffer) { return buffer.as<__nv_bfloat16>(); }

std::vector<float> bf16_from_device(const core::Buffer& buffer) {
  return bf16_values(test::to_host<std::uint16_t>(buffer));
}

double bf16_ulp(double value) {
  if (value == 0.0) return 0.0;
  int exponent = 0;
  std::frexp(std::fabs(value), &exponent);
  return std::ldexp(1.0, exponent - 8);
}

double rms(const std::vector<float>& values) {
  double sum = 0.0;
  for (const float v : values) sum += double(v) * v;
  return values.empty() ? 0.0 : std::sqrt(sum / static_cast<double>(values.size()));
}

double max_abs(const std::vector<float>& values) {
  double m = 0.0;
  for (const float v : values) m = std::max(m, std::fabs(double(v)));
  return m;
}

// rms over all elements of rstd[n] * dy[n, d] * w[d]: the size of the terms whose difference is
// RMSNorm's dx, so the absolute tolerance of dx where it cancels (dim 1 makes dx vanish).
double rmsnorm_gradient_scale(const std::vector<float>& dy, const std::vector<float>& w, const std::vector<float>& rstd,
                              std::int64_t rows, std::int64_t dim) {
  double sum = 0.0;
  for (std::int64_t n = 0; n < rows; ++n) {
    for (std::int64_t d = 0; d < dim; ++d) {
      const double g = double(rstd[n]) * dy[n * dim + d] * w[d];
      sum += g * g;
    }
  }
  return rows == 0 ? 0.0 : std::sqrt(sum / static_cast<double>(rows * dim));
}

// |actual - expected| <= ulps * bf16_ulp(expected) + atol for every element (NaN fails); names the worst.
::testing::AssertionResult within_bf16_ulps(const std::vector<float>& actual, const std::vector<float>& expected,
                                            double ulps, double atol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << "size " << actual.size() << " != expected " << expected.size();
  }
  std::size_t bad = 0, worst = 0;
  double worst_ratio = -1.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double err = std::fabs(double(actual[i]) - double(expected[i]));
    const double limit = ulps * bf16_ulp(expected[i]) + atol;
    if (!(err <= limit)) {
      ++bad;
      const double ratio = std::isfinite(err) ? err / std::max(limit, 1e-300) : 1e300;
      if (ratio > worst_ratio) {
        worst_ratio = ratio;
        worst = i;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(9);
  os << bad << " of " << actual.size() << " elements beyond " << ulps << " bf16 ulps + " << atol << "; worst at ["
     << worst << "]: " << actual[worst] << " vs expected " << expected[worst];
  return ::testing::AssertionFailure() << os.str();
}

// ||actual - expected||_2 <= rtol * ||expected||_2 and every element finite.
::testing::AssertionResult normwise_close(const std::vector<float>& actual, const std::vector<float>& expected,
                                          double rtol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << "size " << actual.size() << " != expected " << expected.size();
  }
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) return ::testing::AssertionFailure() << "element " << i << " is " << actual[i];
    const double d = double(actual[i]) - double(expected[i]);
    diff += d * d;
    norm += double(expected[i]) * expected[i];
  }
  if (std::sqrt(diff) <= rtol * std::sqrt(norm)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "relative normwise error " << std::sqrt(diff / norm) << " > " << rtol;
}

template <typename T>
::testing::AssertionResult bit_identical(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " and " << b.size();
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return ::testing::AssertionFailure() << "first difference at " << i;
  }
  return ::testing::AssertionSuccess();
}

// Columns [offset, offset + count) of every row of a row-major [rows, width] matrix.
template <typename T>
std::vector<T> columns(const std::vector<T>& packed, std::int64_t rows, std::int64_t width, std::int64_t offset,
                       std::int64_t count) {
  std::vector<T> out(static_cast<std::size_t>(rows * count));
  for (std::int64_t r = 0; r < rows; ++r) {
    std::copy_n(packed.begin() + r * width + offset, count, out.begin() + r * count);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Embedding

struct EmbeddingCase {
  std::int64_t tokens, vocab, dim;
  bool skewed;  // half of the tokens share one id (a long run across many backward windows)
};

TEST(OpsGpu, EmbeddingMatchesReferenceAndAccumulatesDeterministically) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  const EmbeddingCase cases[] = {{1, 5, 1, false},        {1, 5, 4097, false},     {37, 1, 64, false},
                                 {1000, 7, 3, false},     {1000, 7, 100, false},   {4099, 3, 1024, false},
                                 {300, 151936, 8, false}, {301, 151936, 7, false}, {513, 50, 4097, false},
                                 {2048, 1000, 64, false}, {5000, 2000, 128, true}, {0, 10, 64, false}};
  for (const EmbeddingCase& c : cases) {
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + " vocab " + std::to_string(c.vocab) + " dim " +
                 std::to_string(c.dim));
    std::uniform_int_distribution<std::int32_t> any_id(0, static_cast<std::int32_t>(c.vocab - 1));
    std::bernoulli_distribution hot(0.5);
    const std::int32_t hot_id = any_id(rng);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(c.tokens));
    for (auto& id : ids) id = c.skewed && hot(rng) ? hot_id : any_id(rng);
    const auto table = random_bf16(rng, c.vocab * c.dim);
    const auto dout = random_bf16(rng, c.tokens * c.dim);
    const auto dtable_init = test::random_normal(rng, c.vocab * c.dim);

    std::vector<float> out_ref(c.tokens * c.dim);
    ops::embedding_forward_cpu<float>(ids, table.values, c.vocab, c.dim, out_ref);
    std::vector<float> dtable_ref = dtable_init;
    ops::embedding_backward_cpu<float>(ids, dout.values, c.vocab, c.dim, dtable_ref);

    auto ids_d = to_device(ids);
    auto table_d = to_device(table.bits);
    auto dout_d = to_device(dout.bits);
    auto flag_d = to_device(std::vector<std::int32_t>{0});
    core::Buffer workspace(core::Device::cuda(), ops::embedding_backward_workspace_bytes(c.tokens, c.vocab, c.dim));
    auto out_d = poisoned(out_ref.size() * 2);

    std::vector<float> first_out, first_dtable;
    for (int run = 0; run < 2; ++run) {
      poison(out_d, stream);
      poison(workspace, stream);
      auto dtable_d = to_device(dtable_init);
      ops::embedding_forward_cuda(ids_d.as<std::int32_t>(), c.tokens, bf16(table_d), c.vocab, c.dim, bf16(out_d),
                                  flag_d.as<std::int32_t>(), stream);
      ops::embedding_backward_cuda(ids_d.as<std::int32_t>(), c.tokens, bf16(dout_d), c.vocab, c.dim,
                                   dtable_d.as<float>(), flag_d.as<std::int32_t>(), workspace.data(), workspace.bytes(),
                                   stream);
      const auto out = bf16_from_device(out_d);
      const auto dtable = test::to_host<float>(dtable_d);
      if (run == 0) {
        // The forward is a copy: exact.
        EXPECT_TRUE(bit_identical(out, out_ref));
        EXPECT_TRUE(normwise_close(dtable, dtable_ref, 1e-5));
        EXPECT_TRUE(test::all_close(dtable, dtable_ref, 1e-4, 1e-4 * rms(dtable_ref)));
        // Rows of ids that do not occur are not touched.
        const std::set<std::int32_t> used(ids.begin(), ids.end());
        std::size_t untouched_differ = 0;
        for (std::int64_t v = 0; v < c.vocab; ++v) {
          if (used.count(static_cast<std::int32_t>(v)) != 0) continue;
          for (std::int64_t d = 0; d < c.dim; ++d)
            untouched_differ += dtable[v * c.dim + d] != dtable_init[v * c.dim + d];
        }
        EXPECT_EQ(untouched_differ, 0u);
        first_out = out;
        first_dtable = dtable;
      } else {
        EXPECT_TRUE(bit_identical(out, first_out)) << "forward not deterministic";
        EXPECT_TRUE(bit_identical(dtable, first_dtable)) << "backward not deterministic";
      }
    }
    EXPECT_EQ(test::to_host<std::int32_t>(flag_d)[0], 0) << "in-range ids raised the flag";
  }
}

TEST(OpsGpu, EmbeddingClampsOutOfRangeIdsAndRaisesTheFlag) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  const std::int64_t vocab = 10;
  const std::vector<std::int32_t> ids = {3, -1, 10, 2147483647, -2147483647 - 1, 9, 0};
  const std::vector<std::int32_t> clamped = {3, 0, 9, 9, 0, 9, 0};
  const auto tokens = static_cast<std::int64_t>(ids.size());
  for (const std::int64_t dim : {16, 5}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    const auto table = random_bf16(rng, vocab * dim);
    const auto dout = random_bf16(rng, tokens * dim);
    const auto dtable_init = test::random_normal(rng, vocab * dim);
    std::vector<float> out_ref(tokens * dim), dtable_ref = dtable_init;
    ops::embedding_forward_cpu<float>(clamped, table.values, vocab, dim, out_ref);
    ops::embedding_backward_cpu<float>(clamped, dout.values, vocab, dim, dtable_ref);

    auto ids_d = to_device(ids);
    auto table_d = to_device(table.bits);
    auto dout_d = to_device(dout.bits);
    auto dtable_d = to_device(dtable_init);
    auto out_d = poisoned(out_ref.size() * 2);
    core::Buffer workspace(core::Device::cuda(), ops::embedding_backward_workspace_bytes(tokens, vocab, dim));

    auto flag_d = to_device(std::vector<std::int32_t>{0});
    ops::embedding_forward_cuda(ids_d.as<std::int32_t>(), tokens, bf16(table_d), vocab, dim, bf16(out_d),
                                flag_d.as<std::int32_t>(), stream);
    EXPECT_EQ(test::to_host<std::int32_t>(flag_d)[0], 1);
    EXPECT_TRUE(bit_identical(bf16_from_device(out_d), out_ref));

    flag_d = to_device(std::vector<std::int32_t>{0});
    ops::embedding_backward_cuda(ids_d.as<std::int32_t>(), tokens, bf16(dout_d), vocab, dim, dtable_d.as<float>(),
                                 flag_d.as<std::int32_t>(), workspace.data(), workspace.bytes(), stream);
    EXPECT_EQ(test::to_host<std::int32_t>(flag_d)[0], 1);
    EXPECT_TRUE(normwise_close(test::to_host<float>(dtable_d), dtable_ref, 1e-6));

    // Without a flag the ids are still clamped.
    poison(out_d, stream);
    ops::embedding_forward_cuda(ids_d.as<std::int32_t>(), tokens, bf16(table_d), vocab, dim, bf16(out_d), nullptr,
                                stream);
    EXPECT_TRUE(bit_identical(bf16_from_device(out_d), out_ref));
  }
}

// The windowed backward: one sort, then scatters into row windows (each between two guard rows of
// NaN, shuffled, an empty and a one-row window among them) that together cover [0, vocab). The
// assembled rows must be bit-identical to embedding_backward_cuda's, the guards untouched, and
// every window close to the CPU reference of its rows; out-of-range ids raise the flag and clamp.
struct WindowedEmbeddingCase {
  std::int64_t tokens, vocab, dim;
  int distinct;  // ids drawn from this many values (0: the whole vocabulary): long runs when small
  bool invalid;  // some ids out of range
};

TEST(OpsGpu, EmbeddingBackwardInRowWindowsMatchesTheFullBackward) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  std::vector<WindowedEmbeddingCase> cases;
  for (const std::int64_t tokens : {1, 63, 64, 65, 1000}) {
    for (const std::int64_t dim : {1, 7, 8}) {
      cases.push_back({tokens, 1, dim, 0, tokens == 65});
      cases.push_back({tokens, 50257, dim, tokens == 1000 ? 5 : 0, tokens == 63 || tokens == 1000});
      cases.push_back({tokens, 50257, dim, 3, false});
    }
  }
  cases.push_back({65, 1, 1024, 0, false});
  cases.push_back({1000, 50257, 1024, 9, true});
  cases.push_back({1000, 3000, 1024, 0, false});
  cases.push_back({1000, 3000, 1024, 40, false});
  for (const WindowedEmbeddingCase& c : cases) {
    SCOPED_TRACE("tokens " + std::to_string(c.tokens) + " vocab " + std::to_string(c.vocab) + " dim " +
                 std::to_string(c.dim) + " distinct " + std::to_string(c.distinct) +
                 (c.invalid ? " with invalid ids" : ""));
    std::uniform_int_distribution<std::int32_t> any_id(0, static_cast<std::int32_t>(c.vocab - 1));
    std::vector<std::int32_t> pool;
    for (int i = 0; i < c.distinct; ++i) pool.push_back(any_id(rng));
    std::uniform_int_distribution<std::size_t> pick(0, pool.empty() ? 0 : pool.size() - 1);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(c.tokens));
    for (auto& id : ids) id = pool.empty() ? any_id(rng) : pool[pick(rng)];
    std::vector<std::int32_t> clamped = ids;
    if (c.invalid) {
      const std::int32_t bad[] = {-1, static_cast<std::int32_t>(c.vocab), 2147483647, -2147483647 - 1};
      std::uniform_int_distribution<std::size_t> where(0, ids.size() - 1);
      for (int k = 0; k < 4; ++k) {
        const std::size_t n = where(rng);
        ids[n] = bad[k];
        clamped[n] = bad[k] < 0 ? 0 : static_cast<std::int32_t>(c.vocab - 1);
      }
    }
    const auto dout = random_bf16(rng, c.tokens * c.dim);
    const auto dtable_init = test::random_normal(rng, c.vocab * c.dim);
    std::vector<float> dtable_ref = dtable_init;
    ops::embedding_backward_cpu<float>(clamped, dout.values, c.vocab, c.dim, dtable_ref);

    // Window edges: 0, vocab, a used id and the row after it (a one-row window), an unused id and
    // the row after it (a window without tokens), random cuts; then an empty window, all in
    // shuffled order.
    const std::set<std::int32_t> used_ids(clamped.begin(), clamped.end());
    std::set<std::int64_t> edges = {0, c.vocab};
    const std::int64_t used = clamped[std::uniform_int_distribution<std::size_t>(0, clamped.size() - 1)(rng)];
    edges.insert(used);
    edges.insert(used + 1);
    const bool has_unused = static_cast<std::int64_t>(used_ids.size()) < c.vocab;
    if (has_unused) {
      std::int64_t unused = any_id(rng);
      while (used_ids.count(static_cast<std::int32_t>(unused)) != 0) unused = (unused + 1) % c.vocab;
      edges.insert(unused);
      edges.insert(unused + 1);
    }
    std::uniform_int_distribution<std::int64_t> cut(0, c.vocab);
    for (int k = 0; k < 3; ++k) edges.insert(cut(rng));
    std::vector<std::pair<std::int64_t, std::int64_t>> windows;
    for (auto it = edges.begin(); std::next(it) != edges.end(); ++it) windows.emplace_back(*it, *std::next(it));
    const std::int64_t at = cut(rng);
    windows.emplace_back(at, at);
    std::shuffle(windows.begin(), windows.end(), rng);

    auto ids_d = to_device(ids);
    auto dout_d = to_device(dout.bits);
    core::Buffer workspace(core::Device::cuda(), ops::embedding_backward_workspace_bytes(c.tokens, c.vocab, c.dim));
    poison(workspace, stream);

    // The full backward.
    auto flag_d = to_device(std::vector<std::int32_t>{0});
    auto dtable_d = to_device(dtable_init);
    ops::embedding_backward_cuda(ids_d.as<std::int32_t>(), c.tokens, bf16(dout_d), c.vocab, c.dim, dtable_d.as<float>(),
                                 flag_d.as<std::int32_t>(), workspace.data(), workspace.bytes(), stream);
    const auto full = test::to_host<float>(dtable_d);
    EXPECT_EQ(test::to_host<std::int32_t>(flag_d)[0], c.invalid ? 1 : 0) << "full backward flag";
    EXPECT_TRUE(normwise_close(full, dtable_ref, 1e-5));

    // One sort, then the windows.
    poison(workspace, stream);
    flag_d = to_device(std::vector<std::int32_t>{0});
    ops::embedding_backward_sort_cuda(ids_d.as<std::int32_t>(), c.tokens, c.vocab, flag_d.as<std::int32_t>(),
                                      workspace.data(), workspace.bytes(), stream);
    std::vector<float> assembled(full.size(), std::numeric_limits<float>::quiet_NaN());
    int windows_without_tokens = 0;
    for (const auto& [begin, end] : windows) {
      SCOPED_TRACE("rows [" + std::to_string(begin) + ", " + std::to_string(end) + ")");
      const std::int64_t rows = end - begin;
      std::vector<float> guarded((rows + 2) * c.dim, std::bit_cast<float>(0xFFFFFFFFu));
      std::copy(dtable_init.begin() + begin * c.dim, dtable_init.begin() + end * c.dim, guarded.begin() + c.dim);
      auto rows_d = to_device(guarded);
      ops::embedding_backward_scatter_cuda(c.tokens, bf16(dout_d), c.vocab, c.dim, begin, end,
                                           rows_d.as<float>() + c.dim, workspace.data(), workspace.bytes(), stream);
      const auto after = test::to_host<float>(rows_d);
      const std::vector<float> guard_before(after.begin(), after.begin() + c.dim),
          guard_after(after.end() - c.dim, after.end()), poison_row(c.dim, std::bit_cast<float>(0xFFFFFFFFu));
      EXPECT_TRUE(bit_identical(guard_before, poison_row)) << "row before the window written";
      EXPECT_TRUE(bit_identical(guard_after, poison_row)) << "row after the window written";
      const std::vector<float> got(after.begin() + c.dim, after.end() - c.dim);
      std::copy(got.begin(), got.end(), assembled.begin() + begin * c.dim);

      std::vector<float> rows_ref(dtable_init.begin() + begin * c.dim, dtable_init.begin() + end * c.dim);
      ops::embedding_backward_cpu<float>(clamped, dout.values, c.vocab, c.dim, begin, end, rows_ref);
      EXPECT_TRUE(normwise_close(got, rows_ref, 1e-5));
      EXPECT_TRUE(test::all_close(got, rows_ref, 1e-4, 1e-4 * rms(dtable_ref)));
      bool any = false;
      for (std::int64_t r = begin; r < end; ++r) {
        if (used_ids.count(static_cast<std::int32_t>(r)) != 0) {
          any = true;
          continue;
        }
        for (std::int64_t d = 0; d < c.dim; ++d) {
          ASSERT_EQ(got[(r - begin) * c.dim + d], dtable_init[r * c.dim + d]) << "unused row " << r;
        }
      }
      windows_without_tokens += rows > 0 && !any;
    }
    EXPECT_TRUE(bit_identical(assembled, full)) << "windows differ from the full backward";
    EXPECT_EQ(test::to_host<std::int32_t>(flag_d)[0], c.invalid ? 1 : 0) << "sort flag";
    if (has_unused) {
      EXPECT_GT(windows_without_tokens, 0) << "no window without tokens was tried";
    }

    // Without a flag the ids are still clamped: the same result again.
    ops::embedding_backward_sort_cuda(ids_d.as<std::int32_t>(), c.tokens, c.vocab, nullptr, workspace.data(),
                                      workspace.bytes(), stream);
    auto again_d = to_device(dtable_init);
    ops::embedding_backward_scatter_cuda(c.tokens, bf16(dout_d), c.vocab, c.dim, 0, c.vocab, again_d.as<float>(),
                                         workspace.data(), workspace.bytes(), stream);
    EXPECT_TRUE(bit_identical(test::to_host<float>(again_d), full)) << "full-range scatter without a flag";
  }
}

TEST(OpsGpu, EmbeddingWindowedBackwardRejectsMisuse) {
  REQUIRE_GPU();
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  core::Buffer data(core::Device::cuda(), 1 << 16);
  auto* p = bf16(data);
  auto* f = data.as<float>();
  auto* ids = data.as<std::int32_t>();
  const std::size_t needed = ops::embedding_backward_workspace_bytes(64, 10, 8);
  core::Buffer workspace(core::Device::cuda(), needed);
  // Empty inputs and windows are no-ops, whatever the pointers.
  ops::embedding_backward_sort_cuda(nullptr, 0, 10, nullptr, nullptr, 0, stream);
  ops::embedding_backward_scatter_cuda(0, nullptr, 10, 8, 0, 10, nullptr, nullptr, 0, stream);
  ops::embedding_backward_scatter_cuda(64, nullptr, 10, 8, 4, 4, nullptr, nullptr, 0, stream);
  ops::embedding_backward_scatter_cuda(64, nullptr, 10, 8, 10, 10, nullptr, nullptr, 0, stream);
  EXPECT_OP_ERROR(ops::embedding_backward_scatter_cuda(64, p, 10, 8, -1, 4, f, workspace.data(), needed, stream),
                  "row window [-1, 4)");
  EXPECT_OP_ERROR(ops::embedding_backward_scatter_cuda(64, p, 10, 8, 5, 11, f, workspace.data(), needed, stream),
                  "row window [5, 11)");
  EXPECT_OP_ERROR(ops::embedding_backward_scatter_cuda(64, p, 10, 8, 5, 4, f, workspace.data(), needed, stream),
                  "row window [5, 4)");
  EXPECT_OP_ERROR(ops::embedding_backward_scatter_cuda(64, p, 10, 8, 0, 4, f, workspace.data(), needed - 4, stream),
                  "workspace");
  EXPECT_OP_ERROR(ops::embedding_backward_sort_cuda(ids, 64, 10, nullptr, workspace.data(), 16, stream), "workspace");
  EXPECT_OP_ERROR(ops::embedding_backward_sort_cuda(nullptr, 64, 10, nullptr, workspace.data(), needed, stream),
                  "ids must not be null");
  EXPECT_OP_ERROR(ops::embedding_backward_scatter_cuda(64, p, 10, 8, 0, 4, nullptr, workspace.data(), needed, stream),
                  "dtable_rows must not be null");
  EXPECT_OP_ERROR(ops::embedding_backward_scatter_cuda(64, nullptr, 10, 8, 0, 4, f, workspace.data(), needed, stream),
                  "dout must not be null");
  EXPECT_OP_ERROR(ops::embedding_backward_sort_cuda(ids, 64, 0, nullptr, workspace.data(), needed, stream), "vocab");
  context.synchronize();
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

TEST(OpsGpu, RmsNormMatchesReferenceAndAccumulatesDeterministically) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;  // (rows, dim)
  for (const std::int64_t dim : {1, 3, 7, 64, 100, 264, 776, 1024, 4097}) {
    for (const std::int64_t rows : {1, 37, 300}) shapes.emplace_back(rows, dim);
  }
  shapes.emplace_back(20000, 64);   // 40 rows per dweight chunk, 500 chunks
  shapes.emplace_back(4099, 1024);  // a partial last chunk
  for (const auto& [rows, dim] : shapes) {
    SCOPED_TRACE("rows " + std::to_string(rows) + " dim " + std::to_string(dim));
    const auto x = random_bf16(rng, rows * dim, 2.0f);
    const auto w = random_bf16(rng, dim);
    const auto dy = random_bf16(rng, rows * dim);
    const auto dw_init = test::random_normal(rng, dim);

    std::vector<float> y_ref(rows * dim), rstd_ref(rows), dx_ref(rows * dim), dw_ref = dw_init;
    ops::rmsnorm_forward_cpu<float>(x.values, w.values, rows, dim, kEps, y_ref, rstd_ref);
    ops::rmsnorm_backward_cpu<float>(dy.values, x.values, w.values, rstd_ref, rows, dim, dx_ref, dw_ref);

    auto x_d = to_device(x.bits);
    auto w_d = to_device(w.bits);
    auto dy_d = to_device(dy.bits);
    auto rstd_ref_d = to_device(rstd_ref);
    auto y_d = poisoned(y_ref.size() * 2);
    auto rstd_d = poisoned(rows * 4);
    auto dx_d = poisoned(dx_ref.size() * 2);
    core::Buffer workspace(core::Device::cuda(), ops::rmsnorm_backward_workspace_bytes(rows, dim));

    std::vector<float> first_y, first_rstd, first_dx, first_dw;
    for (int run = 0; run < 2; ++run) {
      poison(y_d, stream);
      poison(rstd_d, stream);
      poison(dx_d, stream);
      poison(workspace, stream);
      auto dw_d = to_device(dw_init);
      ops::rmsnorm_forward_cuda(bf16(x_d), bf16(w_d), rows, dim, kEps, bf16(y_d), rstd_d.as<float>(), stream);
      // The backward reads the reference's rstd, so it is checked on its own.
      ops::rmsnorm_backward_cuda(bf16(dy_d), bf16(x_d), bf16(w_d), rstd_ref_d.as<float>(), rows, dim, bf16(dx_d),
                                 dw_d.as<float>(), workspace.data(), workspace.bytes(), stream);
      const auto y = bf16_from_device(y_d);
      const auto rstd = test::to_host<float>(rstd_d);
      const auto dx = bf16_from_device(dx_d);
      const auto dw = test::to_host<float>(dw_d);
      if (run == 0) {
        EXPECT_TRUE(within_bf16_ulps(y, y_ref, 1.0, 0.0)) << "y";
        EXPECT_TRUE(test::all_close(rstd, rstd_ref, 1e-5, 0.0)) << "rstd";
        const double dx_atol = 1e-5 * rmsnorm_gradient_scale(dy.values, w.values, rstd_ref, rows, dim);
        EXPECT_TRUE(within_bf16_ulps(dx, dx_ref, 1.0, dx_atol)) << "dx";
        EXPECT_TRUE(normwise_close(dw, dw_ref, 1e-5)) << "dw";
        EXPECT_TRUE(test::all_close(dw, dw_ref, 1e-4, 1e-5 * rms(dw_ref))) << "dw";
        first_y = y, first_rstd = rstd, first_dx = dx, first_dw = dw;
      } else {
        EXPECT_TRUE(bit_identical(y, first_y)) << "y not deterministic";
        EXPECT_TRUE(bit_identical(rstd, first_rstd)) << "rstd not deterministic";
        EXPECT_TRUE(bit_identical(dx, first_dx)) << "dx not deterministic";
        EXPECT_TRUE(bit_identical(dw, first_dw)) << "dw not deterministic";
      }
    }
  }
}

struct QkvShape {
  std::int64_t tokens, q_heads, kv_heads, head_dim;
  std::int64_t width() const { return (q_heads + 2 * kv_heads) * head_dim; }
};

// q and k normed straight out of a packed qkv buffer: q into a dense [tokens, Hq, hd] buffer, k into
// the k slot of a packed output (the rest of which must stay untouched); the backward writes dq and
// dk into the slots of a packed dqkv.
TEST(OpsGpu, HeadRmsNormMatchesReferenceInsidePackedQkv) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  const QkvShape shapes[] = {{1, 16, 8, 128},  {7, 16, 8, 64}, {33, 3, 1, 5},
                             {129, 8, 8, 128}, {2, 2, 1, 7},   {300, 16, 8, 128}};
  for (const QkvShape& s : shapes) {
    SCOPED_TRACE("tokens " + std::to_string(s.tokens) + " heads " + std::to_string(s.q_heads) + "/" +
                 std::to_string(s.kv_heads) + " head_dim " + std::to_string(s.head_dim));
    const std::int64_t width = s.width(), hd = s.head_dim, k_offset = s.q_heads * hd;
    const auto qkv = random_bf16(rng, s.tokens * width, 2.0f);
    const auto dqkv_in = random_bf16(rng, s.tokens * width);  // upstream gradients, same packing
    const auto wq = random_bf16(rng, hd), wk = random_bf16(rng, hd);
    const auto dwq_init = test::random_normal(rng, hd), dwk_init = test::random_normal(rng, hd);

    // References on dense copies.
    const auto q = columns(qkv.values, s.tokens, width, 0, s.q_heads * hd);
    const auto k = columns(qkv.values, s.tokens, width, k_offset, s.kv_heads * hd);
    const auto dq_out = columns(dqkv_in.values, s.tokens, width, 0, s.q_heads * hd);
    const auto dk_out = columns(dqkv_in.values, s.tokens, width, k_offset, s.kv_heads * hd);
    std::vector<float> qn_ref(q.size()), q_rstd_ref(s.tokens * s.q_heads), dq_ref(q.size()), dwq_ref = dwq_init;
    std::vector<float> kn_ref(k.size()), k_rstd_ref(s.tokens * s.kv_heads), dk_ref(k.size()), dwk_ref = dwk_init;
    ops::head_rmsnorm_forward_cpu<float>(q, wq.values, s.tokens, s.q_heads, hd, kEps, qn_ref, q_rstd_ref);
    ops::head_rmsnorm_forward_cpu<float>(k, wk.values, s.tokens, s.kv_heads, hd, kEps, kn_ref, k_rstd_ref);
    ops::head_rmsnorm_backward_cpu<float>(dq_out, q, wq.values, q_rstd_ref, s.tokens, s.q_heads, hd, dq_ref, dwq_ref);
    ops::head_rmsnorm_backward_cpu<float>(dk_out, k, wk.values, k_rstd_ref, s.tokens, s.kv_heads, hd, dk_ref, dwk_ref);

    auto qkv_d = to_device(qkv.bits);
    auto dqkv_in_d = to_device(dqkv_in.bits);
    auto wq_d = to_device(wq.bits), wk_d = to_device(wk.bits);
    auto dwq_d = to_device(dwq_init), dwk_d = to_device(dwk_init);
    auto q_rstd_ref_d = to_device(q_rstd_ref), k_rstd_ref_d = to_device(k_rstd_ref);
    auto qn_d = poisoned(q.size() * 2);
    auto packed_out_d = poisoned(qkv.bits.size() * 2);
    auto dqkv_d = poisoned(qkv.bits.size() * 2);
    auto q_rstd_d = poisoned(q_rstd_ref.size() * 4), k_rstd_d = poisoned(k_rstd_ref.size() * 4);
    core::Buffer ws_q(core::Device::cuda(), ops::head_rmsnorm_backward_workspace_bytes(s.tokens, s.q_heads, hd));
    core::Buffer ws_k(core::Device::cuda(), ops::head_rmsnorm_backward_workspace_bytes(s.tokens, s.kv_heads, hd));

    ops::head_rmsnorm_forward_cuda(bf16(qkv_d), width, bf16(wq_d), s.tokens, s.q_heads, hd, kEps, bf16(qn_d),
                                   s.q_heads * hd, q_rstd_d.as<float>(), stream);
    ops::head_rmsnorm_forward_cuda(bf16(qkv_d) + k_offset, width, bf16(wk_d), s.tokens, s.kv_heads, hd, kEps,
                                   bf16(packed_out_d) + k_offset, width, k_rstd_d.as<float>(), stream);
    ops::head_rmsnorm_backward_cuda(bf16(dqkv_in_d), width, bf16(qkv_d), width, bf16(wq_d), q_rstd_ref_d.as<float>(),
                                    s.tokens, s.q_heads, hd, bf16(dqkv_d), width, dwq_d.as<float>(), ws_q.data(),
                                    ws_q.bytes(), stream);
    ops::head_rmsnorm_backward_cuda(bf16(dqkv_in_d) + k_offset, width, bf16(qkv_d) + k_offset, width, bf16(wk_d),
                                    k_rstd_ref_d.as<float>(), s.tokens, s.kv_heads, hd, bf16(dqkv_d) + k_offset, width,
                                    dwk_d.as<float>(), ws_k.data(), ws_k.bytes(), stream);

    EXPECT_TRUE(within_bf16_ulps(bf16_from_device(qn_d), qn_ref, 1.0, 0.0)) << "q normed";
    EXPECT_TRUE(test::all_close(test::to_host<float>(q_rstd_d), q_rstd_ref, 1e-5, 0.0)) << "q rstd";
    EXPECT_TRUE(test::all_close(test::to_host<float>(k_rstd_d), k_rstd_ref, 1e-5, 0.0)) << "k rstd";
    const auto packed_out = test::to_host<std::uint16_t>(packed_out_d);
    EXPECT_TRUE(within_bf16_ulps(bf16_values(columns(packed_out, s.tokens, width, k_offset, s.kv_heads * hd)), kn_ref,
                                 1.0, 0.0))
        << "k normed";
    const auto dqkv = test::to_host<std::uint16_t>(dqkv_d);
    const double dq_atol = 1e-5 * rmsnorm_gradient_scale(dq_out, wq.values, q_rstd_ref, s.tokens * s.q_heads, hd);
    const double dk_atol = 1e-5 * rmsnorm_gradient_scale(dk_out, wk.values, k_rstd_ref, s.tokens * s.kv_heads, hd);
    EXPECT_TRUE(within_bf16_ulps(bf16_values(columns(dqkv, s.tokens, width, 0, s.q_heads * hd)), dq_ref, 1.0, dq_atol))
        << "dq";
    EXPECT_TRUE(
        within_bf16_ulps(bf16_values(columns(dqkv, s.tokens, width, k_offset, s.kv_heads * hd)), dk_ref, 1.0, dk_atol))
        << "dk";
    EXPECT_TRUE(normwise_close(test::to_host<float>(dwq_d), dwq_ref, 1e-5)) << "dwq";
    EXPECT_TRUE(normwise_close(test::to_host<float>(dwk_d), dwk_ref, 1e-5)) << "dwk";
    // Nothing outside the k slot of the packed output, nor in the v slot of dqkv, was written.
    std::size_t stray = 0;
    for (std::int64_t t = 0; t < s.tokens; ++t) {
      for (std::int64_t c = 0; c < width; ++c) {
        const bool k_slot = c >= k_offset && c < k_offset + s.kv_heads * hd;
        stray += !k_slot && packed_out[t * width + c] != kPoisonBf16;
        stray += c >= k_offset + s.kv_heads * hd && dqkv[t * width + c] != kPoisonBf16;
      }
    }
    EXPECT_EQ(stray, 0u);
  }
}

// ---------------------------------------------------------------------------------------------
// RoPE

struct RopeShape {
  std::int64_t tokens, heads, head_dim;
  std::int32_t max_position;
};

TEST(OpsGpu, RopeMatchesReferenceOutOfPlaceAndInPlace) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  const RopeShape shapes[] = {{1, 1, 2, 40960},     {7, 3, 6, 40960},    {5, 2, 10, 40960},  {17, 4, 18, 40960},
                              {33, 16, 128, 40960}, {129, 8, 64, 40960}, {3, 2, 512, 40960}, {65, 8, 128, 1 << 24}};
  for (const double theta : {1e4, 1e6}) {
    for (const RopeShape& s : shapes) {
      SCOPED_TRACE("tokens " + std::to_string(s.tokens) + " heads " + std::to_string(s.heads) + " head_dim " +
                   std::to_string(s.head_dim) + " theta " + std::to_string(theta));
      const std::int64_t n = s.tokens * s.heads * s.head_dim;
      std::uniform_int_distribution<std::int32_t> any_position(0, s.max_position - 1);
      std::vector<std::int32_t> positions(static_cast<std::size_t>(s.tokens));
      for (auto& p : positions) p = any_position(rng);
      const auto x = random_bf16(rng, n);
      std::vector<float> out_ref(n), back_ref(n);
      ops::rope_forward_cpu<float>(x.values, positions, s.heads, s.head_dim, theta, out_ref);
      ops::rope_backward_cpu<float>(x.values, positions, s.heads, s.head_dim, theta, back_ref);
      // Rotation error in fp32 is a few 1e-7 of the pair's magnitude; it only shows where a
      // result cancels to far below its inputs.
      const double atol = 4e-6 * max_abs(x.values);

      auto x_d = to_device(x.bits);
      auto positions_d = to_device(positions);
      auto out_d = poisoned(n * 2);
      const std::int64_t stride = s.heads * s.head_dim;
      std::vector<float> first_out, first_back;
      for (int run = 0; run < 2; ++run) {
        poison(out_d, stream);
        ops::rope_forward_cuda(bf16(x_d), stride, bf16(out_d), stride, positions_d.as<std::int32_t>(), s.tokens,
                               s.heads, s.head_dim, theta, stream);
        const auto out = bf16_from_device(out_d);
        poison(out_d, stream);
        ops::rope_backward_cuda(bf16(x_d), stride, bf16(out_d), stride, positions_d.as<std::int32_t>(), s.tokens,
                                s.heads, s.head_dim, theta, stream);
        const auto back = bf16_from_device(out_d);
        if (run == 0) {
          EXPECT_TRUE(within_bf16_ulps(out, out_ref, 1.0, atol)) << "forward";
          EXPECT_TRUE(within_bf16_ulps(back, back_ref, 1.0, atol)) << "backward";
          first_out = out, first_back = back;
        } else {
          EXPECT_TRUE(bit_identical(out, first_out)) << "forward not deterministic";
          EXPECT_TRUE(bit_identical(back, first_back)) << "backward not deterministic";
        }
      }

      // In place: the same words as out of place.
      auto inplace_d = to_device(x.bits);
      ops::rope_forward_cuda(bf16(inplace_d), stride, bf16(inplace_d), stride, positions_d.as<std::int32_t>(), s.tokens,
                             s.heads, s.head_dim, theta, stream);
      EXPECT_TRUE(bit_identical(bf16_from_device(inplace_d), first_out)) << "in-place forward";
      inplace_d = to_device(x.bits);
      ops::rope_backward_cuda(bf16(inplace_d), stride, bf16(inplace_d), stride, positions_d.as<std::int32_t>(),
                              s.tokens, s.heads, s.head_dim, theta, stream);
      EXPECT_TRUE(bit_identical(bf16_from_device(inplace_d), first_back)) << "in-place backward";
    }
  }
}

// q and k rotated in place inside a packed qkv buffer (v untouched), and out of place between the
// packed buffer and dense ones in both directions.
TEST(OpsGpu, RopeWorksOnStridedRowsOfPackedQkv) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  const double theta = 1e6;
  const QkvShape shapes[] = {{37, 16, 8, 128}, {5, 3, 1, 6}, {64, 2, 1, 64}, {9, 4, 2, 10}};
  for (const QkvShape& s : shapes) {
    SCOPED_TRACE("tokens " + std::to_string(s.tokens) + " heads " + std::to_string(s.q_heads) + "/" +
                 std::to_string(s.kv_heads) + " head_dim " + std::to_string(s.head_dim));
    const std::int64_t width = s.width(), hd = s.head_dim, k_offset = s.q_heads * hd;
    const std::int64_t q_cols = s.q_heads * hd, k_cols = s.kv_heads * hd, v_offset = k_offset + k_cols;
    std::uniform_int_distribution<std::int32_t> any_position(0, 40959);
    std::vector<std::int32_t> positions(static_cast<std::size_t>(s.tokens));
    for (auto& p : positions) p = any_position(rng);
    const auto qkv = random_bf16(rng, s.tokens * width);
    const auto q = columns(qkv.values, s.tokens, width, 0, q_cols);
    const auto k = columns(qkv.values, s.tokens, width, k_offset, k_cols);
    std::vector<float> q_ref(q.size()), k_ref(k.size()), dq_ref(q.size());
    ops::rope_forward_cpu<float>(q, positions, s.q_heads, hd, theta, q_ref);
    ops::rope_forward_cpu<float>(k, positions, s.kv_heads, hd, theta, k_ref);
    ops::rope_backward_cpu<float>(q, positions, s.q_heads, hd, theta, dq_ref);
    const double atol = 4e-6 * max_abs(qkv.values);
    auto positions_d = to_device(positions);
    const std::int32_t* pos = positions_d.as<std::int32_t>();

    // In place inside the packed buffer.
    auto qkv_d = to_device(qkv.bits);
    ops::rope_forward_cuda(bf16(qkv_d), width, bf16(qkv_d), width, pos, s.tokens, s.q_heads, hd, theta, stream);
    ops::rope_forward_cuda(bf16(qkv_d) + k_offset, width, bf16(qkv_d) + k_offset, width, pos, s.tokens, s.kv_heads, hd,
                           theta, stream);
    const auto rotated = test::to_host<std::uint16_t>(qkv_d);
    EXPECT_TRUE(within_bf16_ulps(bf16_values(columns(rotated, s.tokens, width, 0, q_cols)), q_ref, 1.0, atol)) << "q";
    EXPECT_TRUE(within_bf16_ulps(bf16_values(columns(rotated, s.tokens, width, k_offset, k_cols)), k_ref, 1.0, atol))
        << "k";
    EXPECT_TRUE(bit_identical(columns(rotated, s.tokens, width, v_offset, k_cols),
                              columns(qkv.bits, s.tokens, width, v_offset, k_cols)))
        << "v changed";

    // Packed -> dense (q), then dense -> packed (q slot of a poisoned buffer), backward direction.
    auto source_d = to_device(qkv.bits);
    auto dense_d = poisoned(q.size() * 2);
    ops::rope_forward_cuda(bf16(source_d), width, bf16(dense_d), q_cols, pos, s.tokens, s.q_heads, hd, theta, stream);
    EXPECT_TRUE(bit_identical(test::to_host<std::uint16_t>(dense_d), columns(rotated, s.tokens, width, 0, q_cols)))
        << "packed to dense";
    auto q_dense_d = to_device(columns(qkv.bits, s.tokens, width, 0, q_cols));
    auto packed_d = poisoned(qkv.bits.size() * 2);
    ops::rope_backward_cuda(bf16(q_dense_d), q_cols, bf16(packed_d), width, pos, s.tokens, s.q_heads, hd, theta,
                            stream);
    const auto packed = test::to_host<std::uint16_t>(packed_d);
    EXPECT_TRUE(within_bf16_ulps(bf16_values(columns(packed, s.tokens, width, 0, q_cols)), dq_ref, 1.0, atol))
        << "dense to packed";
    std::size_t stray = 0;
    for (std::int64_t t = 0; t < s.tokens; ++t) {
      for (std::int64_t c = q_cols; c < width; ++c) stray += packed[t * width + c] != kPoisonBf16;
    }
    EXPECT_EQ(stray, 0u) << "elements outside the destination rows were written";
  }
}

// ---------------------------------------------------------------------------------------------
// The fused q/k norm + RoPE against the four launches it replaces (bit for bit, except the order of
// the weight gradients' sums) and against the composed CPU references, inside packed buffers
// whose padding must stay untouched.

TEST(OpsGpu, QkNormRopeEqualsTheSeparateKernelsInsidePackedBuffers) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  const QkvShape shapes[] = {{1, 16, 8, 128},   {7, 3, 1, 64},  {33, 2, 2, 32},
                             {130, 16, 8, 128}, {9, 4, 2, 256}, {300, 8, 8, 64}};
  for (const QkvShape& s : shapes) {
    SCOPED_TRACE("tokens " + std::to_string(s.tokens) + " heads " + std::to_string(s.q_heads) + "/" +
                 std::to_string(s.kv_heads) + " head_dim " + std::to_string(s.head_dim));
    const std::int64_t hd = s.head_dim, width = s.width(), k_offset = s.q_heads * hd;
    const std::int64_t qk_cols = (s.q_heads + s.kv_heads) * hd, out_width = qk_cols + 8;  // padded rows
    const ops::QkNormRopeShape shape{s.tokens, s.q_heads, s.kv_heads, hd, kEps, 1e6};
    std::uniform_int_distribution<std::int32_t> any_position(0, 40959);
    std::vector<std::int32_t> positions(static_cast<std::size_t>(s.tokens));
    for (auto& p : positions) p = any_position(rng);
    const auto qkv = random_bf16(rng, s.tokens * width, 2.0f);
    const auto dqk = random_bf16(rng, s.tokens * out_width);  // upstream gradient, padded rows
    const auto wq = random_bf16(rng, hd), wk = random_bf16(rng, hd);
    const auto dwq_init = test::random_normal(rng, hd), dwk_init = test::random_normal(rng, hd);
    auto qkv_d = to_device(qkv.bits), dqk_d = to_device(dqk.bits), positions_d = to_device(positions);
    auto wq_d = to_device(wq.bits), wk_d = to_device(wk.bits);
    const std::int32_t* pos = positions_d.as<std::int32_t>();

    // The separate kernels: norm q and k into the padded output, rotate in place; backward the
    // other way round into a packed dqkv.
    auto y_sep_d = poisoned(s.tokens * out_width * 2);
    auto rq_sep_d = poisoned(s.tokens * s.q_heads * 4), rk_sep_d = poisoned(s.tokens * s.kv_heads * 4);
    ops::head_rmsnorm_forward_cuda(bf16(qkv_d), width, bf16(wq_d), s.tokens, s.q_heads, hd, kEps, bf16(y_sep_d),
                                   out_width, rq_sep_d.as<float>(), stream);
    ops::head_rmsnorm_forward_cuda(bf16(qkv_d) + k_offset, width, bf16(wk_d), s.tokens, s.kv_heads, hd, kEps,
                                   bf16(y_sep_d) + k_offset, out_width, rk_sep_d.as<float>(), stream);
    ops::rope_forward_cuda(bf16(y_sep_d), out_width, bf16(y_sep_d), out_width, pos, s.tokens, s.q_heads, hd, 1e6,
                           stream);
    ops::rope_forward_cuda(bf16(y_sep_d) + k_offset, out_width, bf16(y_sep_d) + k_offset, out_width, pos, s.tokens,
                           s.kv_heads, hd, 1e6, stream);
    auto rotated_d = to_device(dqk.bits);
    auto dx_sep_d = poisoned(s.tokens * width * 2);
    auto dwq_sep_d = to_device(dwq_init), dwk_sep_d = to_device(dwk_init);
    ops::rope_backward_cuda(bf16(rotated_d), out_width, bf16(rotated_d), out_width, pos, s.tokens, s.q_heads, hd, 1e6,
                            stream);
    ops::rope_backward_cuda(bf16(rotated_d) + k_offset, out_width, bf16(rotated_d) + k_offset, out_width, pos, s.tokens,
                            s.kv_heads, hd, 1e6, stream);
    core::Buffer ws_q(core::Device::cuda(), ops::head_rmsnorm_backward_workspace_bytes(s.tokens, s.q_heads, hd));
    core::Buffer ws_k(core::Device::cuda(), ops::head_rmsnorm_backward_workspace_bytes(s.tokens, s.kv_heads, hd));
    ops::head_rmsnorm_backward_cuda(bf16(rotated_d), out_width, bf16(qkv_d), width, bf16(wq_d), rq_sep_d.as<float>(),
                                    s.tokens, s.q_heads, hd, bf16(dx_sep_d), width, dwq_sep_d.as<float>(), ws_q.data(),
                                    ws_q.bytes(), stream);
    ops::head_rmsnorm_backward_cuda(bf16(rotated_d) + k_offset, out_width, bf16(qkv_d) + k_offset, width, bf16(wk_d),
                                    rk_sep_d.as<float>(), s.tokens, s.kv_heads, hd, bf16(dx_sep_d) + k_offset, width,
                                    dwk_sep_d.as<float>(), ws_k.data(), ws_k.bytes(), stream);

    // Fused, twice: every output bit-identical run to run.
    core::Buffer ws(core::Device::cuda(), ops::qk_norm_rope_backward_workspace_bytes(shape));
    std::vector<std::uint16_t> y_bits[2], dx_bits[2];
    std::vector<float> rq[2], rk[2], dwq[2], dwk[2];
    for (int run = 0; run < 2; ++run) {
      auto y_d = poisoned(s.tokens * out_width * 2), dx_d = poisoned(s.tokens * width * 2);
      auto rq_d = poisoned(s.tokens * s.q_heads * 4), rk_d = poisoned(s.tokens * s.kv_heads * 4);
      auto dwq_d = to_device(dwq_init), dwk_d = to_device(dwk_init);
      ops::qk_norm_rope_forward_cuda(bf16(qkv_d), width, bf16(wq_d), bf16(wk_d), pos, shape, bf16(y_d), out_width,
                                     rq_d.as<float>(), rk_d.as<float>(), stream);
      ops::qk_norm_rope_backward_cuda(bf16(dqk_d), out_width, bf16(qkv_d), width, bf16(wq_d), bf16(wk_d),
                                      rq_d.as<float>(), rk_d.as<float>(), pos, shape, bf16(dx_d), width,
                                      dwq_d.as<float>(), dwk_d.as<float>(), ws.data(), ws.bytes(), stream);
      y_bits[run] = test::to_host<std::uint16_t>(y_d);
      dx_bits[run] = test::to_host<std::uint16_t>(dx_d);
      rq[run] = test::to_host<float>(rq_d);
      rk[run] = test::to_host<float>(rk_d);
      dwq[run] = test::to_host<float>(dwq_d);
      dwk[run] = test::to_host<float>(dwk_d);
    }
    EXPECT_TRUE(bit_identical(y_bits[0], y_bits[1]) && bit_identical(dx_bits[0], dx_bits[1]) &&
                bit_identical(dwq[0], dwq[1]) && bit_identical(dwk[0], dwk[1]))
        << "reruns differ";
    EXPECT_TRUE(bit_identical(y_bits[0], test::to_host<std::uint16_t>(y_sep_d))) << "y (padding included)";
    EXPECT_TRUE(bit_identical(rq[0], test::to_host<float>(rq_sep_d))) << "q rstd";
    EXPECT_TRUE(bit_identical(rk[0], test::to_host<float>(rk_sep_d))) << "k rstd";
    EXPECT_TRUE(bit_identical(dx_bits[0], test::to_host<std::uint16_t>(dx_sep_d))) << "dx (the v slot included)";
    EXPECT_TRUE(normwise_close(dwq[0], test::to_host<float>(dwq_sep_d), 1e-5)) << "dwq";
    EXPECT_TRUE(normwise_close(dwk[0], test::to_host<float>(dwk_sep_d), 1e-5)) << "dwk";

    // The composed references in fp32 on the same values (bf16 rounding between the steps is the
    // kernels' own, so a few ulps of the largest value apart).
    const std::vector<float> x_dense = columns(qkv.values, s.tokens, width, 0, qk_cols);
    const std::vector<float> dy_dense = columns(dqk.values, s.tokens, out_width, 0, qk_cols);
    std::vector<float> y_ref(x_dense.size()), rq_ref(rq[0].size()), rk_ref(rk[0].size());
    ops::qk_norm_rope_forward_cpu<float>(x_dense, wq.values, wk.values, positions, shape, y_ref, rq_ref, rk_ref);
    std::vector<float> dx_ref(x_dense.size()), dwq_ref = dwq_init, dwk_ref = dwk_init;
    ops::qk_norm_rope_backward_cpu<float>(dy_dense, x_dense, wq.values, wk.values, rq_ref, rk_ref, positions, shape,
                                          dx_ref, dwq_ref, dwk_ref);
    EXPECT_TRUE(within_bf16_ulps(bf16_values(columns(y_bits[0], s.tokens, out_width, 0, qk_cols)), y_ref, 1.0,
                                 3.0 * bf16_ulp(max_abs(y_ref))))
        << "y against the reference";
    EXPECT_TRUE(test::all_close(rq[0], rq_ref, 1e-5, 0.0) && test::all_close(rk[0], rk_ref, 1e-5, 0.0)) << "rstd";
    EXPECT_TRUE(normwise_close(bf16_values(columns(dx_bits[0], s.tokens, width, 0, qk_cols)), dx_ref, 1e-2))
        << "dx against the reference";
    EXPECT_TRUE(normwise_close(dwq[0], dwq_ref, 1e-2) && normwise_close(dwk[0], dwk_ref, 1e-2)) << "dweights";
  }
}

TEST(OpsGpu, QkNormRopeRejectsWhatItDoesNotTake) {
  REQUIRE_GPU();
  core::DeviceContext context(core::Device::cuda());
  core::Buffer data(core::Device::cuda(), 1 << 20);
  auto* p = data.as<__nv_bfloat16>();
  auto* f = data.as<float>();
  const auto* pos = data.as<std::int32_t>();
  const ops::QkNormRopeShape odd{4, 2, 1, 48, kEps, 1e6};
  EXPECT_FALSE(ops::qk_norm_rope_supported(odd, {144}, {p}));
  EXPECT_OP_ERROR(ops::qk_norm_rope_forward_cuda(p, 144, p, p, pos, odd, p, 144, f, f, context.stream()), "head_dim");
  const ops::QkNormRopeShape shape{64, 2, 1, 64, kEps, 1e6};
  EXPECT_FALSE(ops::qk_norm_rope_supported(shape, {190}, {p}));      // stride below 3 heads
  EXPECT_FALSE(ops::qk_norm_rope_supported(shape, {256}, {p + 1}));  // unaligned
  EXPECT_OP_ERROR(
      ops::qk_norm_rope_backward_cuda(p, 256, p, 256, p, p, f, f, pos, shape, p, 256, f, f, f, 16, context.stream()),
      "workspace");
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

TEST(OpsGpu, SwigluMatchesReferenceDeterministically) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  for (const std::int64_t features : {1, 3, 7, 64, 100, 1024, 4097}) {
    for (const std::int64_t rows : {1, 7, 64}) {
      SCOPED_TRACE("rows " + std::to_string(rows) + " features " + std::to_string(features));
      // Gates over a wide range (silu's tails and its minimum near -1.28); up and dout ~ N(0, 1).
      Bf16Data gate_up = random_bf16(rng, rows * 2 * features);
      const auto gates = random_bf16(rng, rows * features, 4.0f);
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t f = 0; f < features; ++f) {
          gate_up.bits[r * 2 * features + f] = gates.bits[r * features + f];
          gate_up.values[r * 2 * features + f] = gates.values[r * features + f];
        }
      }
      const auto dout = random_bf16(rng, rows * features);
      std::vector<float> out_ref(rows * features), dgate_up_ref(rows * 2 * features);
      ops::swiglu_forward_cpu<float>(gate_up.values, rows, features, out_ref);
      ops::swiglu_backward_cpu<float>(dout.values, gate_up.values, rows, features, dgate_up_ref);

      auto gate_up_d = to_device(gate_up.bits);
      auto dout_d = to_device(dout.bits);
      auto out_d = poisoned(out_ref.size() * 2);
      auto dgate_up_d = poisoned(dgate_up_ref.size() * 2);
      std::vector<float> first_out, first_grad;
      for (int run = 0; run < 2; ++run) {
        poison(out_d, stream);
        poison(dgate_up_d, stream);
        ops::swiglu_forward_cuda(bf16(gate_up_d), rows, features, bf16(out_d), stream);
        ops::swiglu_backward_cuda(bf16(dout_d), bf16(gate_up_d), rows, features, bf16(dgate_up_d), stream);
        const auto out = bf16_from_device(out_d);
        const auto grad = bf16_from_device(dgate_up_d);
        if (run == 0) {
          EXPECT_TRUE(within_bf16_ulps(out, out_ref, 1.0, 0.0)) << "out";
          const auto dgate_ref = columns(dgate_up_ref, rows, 2 * features, 0, features);
          EXPECT_TRUE(
              within_bf16_ulps(columns(grad, rows, 2 * features, 0, features), dgate_ref, 1.0, 1e-5 * rms(dgate_ref)))
              << "dgate";
          EXPECT_TRUE(within_bf16_ulps(columns(grad, rows, 2 * features, features, features),
                                       columns(dgate_up_ref, rows, 2 * features, features, features), 1.0, 0.0))
              << "dup";
          first_out = out, first_grad = grad;
        } else {
          EXPECT_TRUE(bit_identical(out, first_out)) << "forward not deterministic";
          EXPECT_TRUE(bit_identical(grad, first_grad)) << "backward not deterministic";
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Empty inputs and misuse

TEST(OpsGpu, EmptyInputsAreNoOps) {
  REQUIRE_GPU();
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  EXPECT_EQ(ops::embedding_backward_workspace_bytes(0, 10, 8), 0u);
  EXPECT_EQ(ops::rmsnorm_backward_workspace_bytes(0, 8), 0u);
  ops::embedding_forward_cuda(nullptr, 0, nullptr, 10, 8, nullptr, nullptr, stream);
  ops::embedding_backward_cuda(nullptr, 0, nullptr, 10, 8, nullptr, nullptr, nullptr, 0, stream);
  ops::rmsnorm_forward_cuda(nullptr, nullptr, 0, 8, kEps, nullptr, nullptr, stream);
  ops::rmsnorm_backward_cuda(nullptr, nullptr, nullptr, nullptr, 0, 8, nullptr, nullptr, nullptr, 0, stream);
  ops::rope_forward_cuda(nullptr, 8, nullptr, 8, nullptr, 0, 1, 8, 1e4, stream);
  ops::swiglu_forward_cuda(nullptr, 0, 8, nullptr, stream);
  ops::swiglu_backward_cuda(nullptr, nullptr, 0, 8, nullptr, stream);
  context.synchronize();
}

TEST(OpsGpu, RejectsMisuseBeforeLaunching) {
  REQUIRE_GPU();
  core::DeviceContext context(core::Device::cuda());
  const cudaStream_t stream = context.stream();
  core::Buffer small(core::Device::cuda(), 256);
  core::Buffer data(core::Device::cuda(), 1 << 16);
  auto* p = bf16(data);
  const std::size_t needed = ops::rmsnorm_backward_workspace_bytes(64, 64);
  EXPECT_OP_ERROR(ops::rmsnorm_backward_cuda(p, p, p, data.as<float>(), 64, 64, p, data.as<float>(), small.data(),
                                             std::min<std::size_t>(small.bytes(), needed - 4), stream),
                  "workspace");
  EXPECT_OP_ERROR(ops::embedding_backward_cuda(data.as<std::int32_t>(), 64, p, 10, 8, data.as<float>(), nullptr,
                                               small.data(), 16, stream),
                  "workspace");
  EXPECT_OP_ERROR(ops::rope_forward_cuda(p, 14, p, 14, data.as<std::int32_t>(), 4, 2, 7, 1e4, stream), "even");
  EXPECT_OP_ERROR(ops::rope_forward_cuda(p, 16, p, 32, data.as<std::int32_t>(), 4, 2, 8, 1e4, stream), "in-place");
  EXPECT_OP_ERROR(ops::rope_forward_cuda(p, 8, p + 1024, 16, data.as<std::int32_t>(), 4, 2, 8, 1e4, stream), "stride");
  EXPECT_OP_ERROR(ops::head_rmsnorm_forward_cuda(p, 100, p, 4, 2, 64, kEps, p + 4096, 128, data.as<float>(), stream),
                  "stride");
  EXPECT_OP_ERROR(ops::embedding_forward_cuda(data.as<std::int32_t>(), 4, p, 0, 8, p, nullptr, stream), "vocab");
  context.synchronize();
}

}  // namespace
