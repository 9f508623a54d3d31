// GPU linear layer (LinearPlan) and fused lm_head + cross-entropy (CrossEntropyPlan) against the
// CPU references run in fp64 on the same bf16-rounded inputs, on fresh random data: odd and
// single-row shapes, pointers offset into larger buffers, accumulation onto non-zero gradients,
// ignored targets (some, all, none), token counts that are not multiples of the chunk, odd
// vocabularies and Qwen3's, chunk-size independence, bit-identical reruns, CUDA-graph replay and
// argument checks. Outputs are poisoned with NaN before every run, so an unwritten element fails.
//
// Tolerances (bf16 operands, fp32 accumulation):
//   bf16 outputs (y, dx): elementwise |gpu - ref| <= 2^-7 |ref| + 1e-3 rms(ref) (twice the bf16
//     unit roundoff 2^-8 of the one final rounding), normwise <= 5e-3 (that rounding alone gives
//     about 2^-8 / sqrt(3) = 2.3e-3).
//   dx accumulated onto a bf16 dx (up to two roundings, linear.h): elementwise
//     2^-7 (|dx_initial| + |dy W|) + 1e-3 rms(ref), normwise <= 1e-2.
//   fp32 dW (accumulated onto a random initial value): normwise error of the whole dW <= 1e-4,
//     elementwise <= 1e-3 rms(ref) + 1e-5 |ref|.
//   cross-entropy: the logits are rounded to bf16 (cross_entropy.h), so a token's loss may move by
//     2 * 2^-8 * max_j |logit_j|; checked per token against that bound (x1.5) + 1e-4. Gradients
//     (through the bf16 softmax, bf16 dlogits and bf16 dhidden): normwise <= 2e-2.
//   vocabulary-split backward (backward_hidden + backward_weight_rows):
//     pass 1's loss outputs and dhidden: bit-identical to backward()'s with the same chunk_tokens.
//     token_lse: the bf16 rounding of the logits (at most 2^-8 |logit|) moves a logsumexp by at
//       most sum_j softmax_j 2^-8 |logit_j| to first order; checked against that bound (x1.5)
//       + 1e-5 + 1e-6 |lse| (fp32 sums and __expf/logf) against fp64 logits.
//     dW increment against backward()'s: normwise <= kSplitWeightTolerance (below: the recomputed
//       logits may round to the neighbouring bf16, and the sum over tokens has another order);
//       against the CPU reference: normwise <= 2e-2, as backward()'s.
//     Accumulation (a second call adds the same gradient again): the fp32 tolerance of dW above.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/half.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/linear.h"
#include "models/ops/matmul_cpu.h"
#include "support/test_support.h"

namespace {

namespace ops = models::ops;
using bf16 = __nv_bfloat16;

// ---- host data ----

// N(0, scale^2) values rounded to bf16: the words and their exact values.
struct Bf16Data {
  std::vector<std::uint16_t> words;
  std::vector<double> values;
};

Bf16Data random_bf16(std::mt19937_64& rng, std::size_t n, float scale = 1.0f) {
  Bf16Data out;
  out.words.resize(n);
  out.values.resize(n);
  const auto f = test::random_normal(rng, n, scale);
  for (std::size_t i = 0; i < n; ++i) {
    out.words[i] = core::float_to_bf16(f[i]);
    out.values[i] = core::bf16_to_float(out.words[i]);
  }
  return out;
}

std::vector<double> widen_bf16(const std::vector<std::uint16_t>& words) {
  std::vector<double> out(words.size());
  for (std::size_t i = 0; i < words.size(); ++i) out[i] = core::bf16_to_float(words[i]);
  return out;
}

std::vector<double> widen(const std::vector<float>& values) { return {values.begin(), values.end()}; }

double rms(const std::vector<double>& v) {
  double s = 0.0;
  for (const double x : v) s += x * x;
  return v.empty() ? 0.0 : std::sqrt(s / static_cast<double>(v.size()));
}

double normwise_error(const std::vector<double>& actual, const std::vector<double>& expected) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    diff += (actual[i] - expected[i]) * (actual[i] - expected[i]);
    norm += expected[i] * expected[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
}

struct Tolerance {
  double normwise;  // ||a - e|| / ||e||
  double rtol;      // elementwise, of |e|
  double atol_rms;  // elementwise, of rms(e)
};

constexpr Tolerance kBf16Output{5e-3, 1.0 / 128, 1e-3};
constexpr Tolerance kBf16AccumulatedOutput{1e-2, 1.0 / 128, 1e-3};
constexpr Tolerance kFp32Grad{1e-4, 1e-5, 1e-3};

// Elementwise |a - e| <= rtol * magnitude + atol_rms * rms(e), where magnitude is |e| unless
// `magnitudes` is given (a sum rounded more than once: the sum of its terms' magnitudes).
::testing::AssertionResult close(const std::string& name, const std::vector<double>& actual,
                                 const std::vector<double>& expected, const Tolerance& tol,
                                 const std::vector<double>* magnitudes = nullptr) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << name << ": " << actual.size() << " elements, expected " << expected.size();
  }
  const double atol = tol.atol_rms * rms(expected);
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double err = std::fabs(actual[i] - expected[i]);
    const double magnitude = magnitudes != nullptr ? (*magnitudes)[i] : std::fabs(expected[i]);
    if (!(err <= tol.rtol * magnitude + atol)) {
      return ::testing::AssertionFailure() << name << "[" << i << "] = " << actual[i] << ", expected " << expected[i]
                                           << " (rtol " << tol.rtol << ", atol " << atol << ")";
    }
  }
  const double normwise = normwise_error(actual, expected);
  if (!(normwise <= tol.normwise)) {
    return ::testing::AssertionFailure() << name << ": normwise error " << normwise << " > " << tol.normwise;
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult normwise_close(const std::string& name, const std::vector<double>& actual,
                                          const std::vector<double>& expected, double tolerance) {
  const double normwise = normwise_error(actual, expected);
  if (!(normwise <= tolerance)) {
    return ::testing::AssertionFailure() << name << ": normwise error " << normwise << " > " << tolerance;
  }
  return ::testing::AssertionSuccess();
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// ---- device data ----

core::Buffer device_buffer(std::size_t bytes) { return core::Buffer(core::Device::cuda(0), bytes); }

// NaN in every element (0xFFFF is a bf16 NaN, 0xFFFFFFFF an fp32 NaN).
void poison(core::Buffer& buffer, const core::DeviceContext& context) { buffer.fill_bytes(0xFF, context.stream()); }

// A device copy of `words` starting `offset` elements into the buffer (so the pointer can be
// misaligned); the elements before it are NaN.
struct OffsetArray {
  core::Buffer buffer;
  std::int64_t offset = 0;
  bf16* data() { return buffer.as<bf16>() + offset; }
};

OffsetArray upload_bf16(const std::vector<std::uint16_t>& words, std::int64_t offset) {
  OffsetArray out{device_buffer((words.size() + static_cast<std::size_t>(offset)) * 2), offset};
  std::vector<std::uint16_t> padded(static_cast<std::size_t>(offset), 0xFFFF);
  padded.insert(padded.end(), words.begin(), words.end());
  test::from_host(out.buffer, padded);
  return out;
}

std::vector<std::uint16_t> download_bf16(const OffsetArray& array) {
  auto all = test::to_host<std::uint16_t>(array.buffer);
  return {all.begin() + array.offset, all.end()};
}

struct Workspace {
  core::Buffer buffer;
  explicit Workspace(std::size_t bytes) : buffer(device_buffer(bytes)) {}
  ops::DeviceWorkspace get() { return {buffer.data(), buffer.bytes()}; }
};

// ---- linear ----

struct LinearCase {
  std::int64_t rows, in, out;
  std::int64_t offset;  // elements by which x, dy and the outputs start into their buffers
};

struct LinearRun {
  std::vector<std::uint16_t> y, dx;
  std::vector<float> dw;
};

// Inputs of one linear case, on host and device.
struct LinearInputs {
  LinearCase shape;
  Bf16Data x, w, dy, dx_initial;
  std::vector<float> dw_initial;
  OffsetArray x_d, w_d, dy_d, y_d, dx_d;
  core::Buffer dw_d;

  LinearInputs(std::mt19937_64& rng, const LinearCase& s)
      : shape(s),
        x(random_bf16(rng, s.rows * s.in)),
        w(random_bf16(rng, s.out * s.in, 1.0f / std::sqrt(static_cast<float>(s.in)))),
        dy(random_bf16(rng, s.rows * s.out)),
        dx_initial(random_bf16(rng, s.rows * s.in)),
        dw_initial(test::random_normal(rng, s.out * s.in, 3.0f)),
        x_d(upload_bf16(x.words, s.offset)),
        w_d(upload_bf16(w.words, 3 * s.offset)),
        dy_d(upload_bf16(dy.words, s.offset)),
        y_d(upload_bf16(std::vector<std::uint16_t>(s.rows * s.out), s.offset)),
        dx_d(upload_bf16(std::vector<std::uint16_t>(s.rows * s.in), s.offset)),
        dw_d(device_buffer(s.out * s.in * sizeof(float))) {}

  std::string name() const {
    return std::to_string(shape.rows) + "x" + std::to_string(shape.in) + "->" + std::to_string(shape.out) + " offset " +
           std::to_string(shape.offset);
  }

  // Forward, then backward with dx written (or accumulated onto dx_initial) and dW accumulated
  // onto dw_initial; outputs poisoned first.
  LinearRun run(ops::LinearPlan& plan, Workspace& workspace, const core::DeviceContext& context,
                ops::GradOutput dx_mode) {
    const auto& s = shape;
    poison(y_d.buffer, context);
    if (dx_mode == ops::GradOutput::accumulate) {
      test::from_host(dx_d.buffer, [&] {
        std::vector<std::uint16_t> padded(static_cast<std::size_t>(s.offset), 0xFFFF);
        padded.insert(padded.end(), dx_initial.words.begin(), dx_initial.words.end());
        return padded;
      }());
    } else {
      poison(dx_d.buffer, context);
    }
    test::from_host(dw_d, dw_initial);
    plan.forward(x_d.data(), w_d.data(), s.rows, s.in, s.out, y_d.data(), workspace.get());
    plan.backward(dy_d.data(), x_d.data(), w_d.data(), s.rows, s.in, s.out, dx_d.data(), dw_d.as<float>(),
                  workspace.get(), dx_mode);
    return {download_bf16(y_d), download_bf16(dx_d), test::to_host<float>(dw_d)};
  }

  void expect_matches_reference(const LinearRun& got, ops::GradOutput dx_mode) const {
    const auto& s = shape;
    std::vector<double> y(s.rows * s.out), dx(s.rows * s.in), dw = widen(dw_initial);
    ops::linear_forward_cpu<double>(x.values, w.values, s.rows, s.in, s.out, y);
    ops::linear_backward_cpu<double>(dy.values, x.values, w.values, s.rows, s.in, s.out, dx, dw);
    EXPECT_TRUE(close(name() + " y", widen_bf16(got.y), y, kBf16Output));
    if (dx_mode == ops::GradOutput::accumulate) {
      // cuBLASLt's bf16 epilogue may round the product before adding dx (linear.h).
      std::vector<double> magnitudes(dx.size());
      for (std::size_t i = 0; i < dx.size(); ++i) {
        magnitudes[i] = std::fabs(dx[i]) + std::fabs(dx_initial.values[i]);
        dx[i] += dx_initial.values[i];
      }
      EXPECT_TRUE(close(name() + " dx", widen_bf16(got.dx), dx, kBf16AccumulatedOutput, &magnitudes));
    } else {
      EXPECT_TRUE(close(name() + " dx", widen_bf16(got.dx), dx, kBf16Output));
    }
    EXPECT_TRUE(close(name() + " dW", widen(got.dw), dw, kFp32Grad));
  }
};

const LinearCase kLinearCases[] = {
    {1, 64, 32, 0},       // one token
    {1, 7, 5, 1},         // one token, odd features, 2-byte-aligned pointers
    {37, 129, 77, 0},     // odd everything
    {19, 33, 45, 3},      // odd everything, misaligned pointers
    {64, 1024, 96, 0},    // aligned
    {257, 1000, 200, 0},  // multiples of 8 but not of 16/64
    {200, 1024, 768, 8},  // Qwen-like width, 16-byte-aligned offset
};

TEST(LinearGpu, MatchesReferenceWrittenAndAccumulatedDx) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::LinearPlan plan(context);
  Workspace workspace(ops::linear_workspace_bytes());
  for (const LinearCase& s : kLinearCases) {
    LinearInputs inputs(rng, s);
    for (const auto mode : {ops::GradOutput::write, ops::GradOutput::accumulate}) {
      SCOPED_TRACE(inputs.name() + (mode == ops::GradOutput::write ? " dx written" : " dx accumulated"));
      inputs.expect_matches_reference(inputs.run(plan, workspace, context, mode), mode);
    }
  }
}

TEST(LinearGpu, EmptyRowsLeaveGradientUnchanged) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::LinearPlan plan(context);
  Workspace workspace(ops::linear_workspace_bytes());
  const auto dw_initial = test::random_normal(rng, 6 * 10);
  core::Buffer dw = device_buffer(dw_initial.size() * sizeof(float));
  test::from_host(dw, dw_initial);
  core::Buffer scratch = device_buffer(256);
  auto* any = scratch.as<bf16>();
  plan.forward(any, any + 8, 0, 10, 6, any + 16, workspace.get());
  plan.backward(any, any + 8, any + 16, 0, 10, 6, any + 24, dw.as<float>(), workspace.get());
  EXPECT_TRUE(same_bits(test::to_host<float>(dw), dw_initial));
  EXPECT_EQ(plan.cached_configurations(), 0u);
}

TEST(LinearGpu, BitIdenticalRerunsAndSteadyStateCache) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::LinearPlan plan(context), other_plan(context);
  Workspace workspace(ops::linear_workspace_bytes());
  for (const LinearCase& s : {LinearCase{2048, 1024, 3072, 0}, LinearCase{333, 129, 77, 1}}) {
    LinearInputs inputs(rng, s);
    SCOPED_TRACE(inputs.name());
    const LinearRun first = inputs.run(plan, workspace, context, ops::GradOutput::write);
    const std::size_t configurations = plan.cached_configurations();
    const LinearRun second = inputs.run(plan, workspace, context, ops::GradOutput::write);
    EXPECT_EQ(plan.cached_configurations(), configurations) << "a repeated shape created a configuration";
    const LinearRun third = inputs.run(other_plan, workspace, context, ops::GradOutput::write);
    for (const LinearRun* again : {&second, &third}) {
      EXPECT_TRUE(same_bits(first.y, again->y));
      EXPECT_TRUE(same_bits(first.dx, again->dx));
      EXPECT_TRUE(same_bits(first.dw, again->dw));
    }
    inputs.expect_matches_reference(first, ops::GradOutput::write);
  }
}

TEST(LinearGpu, GraphReplayEqualsEagerAndFirstUseInCaptureIsRejected) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::LinearPlan plan(context);
  Workspace workspace(ops::linear_workspace_bytes());
  LinearInputs inputs(rng, {96, 256, 160, 0});
  const LinearRun eager = inputs.run(plan, workspace, context, ops::GradOutput::write);
  const auto& s = inputs.shape;

  // A shape never seen: rejected inside the capture, which is then ended and dropped.
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(context.stream(), cudaStreamCaptureModeRelaxed), cudaSuccess);
  EXPECT_THROW(
      plan.forward(inputs.x_d.data(), inputs.w_d.data(), s.rows - 1, s.in, s.out, inputs.y_d.data(), workspace.get()),
      core::Error);
  ASSERT_EQ(cudaStreamEndCapture(context.stream(), &graph), cudaSuccess);
  if (graph != nullptr) {
    ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }

  // The warmed-up shape: captured, replayed, equal to the eager run.
  poison(inputs.y_d.buffer, context);
  poison(inputs.dx_d.buffer, context);
  test::from_host(inputs.dw_d, inputs.dw_initial);
  ASSERT_EQ(cudaStreamBeginCapture(context.stream(), cudaStreamCaptureModeRelaxed), cudaSuccess);
  plan.forward(inputs.x_d.data(), inputs.w_d.data(), s.rows, s.in, s.out, inputs.y_d.data(), workspace.get());
  plan.backward(inputs.dy_d.data(), inputs.x_d.data(), inputs.w_d.data(), s.rows, s.in, s.out, inputs.dx_d.data(),
                inputs.dw_d.as<float>(), workspace.get());
  ASSERT_EQ(cudaStreamEndCapture(context.stream(), &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, context.stream()), cudaSuccess);
  context.synchronize();
  EXPECT_TRUE(same_bits(download_bf16(inputs.y_d), eager.y));
  EXPECT_TRUE(same_bits(download_bf16(inputs.dx_d), eager.dx));
  EXPECT_TRUE(same_bits(test::to_host<float>(inputs.dw_d), eager.dw));
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

TEST(LinearGpu, RejectsBadArguments) {
  REQUIRE_GPU();
  core::DeviceContext context(core::Device::cuda(0));
  ops::LinearPlan plan(context);
  Workspace workspace(ops::linear_workspace_bytes());
  core::Buffer memory = device_buffer(4096);
  auto* x = memory.as<bf16>();
  auto* w = x + 512;
  auto* y = x + 1024;
  auto expect_error = [](auto&& call, const std::string& text) {
    try {
      call();
      ADD_FAILURE() << "expected core::Error mentioning \"" << text << "\"";
    } catch (const core::Error& error) {
      EXPECT_NE(std::string(error.what()).find(text), std::string::npos) << error.what();
    }
  };
  expect_error([&] { plan.forward(x, w, 4, 8, 8, y, {workspace.buffer.data(), 1024}); }, "workspace");
  expect_error([&] { plan.forward(x, w, 4, 8, 8, y, {}); }, "workspace");
  expect_error([&] { plan.forward(nullptr, w, 4, 8, 8, y, workspace.get()); }, "x is null");
  expect_error([&] { plan.forward(x, w, 4, 0, 8, y, workspace.get()); }, "in_features must be positive");
  expect_error([&] { plan.forward(x, w, -1, 8, 8, y, workspace.get()); }, "rows must not be negative");
  expect_error([&] { plan.forward(x, w, 4, 8, 8, x + 8, workspace.get()); }, "y overlaps the input x");
  expect_error(
      [&] { plan.forward(reinterpret_cast<bf16*>(reinterpret_cast<char*>(x) + 1), w, 4, 8, 8, y, workspace.get()); },
      "not aligned");
  expect_error([&] { plan.backward_weight(x, w, 4, 8, 8, reinterpret_cast<float*>(x + 2), workspace.get()); },
               "dweight overlaps the input dy");
  expect_error([&] { ops::LinearPlan cpu_plan{core::DeviceContext(core::Device::cpu())}; }, "CUDA device context");
}

// ---- cross-entropy ----

struct CeCase {
  std::int64_t tokens, dim, vocab;
  double ignored_fraction;
  float grad_scale;
};

struct CeRun {
  std::vector<float> token_losses;
  float mean_loss = 0.0f;
  std::int32_t count = 0;
  std::vector<std::uint16_t> dhidden;
  std::vector<float> dweight;
};

std::vector<std::int32_t> random_targets(std::mt19937_64& rng, std::int64_t n, std::int64_t vocab,
                                         double ignored_fraction) {
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(vocab - 1));
  std::bernoulli_distribution ignore(ignored_fraction);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(n));
  for (auto& t : targets) t = ignore(rng) ? ops::kIgnoreIndex : pick(rng);
  return targets;
}

struct CeInputs {
  CeCase shape;
  Bf16Data hidden, weight;
  std::vector<std::int32_t> targets;
  std::vector<float> dweight_initial;
  core::Buffer hidden_d, weight_d, targets_d, losses_d, mean_d, count_d, dhidden_d, dweight_d;

  CeInputs(std::mt19937_64& rng, const CeCase& s)
      : shape(s),
        hidden(random_bf16(rng, s.tokens * s.dim)),
        weight(random_bf16(rng, s.vocab * s.dim, 2.0f / std::sqrt(static_cast<float>(s.dim)))),
        targets(random_targets(rng, s.tokens, s.vocab, s.ignored_fraction)),
        dweight_initial(test::random_normal(rng, s.vocab * s.dim, 0.01f)),
        hidden_d(device_buffer(s.tokens * s.dim * 2)),
        weight_d(device_buffer(s.vocab * s.dim * 2)),
        targets_d(device_buffer(s.tokens * 4)),
        losses_d(device_buffer(s.tokens * 4)),
        mean_d(device_buffer(4)),
        count_d(device_buffer(4)),
        dhidden_d(device_buffer(s.tokens * s.dim * 2)),
        dweight_d(device_buffer(s.vocab * s.dim * 4)) {
    test::from_host(hidden_d, hidden.words);
    test::from_host(weight_d, weight.words);
    upload_targets();
  }

  void upload_targets() { test::from_host(targets_d, targets); }

  std::string name() const {
    return std::to_string(shape.tokens) + " tokens, dim " + std::to_string(shape.dim) + ", vocab " +
           std::to_string(shape.vocab);
  }

  CeRun run(ops::CrossEntropyPlan& plan, const core::DeviceContext& context, std::int64_t chunk, bool backward) {
    const auto& s = shape;
    Workspace workspace(ops::cross_entropy_workspace_bytes(s.tokens, s.vocab, chunk));
    for (core::Buffer* b : {&losses_d, &mean_d, &count_d, &dhidden_d}) poison(*b, context);
    test::from_host(dweight_d, dweight_initial);
    const ops::CrossEntropyDeviceOutputs outputs{losses_d.as<float>(), mean_d.as<float>(), count_d.as<std::int32_t>()};
    const auto* h = hidden_d.as<bf16>();
    const auto* w = weight_d.as<bf16>();
    const auto* t = targets_d.as<std::int32_t>();
    if (backward) {
      plan.backward(h, w, t, s.tokens, s.dim, s.vocab, dhidden_d.as<bf16>(), dweight_d.as<float>(), s.grad_scale,
                    outputs, workspace.get(), chunk);
    } else {
      plan.forward(h, w, t, s.tokens, s.dim, s.vocab, outputs, workspace.get(), chunk);
    }
    CeRun out;
    out.token_losses = test::to_host<float>(losses_d);
    out.mean_loss = test::to_host<float>(mean_d)[0];
    out.count = test::to_host<std::int32_t>(count_d)[0];
    if (backward) {
      out.dhidden = test::to_host<std::uint16_t>(dhidden_d);
      out.dweight = test::to_host<float>(dweight_d);
    }
    return out;
  }

  // Reference per-token losses (fp64 logits of the bf16 inputs) and the bound each may differ by.
  void reference_losses(std::vector<double>& losses, std::vector<double>& bounds) const {
    const auto& s = shape;
    std::vector<double> logits(s.tokens * s.vocab);
    ops::matmul_nt_cpu(hidden.values.data(), weight.values.data(), s.tokens, s.vocab, s.dim, logits.data(),
                       ops::Accumulate::overwrite);
    losses.assign(s.tokens, 0.0);
    bounds.assign(s.tokens, 0.0);
    for (std::int64_t n = 0; n < s.tokens; ++n) {
      const double* row = logits.data() + n * s.vocab;
      double max_logit = -std::numeric_limits<double>::infinity(), max_abs = 0.0;
      for (std::int64_t v = 0; v < s.vocab; ++v) {
        max_logit = std::max(max_logit, row[v]);
        max_abs = std::max(max_abs, std::fabs(row[v]));
      }
      bounds[n] = 1.5 * 2.0 * std::ldexp(1.0, -8) * max_abs + 1e-4;
      if (targets[n] == ops::kIgnoreIndex) continue;
      double sum = 0.0;
      for (std::int64_t v = 0; v < s.vocab; ++v) sum += std::exp(row[v] - max_logit);
      losses[n] = max_logit + std::log(sum) - row[targets[n]];
    }
  }

  void expect_matches_reference(const CeRun& got, bool backward) const {
    const auto& s = shape;
    std::vector<double> losses, bounds;
    reference_losses(losses, bounds);
    const std::int64_t counted =
        std::count_if(targets.begin(), targets.end(), [](std::int32_t t) { return t != ops::kIgnoreIndex; });
    EXPECT_EQ(got.count, counted) << name();
    double mean_bound = 0.0, mean = 0.0;
    for (std::int64_t n = 0; n < s.tokens; ++n) {
      ASSERT_LE(std::fabs(got.token_losses[n] - losses[n]), bounds[n])
          << name() << ": token " << n << " loss " << got.token_losses[n] << ", expected " << losses[n];
      if (targets[n] == ops::kIgnoreIndex) {
        EXPECT_EQ(got.token_losses[n], 0.0f) << name() << ": ignored token " << n;
      } else {
        mean_bound = std::max(mean_bound, bounds[n]);
        mean += losses[n];
      }
    }
    mean = counted > 0 ? mean / static_cast<double>(counted) : 0.0;
    EXPECT_LE(std::fabs(got.mean_loss - mean), mean_bound + 1e-6 * std::fabs(mean)) << name() << ": mean loss";
    if (!backward) return;

    std::vector<double> dhidden(s.tokens * s.dim), dweight = widen(dweight_initial);
    const auto result = ops::cross_entropy_backward_cpu<double>(hidden.values, weight.values, targets, s.dim, s.vocab,
                                                                dhidden, dweight, s.grad_scale);
    EXPECT_EQ(result.count, counted);
    EXPECT_NEAR(result.loss, mean, 1e-9 * std::fabs(mean) + 1e-12);
    const auto got_dhidden = widen_bf16(got.dhidden);
    if (counted == 0) {
      EXPECT_TRUE(std::all_of(got_dhidden.begin(), got_dhidden.end(), [](double x) { return x == 0.0; }))
          << name() << ": dhidden must be zero";
      EXPECT_TRUE(same_bits(got.dweight, dweight_initial)) << name() << ": dweight must be unchanged";
      return;
    }
    for (std::int64_t n = 0; n < s.tokens; ++n) {
      if (targets[n] != ops::kIgnoreIndex) continue;
      for (std::int64_t d = 0; d < s.dim; ++d) {
        ASSERT_EQ(got_dhidden[n * s.dim + d], 0.0) << name() << ": dhidden of ignored token " << n;
      }
    }
    EXPECT_TRUE(normwise_close(name() + " dhidden", got_dhidden, dhidden, 2e-2));
    // The increment of dW, so the initial value does not hide its error.
    std::vector<double> got_increment(dweight.size()), increment(dweight.size());
    for (std::size_t i = 0; i < dweight.size(); ++i) {
      got_increment[i] = static_cast<double>(got.dweight[i]) - dweight_initial[i];
      increment[i] = dweight[i] - dweight_initial[i];
    }
    EXPECT_TRUE(normwise_close(name() + " dweight increment", got_increment, increment, 2e-2));
  }
};

TEST(CrossEntropyGpu, MatchesReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::CrossEntropyPlan plan(context);
  struct Case {
    CeCase shape;
    std::int64_t chunk;
  };
  const Case cases[] = {
      {{37, 64, 1000, 0.25, 1.0f}, 8},    // tokens not a multiple of the chunk
      {{1, 33, 997, 0.0, 1.0f}, 0},       // one token, odd dim and vocab (scalar row path)
      {{45, 33, 1003, 0.2, 0.5f}, 7},     // odd dim: chunk pointers 2-byte aligned
      {{130, 96, 4096, 0.1, 2.0f}, 0},    // one chunk
      {{130, 96, 4096, 0.1, 2.0f}, 50},   // same shape, 3 chunks (50, 50, 30)
      {{5, 64, 151936, 0.0, 1.0f}, 2},    // Qwen3's vocabulary
      {{64, 128, 2048, 0.0, 1.0f}, 128},  // chunk larger than the tokens
  };
  for (const Case& c : cases) {
    CeInputs inputs(rng, c.shape);
    SCOPED_TRACE(inputs.name() + ", chunk " + std::to_string(c.chunk));
    inputs.expect_matches_reference(inputs.run(plan, context, c.chunk, false), false);
    inputs.expect_matches_reference(inputs.run(plan, context, c.chunk, true), true);
  }
}

TEST(CrossEntropyGpu, ForwardAndBackwardLossesAgree) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::CrossEntropyPlan plan(context);
  CeInputs inputs(rng, {77, 64, 3000, 0.3, 1.0f});
  const CeRun forward = inputs.run(plan, context, 16, false);
  const CeRun backward = inputs.run(plan, context, 16, true);
  EXPECT_EQ(forward.count, backward.count);
  for (std::size_t n = 0; n < forward.token_losses.size(); ++n) {
    EXPECT_NEAR(forward.token_losses[n], backward.token_losses[n], 1e-6 * std::fabs(backward.token_losses[n]))
        << "token " << n;
  }
  EXPECT_NEAR(forward.mean_loss, backward.mean_loss, 1e-6 * std::fabs(backward.mean_loss));
}

TEST(CrossEntropyGpu, ChunkSizeChangesOnlyRounding) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::CrossEntropyPlan plan(context);
  CeInputs inputs(rng, {203, 64, 2056, 0.15, 1.0f});
  std::vector<double> losses, bounds;
  inputs.reference_losses(losses, bounds);
  const CeRun whole = inputs.run(plan, context, 0, true);
  for (const std::int64_t chunk : {1, 13, 64, 200}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    const CeRun chunked = inputs.run(plan, context, chunk, true);
    EXPECT_EQ(chunked.count, whole.count);
    for (std::size_t n = 0; n < losses.size(); ++n) {
      ASSERT_LE(std::fabs(chunked.token_losses[n] - whole.token_losses[n]), 2 * bounds[n]) << "token " << n;
    }
    EXPECT_NEAR(chunked.mean_loss, whole.mean_loss, 1e-3 * std::fabs(whole.mean_loss));
    EXPECT_TRUE(normwise_close("dhidden", widen_bf16(chunked.dhidden), widen_bf16(whole.dhidden), 1e-2));
    std::vector<double> a(whole.dweight.size()), b(whole.dweight.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      a[i] = static_cast<double>(chunked.dweight[i]) - inputs.dweight_initial[i];
      b[i] = static_cast<double>(whole.dweight[i]) - inputs.dweight_initial[i];
    }
    EXPECT_TRUE(normwise_close("dweight increment", a, b, 1e-2));
  }
}

TEST(CrossEntropyGpu, BitIdenticalReruns) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::CrossEntropyPlan plan(context), other_plan(context);
  CeInputs inputs(rng, {300, 128, 8192, 0.1, 1.0f});
  const CeRun first = inputs.run(plan, context, 96, true);
  const std::size_t configurations = plan.gemms().cached_configurations();
  const CeRun second = inputs.run(plan, context, 96, true);
  EXPECT_EQ(plan.gemms().cached_configurations(), configurations);
  const CeRun third = inputs.run(other_plan, context, 96, true);
  for (const CeRun* again : {&second, &third}) {
    EXPECT_TRUE(same_bits(first.token_losses, again->token_losses));
    EXPECT_EQ(std::bit_cast<std::uint32_t>(first.mean_loss), std::bit_cast<std::uint32_t>(again->mean_loss));
    EXPECT_EQ(first.count, again->count);
    EXPECT_TRUE(same_bits(first.dhidden, again->dhidden));
    EXPECT_TRUE(same_bits(first.dweight, again->dweight));
  }
}

TEST(CrossEntropyGpu, AllTargetsIgnoredAndNoTokens) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::CrossEntropyPlan plan(context);
  CeInputs inputs(rng, {29, 32, 515, 1.0, 1.0f});
  for (const std::int64_t chunk : {0, 4}) {
    const CeRun got = inputs.run(plan, context, chunk, true);
    EXPECT_EQ(got.count, 0);
    EXPECT_EQ(got.mean_loss, 0.0f);
    EXPECT_TRUE(std::all_of(got.token_losses.begin(), got.token_losses.end(), [](float l) { return l == 0.0f; }));
    inputs.expect_matches_reference(got, true);
  }
  CeInputs empty(rng, {0, 32, 515, 0.0, 1.0f});
  const CeRun got = empty.run(plan, context, 0, true);
  EXPECT_EQ(got.count, 0);
  EXPECT_EQ(got.mean_loss, 0.0f);
  EXPECT_TRUE(same_bits(got.dweight, empty.dweight_initial));
}

TEST(CrossEntropyGpu, OutOfRangeTargetGivesNaN) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::CrossEntropyPlan plan(context);
  CeInputs inputs(rng, {9, 32, 256, 0.0, 1.0f});
  inputs.targets[4] = 256;
  inputs.upload_targets();
  const CeRun got = inputs.run(plan, context, 0, true);
  EXPECT_EQ(got.count, 9);
  EXPECT_TRUE(std::isnan(got.token_losses[4]));
  EXPECT_TRUE(std::isfinite(got.token_losses[3]));
  EXPECT_TRUE(std::isnan(got.mean_loss));
  EXPECT_TRUE(std::any_of(got.dweight.begin(), got.dweight.end(), [](float g) { return std::isnan(g); }));
}

TEST(CrossEntropyGpu, ChunkDefaultAndRejectsBadArguments) {
  REQUIRE_GPU();
  EXPECT_EQ(ops::cross_entropy_chunk_tokens_cuda(151936, 0), 3456);
  EXPECT_EQ(ops::cross_entropy_chunk_tokens_cuda(151936, 5), 5);
  // 100 tokens x 1000 logits x 2 bytes = 200000, rounded up to 256 bytes: 200192.
  EXPECT_EQ(ops::cross_entropy_workspace_bytes(100, 1000, 0), std::size_t{200192} + ops::linear_workspace_bytes());
  core::DeviceContext context(core::Device::cuda(0));
  ops::CrossEntropyPlan plan(context);
  std::mt19937_64 rng(test::fresh_seed());
  CeInputs inputs(rng, {8, 16, 64, 0.0, 1.0f});
  const ops::CrossEntropyDeviceOutputs outputs{inputs.losses_d.as<float>(), inputs.mean_d.as<float>(),
                                               inputs.count_d.as<std::int32_t>()};
  Workspace small(1024);
  try {
    plan.forward(inputs.hidden_d.as<bf16>(), inputs.weight_d.as<bf16>(), inputs.targets_d.as<std::int32_t>(), 8, 16, 64,
                 outputs, small.get());
    ADD_FAILURE() << "a too small workspace was accepted";
  } catch (const core::Error& error) {
    EXPECT_NE(std::string(error.what()).find("cross_entropy_workspace_bytes"), std::string::npos) << error.what();
  }
  Workspace workspace(ops::cross_entropy_workspace_bytes(8, 64));
  EXPECT_THROW(
      plan.backward(inputs.hidden_d.as<bf16>(), inputs.weight_d.as<bf16>(), inputs.targets_d.as<std::int32_t>(), 8, 16,
                    64, inputs.dhidden_d.as<bf16>(), inputs.dweight_d.as<float>(),
                    std::numeric_limits<float>::infinity(), outputs, workspace.get()),
      core::Error);
  EXPECT_THROW(
      plan.backward(inputs.hidden_d.as<bf16>(), inputs.weight_d.as<bf16>(), inputs.targets_d.as<std::int32_t>(), 8, 16,
                    64, inputs.hidden_d.as<bf16>(), inputs.dweight_d.as<float>(), 1.0f, outputs, workspace.get()),
      core::Error);  // dhidden overlaps hidden
}

// ---- vocabulary-split backward (backward_hidden, backward_weight_rows) ----

// The concatenated windows' dW increment may differ from backward()'s by recomputed logits that
// round to the other bf16 neighbour and by the order of the fp32 sum over tokens.
constexpr double kSplitWeightTolerance = 1e-3;

struct SplitCase {
  CeCase shape;
  std::int64_t chunk;                // pass 1's chunk_tokens
  std::int64_t tile;                 // pass 2's tile_tokens (0 = automatic)
  std::vector<std::int64_t> bounds;  // windows [bounds[i], bounds[i + 1])
};

// Pass 1 on poisoned outputs: the loss outputs and dhidden as CeRun, and token_lse.
CeRun run_backward_hidden(CeInputs& inputs, ops::CrossEntropyPlan& plan, const core::DeviceContext& context,
                          core::Buffer& lse_d, std::int64_t chunk, std::vector<float>& lse) {
  const auto& s = inputs.shape;
  Workspace workspace(ops::cross_entropy_workspace_bytes(s.tokens, s.vocab, chunk));
  for (core::Buffer* b : {&inputs.losses_d, &inputs.mean_d, &inputs.count_d, &inputs.dhidden_d, &lse_d}) {
    poison(*b, context);
  }
  const ops::CrossEntropyDeviceOutputs outputs{inputs.losses_d.as<float>(), inputs.mean_d.as<float>(),
                                               inputs.count_d.as<std::int32_t>()};
  plan.backward_hidden(inputs.hidden_d.as<bf16>(), inputs.weight_d.as<bf16>(), inputs.targets_d.as<std::int32_t>(),
                       s.tokens, s.dim, s.vocab, inputs.dhidden_d.as<bf16>(), s.grad_scale, outputs, lse_d.as<float>(),
                       workspace.get(), chunk);
  CeRun out;
  out.token_losses = test::to_host<float>(inputs.losses_d);
  out.mean_loss = test::to_host<float>(inputs.mean_d)[0];
  out.count = test::to_host<std::int32_t>(inputs.count_d)[0];
  out.dhidden = test::to_host<std::uint16_t>(inputs.dhidden_d);
  lse = test::to_host<float>(lse_d);
  return out;
}

// Pass 2 for rows [begin, end), accumulated onto `initial` ([end - begin, dim]); after pass 1.
std::vector<float> run_weight_rows(CeInputs& inputs, ops::CrossEntropyPlan& plan, Workspace& workspace,
                                   const core::Buffer& lse_d, std::int64_t begin, std::int64_t end, std::int64_t tile,
                                   const std::vector<float>& initial) {
  const auto& s = inputs.shape;
  core::Buffer rows_d = device_buffer(initial.size() * sizeof(float));
  test::from_host(rows_d, initial);
  plan.backward_weight_rows(inputs.hidden_d.as<bf16>(), inputs.weight_d.as<bf16>(), inputs.targets_d.as<std::int32_t>(),
                            lse_d.as<float>(), inputs.count_d.as<std::int32_t>(), s.tokens, s.dim, s.vocab, begin, end,
                            rows_d.as<float>(), s.grad_scale, workspace.get(), tile);
  return test::to_host<float>(rows_d);
}

std::vector<float> initial_rows(const CeInputs& inputs, std::int64_t begin, std::int64_t end) {
  const std::int64_t dim = inputs.shape.dim;
  return {inputs.dweight_initial.begin() + begin * dim, inputs.dweight_initial.begin() + end * dim};
}

TEST(CrossEntropyGpu, VocabularySplitBackwardMatchesFusedBackward) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::CrossEntropyPlan plan(context);
  const SplitCase cases[] = {
      // Automatic tile (all tokens); windows of 1 row, 6, 1 at an odd row, 504 (16-byte path), 489.
      {{333, 64, 1001, 0.2, 1.0f}, 0, 0, {0, 1, 7, 8, 512, 1001}},
      // Pass 1 in chunks of 7; pass 2 in tiles of 128 (128, 128, 77); windows of 136 rows, 1 row,
      // 503 rows from the odd row 137, 384 rows.
      {{333, 200, 1024, 0.25, 0.5f}, 7, 128, {0, 136, 137, 640, 1024}},
      // One token.
      {{1, 64, 1001, 0.0, 2.0f}, 0, 0, {0, 501, 1001}},
      // Tiles of 50 (the last of 33), a window of the last row alone.
      {{333, 200, 1001, 0.1, 1.0f}, 100, 50, {0, 3, 1000, 1001}},
      // Several column slices per token in the dlogits kernel, both paths.
      {{130, 64, 8192, 0.1, 1.0f}, 0, 0, {0, 4096, 8190, 8192}},
  };
  for (const SplitCase& c : cases) {
    const auto& s = c.shape;
    CeInputs inputs(rng, s);
    inputs.targets[0] = static_cast<std::int32_t>(s.vocab - 1);  // a target in the last window
    if (s.tokens > 1) inputs.targets[1] = ops::kIgnoreIndex;
    inputs.upload_targets();
    SCOPED_TRACE(inputs.name() + ", chunk " + std::to_string(c.chunk) + ", tile " + std::to_string(c.tile));
    const CeRun fused = inputs.run(plan, context, c.chunk, true);

    // (a) Pass 1 equals backward() bit for bit.
    core::Buffer lse_d = device_buffer(s.tokens * sizeof(float));
    std::vector<float> lse;
    const CeRun pass1 = run_backward_hidden(inputs, plan, context, lse_d, c.chunk, lse);
    EXPECT_TRUE(same_bits(pass1.token_losses, fused.token_losses));
    EXPECT_EQ(std::bit_cast<std::uint32_t>(pass1.mean_loss), std::bit_cast<std::uint32_t>(fused.mean_loss));
    EXPECT_EQ(pass1.count, fused.count);
    EXPECT_TRUE(same_bits(pass1.dhidden, fused.dhidden));
    inputs.expect_matches_reference(pass1, false);

    // (b) token_lse against an fp64 logsumexp of fp64 logits.
    std::vector<double> logits(s.tokens * s.vocab);
    ops::matmul_nt_cpu(inputs.hidden.values.data(), inputs.weight.values.data(), s.tokens, s.vocab, s.dim,
                       logits.data(), ops::Accumulate::overwrite);
    for (std::int64_t n = 0; n < s.tokens; ++n) {
      if (inputs.targets[n] == ops::kIgnoreIndex) {
        EXPECT_EQ(lse[n], 0.0f) << "ignored token " << n;
        continue;
      }
      const double* row = logits.data() + n * s.vocab;
      const double max_logit = *std::max_element(row, row + s.vocab);
      double sum = 0.0, weighted = 0.0;
      for (std::int64_t v = 0; v < s.vocab; ++v) sum += std::exp(row[v] - max_logit);
      const double expected = max_logit + std::log(sum);
      for (std::int64_t v = 0; v < s.vocab; ++v) weighted += std::exp(row[v] - expected) * std::fabs(row[v]);
      const double bound = 1.5 * std::ldexp(weighted, -8) + 1e-5 + 1e-6 * std::fabs(expected);
      ASSERT_LE(std::fabs(lse[n] - expected), bound) << "token " << n << " lse " << lse[n] << ", expected " << expected;
    }

    // (c) The windows, each accumulated onto its rows of dweight_initial, concatenated.
    const std::size_t automatic_bytes = ops::cross_entropy_workspace_bytes(s.tokens, s.vocab, 0);
    std::vector<double> split_increment, reference_increment;
    for (std::size_t w = 0; w + 1 < c.bounds.size(); ++w) {
      const std::int64_t begin = c.bounds[w], end = c.bounds[w + 1];
      SCOPED_TRACE("rows [" + std::to_string(begin) + ", " + std::to_string(end) + ")");
      const std::int64_t tile = ops::cross_entropy_weight_rows_tile_tokens(s.tokens, s.vocab, end - begin, c.tile);
      if (c.tile > 0) {
        EXPECT_LT(tile, s.tokens) << "the case must tile";
      } else {
        EXPECT_EQ(tile, s.tokens) << "these tokens all fit in one tile";
      }
      // The automatic tile runs in the fused path's workspace.
      Workspace workspace(c.tile > 0
                              ? ops::cross_entropy_weight_rows_workspace_bytes(s.tokens, s.vocab, end - begin, c.tile)
                              : automatic_bytes);
      const std::vector<float> initial = initial_rows(inputs, begin, end);
      const std::vector<float> got = run_weight_rows(inputs, plan, workspace, lse_d, begin, end, c.tile, initial);
      std::vector<double> reference = widen(initial);
      ops::cross_entropy_backward_weight_rows_cpu<double>(inputs.hidden.values, inputs.weight.values, inputs.targets,
                                                          s.dim, s.vocab, begin, end, reference, s.grad_scale);
      for (std::size_t i = 0; i < got.size(); ++i) {
        split_increment.push_back(static_cast<double>(got[i]) - initial[i]);
        reference_increment.push_back(reference[i] - initial[i]);
      }
    }
    std::vector<double> fused_increment(fused.dweight.size());
    for (std::size_t i = 0; i < fused_increment.size(); ++i) {
      fused_increment[i] = static_cast<double>(fused.dweight[i]) - inputs.dweight_initial[i];
    }
    ASSERT_EQ(split_increment.size(), fused_increment.size());
    EXPECT_TRUE(normwise_close("split dweight increment vs backward()", split_increment, fused_increment,
                               kSplitWeightTolerance));
    EXPECT_TRUE(normwise_close("split dweight increment vs CPU", split_increment, reference_increment, 2e-2));
    EXPECT_TRUE(normwise_close("fused dweight increment vs CPU", fused_increment, reference_increment, 2e-2));

    // (d) beta = 1: a second call adds the same gradient again (the middle window, from zero).
    const std::size_t middle = (c.bounds.size() - 1) / 2;
    const std::int64_t begin = c.bounds[middle], end = c.bounds[middle + 1];
    Workspace workspace(ops::cross_entropy_weight_rows_workspace_bytes(s.tokens, s.vocab, end - begin, c.tile));
    const std::vector<float> zero((end - begin) * s.dim, 0.0f);
    const std::vector<float> once = run_weight_rows(inputs, plan, workspace, lse_d, begin, end, c.tile, zero);
    const std::vector<float> twice = run_weight_rows(inputs, plan, workspace, lse_d, begin, end, c.tile, once);
    std::vector<double> doubled(once.size());
    for (std::size_t i = 0; i < once.size(); ++i) doubled[i] = 2.0 * once[i];
    EXPECT_GT(rms(doubled), 0.0);
    EXPECT_TRUE(close("twice accumulated", widen(twice), doubled, kFp32Grad));
  }
}

TEST(CrossEntropyGpu, VocabularySplitEdgeTargets) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda(0));
  ops::CrossEntropyPlan plan(context);
  // Every target ignored: count 0, lse 0, dhidden 0 and the weight rows unchanged.
  {
    CeInputs inputs(rng, {29, 32, 515, 1.0, 1.0f});
    core::Buffer lse_d = device_buffer(29 * sizeof(float));
    std::vector<float> lse;
    const CeRun pass1 = run_backward_hidden(inputs, plan, context, lse_d, 4, lse);
    EXPECT_EQ(pass1.count, 0);
    EXPECT_EQ(pass1.mean_loss, 0.0f);
    EXPECT_TRUE(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 0.0f; }));
    inputs.expect_matches_reference(pass1, false);
    Workspace workspace(ops::cross_entropy_workspace_bytes(29, 515, 0));
    const std::vector<float> initial = initial_rows(inputs, 100, 301);
    EXPECT_TRUE(same_bits(run_weight_rows(inputs, plan, workspace, lse_d, 100, 301, 0, initial), initial));
  }
  // A target outside the vocabulary: NaN in its loss and in every window's gradient.
  {
    CeInputs inputs(rng, {9, 32, 256, 0.0, 1.0f});
    inputs.targets[4] = 256;
    inputs.upload_targets();
    core::Buffer lse_d = device_buffer(9 * sizeof(float));
    std::vector<float> lse;
    const CeRun pass1 = run_backward_hidden(inputs, plan, context, lse_d, 0, lse);
    EXPECT_EQ(pass1.count, 9);
    EXPECT_TRUE(std::isnan(pass1.token_losses[4]));
    EXPECT_TRUE(std::isnan(pass1.mean_loss));
    EXPECT_TRUE(std::all_of(lse.begin(), lse.end(), [](float x) { return std::isfinite(x); }));
    Workspace workspace(ops::cross_entropy_workspace_bytes(9, 256, 0));
    for (const auto& [begin, end] : {std::pair<std::int64_t, std::int64_t>{0, 3}, {3, 256}}) {
      const auto got = run_weight_rows(inputs, plan, workspace, lse_d, begin, end, 0, initial_rows(inputs, begin, end));
      EXPECT_TRUE(std::any_of(got.begin(), got.end(), [](float g) { return std::isnan(g); }))
          << "rows [" << begin << ", " << end << ")";
    }
  }
  // No tokens: nothing written, nothing added.
  {
    CeInputs inputs(rng, {0, 32, 515, 0.0, 1.0f});
    Workspace workspace(ops::cross_entropy_workspace_bytes(0, 515, 0));
    core::Buffer lse_d = device_buffer(4);
    const auto initial = initial_rows(inputs, 0, 515);
    EXPECT_TRUE(same_bits(run_weight_rows(inputs, plan, workspace, lse_d, 0, 515, 0, initial), initial));
  }
}

// Host-side sizes only: runs without a GPU.
TEST(CrossEntropyGpu, WeightRowsTileAndWorkspaceSizes) {
  // Qwen3's vocabulary, 16384 tokens: the fused path's workspace holds 3456 x 151936 logits.
  EXPECT_EQ(ops::cross_entropy_weight_rows_tile_tokens(16384, 151936, 151936), 3456);
  EXPECT_EQ(ops::cross_entropy_weight_rows_tile_tokens(16384, 151936, 151936 / 8), 16384);  // one tile
  EXPECT_EQ(ops::cross_entropy_weight_rows_tile_tokens(16384, 151936, 50000), 10496);       // 10501 -> x128
  EXPECT_EQ(ops::cross_entropy_weight_rows_tile_tokens(333, 1001, 1), 333);
  EXPECT_EQ(ops::cross_entropy_weight_rows_tile_tokens(333, 1001, 1001, 128), 128);
  EXPECT_EQ(ops::cross_entropy_weight_rows_tile_tokens(0, 1001, 5), 1);
  // 100 x 999 bf16 logits = 199800 bytes, rounded up to 256: 199936.
  EXPECT_EQ(ops::cross_entropy_weight_rows_workspace_bytes(100, 1000, 999),
            std::size_t{199936} + ops::linear_workspace_bytes());
  // 128 x 1001 x 2 = 256256 bytes, a multiple of 256.
  EXPECT_EQ(ops::cross_entropy_weight_rows_workspace_bytes(333, 1001, 1001, 128),
            std::size_t{256256} + ops::linear_workspace_bytes());
  for (const std::int64_t tokens : {1, 333, 3456, 4000, 16384}) {
    for (const std::int64_t vocab : {7, 1001, 151936}) {
      for (const std::int64_t rows : {std::int64_t{1}, vocab / 3 + 1, vocab}) {
        EXPECT_LE(ops::cross_entropy_weight_rows_workspace_bytes(tokens, vocab, rows),
                  ops::cross_entropy_workspace_bytes(tokens, vocab, 0))
            << tokens << " tokens, vocab " << vocab << ", rows " << rows;
      }
    }
  }
}

TEST(CrossEntropyGpu, VocabularySplitRejectsBadArguments) {
  REQUIRE_GPU();
  core::DeviceContext context(core::Device::cuda(0));
  ops::CrossEntropyPlan plan(context);
  std::mt19937_64 rng(test::fresh_seed());
  CeInputs inputs(rng, {8, 16, 64, 0.0, 1.0f});
  const ops::CrossEntropyDeviceOutputs outputs{inputs.losses_d.as<float>(), inputs.mean_d.as<float>(),
                                               inputs.count_d.as<std::int32_t>()};
  core::Buffer lse_d = device_buffer(8 * sizeof(float));
  core::Buffer rows_d = device_buffer(64 * 16 * sizeof(float));
  Workspace workspace(ops::cross_entropy_workspace_bytes(8, 64));
  const auto* h = inputs.hidden_d.as<bf16>();
  const auto* w = inputs.weight_d.as<bf16>();
  const auto* t = inputs.targets_d.as<std::int32_t>();
  const auto* lse = lse_d.as<float>();
  const auto* count = inputs.count_d.as<std::int32_t>();
  auto* rows = rows_d.as<float>();
  auto expect_error = [](auto&& call, const std::string& text) {
    try {
      call();
      ADD_FAILURE() << "expected core::Error mentioning \"" << text << "\"";
    } catch (const core::Error& error) {
      EXPECT_NE(std::string(error.what()).find(text), std::string::npos) << error.what();
    }
  };
  expect_error(
      [&] {
        plan.backward_hidden(h, w, t, 8, 16, 64, inputs.dhidden_d.as<bf16>(), 1.0f, outputs, nullptr, workspace.get());
      },
      "token_lse is null");
  expect_error(
      [&] {
        plan.backward_hidden(h, w, t, 8, 16, 64, inputs.dhidden_d.as<bf16>(), 1.0f, outputs,
                             inputs.losses_d.as<float>(), workspace.get());
      },
      "overlaps");
  expect_error([&] { plan.backward_weight_rows(h, w, t, lse, count, 8, 16, 64, 5, 5, rows, 1.0f, workspace.get()); },
               "non-empty range");
  expect_error([&] { plan.backward_weight_rows(h, w, t, lse, count, 8, 16, 64, -1, 5, rows, 1.0f, workspace.get()); },
               "non-empty range");
  expect_error([&] { plan.backward_weight_rows(h, w, t, lse, count, 8, 16, 64, 60, 65, rows, 1.0f, workspace.get()); },
               "non-empty range");
  expect_error(
      [&] { plan.backward_weight_rows(h, w, t, nullptr, count, 8, 16, 64, 0, 64, rows, 1.0f, workspace.get()); },
      "token_lse is null");
  expect_error([&] { plan.backward_weight_rows(h, w, t, lse, nullptr, 8, 16, 64, 0, 64, rows, 1.0f, workspace.get()); },
               "count is null");
  expect_error(
      [&] {
        plan.backward_weight_rows(h, w, t, lse, count, 8, 16, 64, 0, 64, rows, std::numeric_limits<float>::quiet_NaN(),
                                  workspace.get());
      },
      "grad_scale must be finite");
  expect_error(
      [&] {
        plan.backward_weight_rows(h, w, t, lse, count, 8, 16, 64, 0, 64, rows, 1.0f, {workspace.buffer.data(), 4096});
      },
      "cross_entropy_weight_rows_workspace_bytes");
  expect_error(
      [&] { plan.backward_weight_rows(h, w, t, lse, count, 8, 16, 64, 0, 64, rows, 1.0f, workspace.get(), -1); },
      "tile_tokens must not be negative");
  // dweight_rows over the hidden states, or over the workspace.
  expect_error(
      [&] {
        plan.backward_weight_rows(h, w, t, lse, count, 8, 16, 64, 0, 4, inputs.hidden_d.as<float>(), 1.0f,
                                  workspace.get());
      },
      "dweight_rows overlaps the input hidden");
  expect_error(
      [&] {
        plan.backward_weight_rows(h, w, t, lse, count, 8, 16, 64, 0, 64, workspace.buffer.as<float>(), 1.0f,
                                  workspace.get());
      },
      "dweight_rows overlaps workspace");
}

}  // namespace
