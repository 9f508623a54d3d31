// The E29a layer's CUDA paths (models/e29a/layer_cuda.h: the hybrid forward and the persistent
// one, layer_persistent.h; one backward) against the CPU reference
// (layer.h, run in fp64 on the exact values of the same bf16 inputs and weights) on fresh random
// inputs at the scales of the model's initialisation, over N in {8, 16, 32, 64} (and 5, 40: slot
// counts below a kernel's capacity), D in {5, 12, 64, 72, 200, 800, 900, 1024}, T in {1, 7, 9, 33,
// 129, 512} (129 and 512 end in a partial checkpoint segment), B in {1, 3, 5, 7, 11, 13, 64}, the
// persistent kernels with a sequence on one block and spread over clusters of 2 and 4 (D 800 and
// 900: the last rank's 256-feature chunk is partial; 900 also takes the rows phase's scalar form; D
// 1024 with N 8 and 16 the kernels' full variant, D and N constants),
// and with the rows phase's batch in one part and in two (B 11 and 13: a partial group); the zero-tape
// degeneracy on the GPU; bit-identical reruns and independence from the checkpoint interval; state hand-over; the two
// forwards against each other; a stalled persistent launch leaving at its deadline, on one block and in a cluster.
//
// Tolerances (normwise: ||gpu - ref|| <= tol ||ref||), from where the GPU path rounds:
//  - fp32 paths (h, r, both attentions, the end tape, the score gradients, dL/db_h, dL/dH_0): the
//    recurrence runs in fp32 with fp32 accumulation and the input projection rounds x/z once to
//    fp32, so the only error is fp32 rounding carried through the steps, which the recurrence can
//    amplify: how much depends on the draw. So each case also runs the CPU reference in fp32 (double
//    sums, one rounding per value), once more with the input nudged by an ulp (fp32_tolerance), and
//    measures their larger error against fp64, e: typically < 2e-6, but up to 9e-6 on a long
//    D 1024 run, and more on a draw where the recurrence is chaotic. cuBLASLt's fp32 products and the kernels' shuffle
//    trees round every partial sum (a value summed from D products carries a few fp32 ulps, not half of one), so allow
//    100x: max(2e-4, 100 e) (measured on an H100: at most 31 e). The persistent forward sums the two recurrent products
//    in its own fixed order (fp32, per lane then a butterfly), so the same bound holds for it.
//  - bf16 paths (y, du, dL/dW_xz, dL/dW_h, dL/dW_write): y and du are rounded to bf16 (2^-9
//    relative at most, about 2^-9/sqrt(3) = 1.1e-3 rms), and the weight-gradient and du products
//    take bf16 copies of their fp32 operands (two more such roundings), so the expected error is
//    about 1.6e-3 rms; allow 1e-2. y is also checked element by element: within one bf16 ulp of the
//    reference (round to nearest gives half an ulp; the other half covers the fp32 error) plus the
//    case's fp32 tolerance times y's rms (an element near zero after cancellation carries the fp32
//    error of its larger terms; at y's rms that allowance is under 5% of a bf16 ulp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/half.h"
#include "models/e29a/layer.h"
#include "models/e29a/layer_cuda.h"
#include "models/e29a/layer_persistent.h"
#include "models/safetensors.h"
#include "support/test_support.h"

namespace {

namespace e29a = models::e29a;
using Bits = std::vector<std::uint16_t>;

constexpr double kFp32Tolerance = 2e-4;  // the floor; see fp32_tolerance()
constexpr double kBf16Tolerance = 1e-2;

// bf16 words for the GPU and their exact values for the reference.
struct Bf16Data {
  Bits bits;
  std::vector<double> values;
};

Bf16Data to_bf16(const std::vector<float>& raw) {
  Bf16Data out;
  out.bits.resize(raw.size());
  out.values.resize(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i) {
    out.bits[i] = core::float_to_bf16(raw[i]);
    out.values[i] = core::bf16_to_float(out.bits[i]);
  }
  return out;
}

Bf16Data normal_bf16(std::mt19937_64& rng, std::size_t n, float scale) {
  return to_bf16(test::random_normal(rng, n, scale));
}

Bf16Data uniform_bf16(std::mt19937_64& rng, std::size_t n, float bound) {
  std::uniform_real_distribution<float> dist(-bound, bound);
  std::vector<float> raw(n);
  for (float& v : raw) v = dist(rng);
  return to_bf16(raw);
}

// One layer's weights at the model's initial scales: W_xz and W_write Xavier uniform, W_h with
// spectral norm about 0.9 (Gaussian, std 0.45/sqrt(D)), b_h small, a random tape whose slots
// differ enough for the attention to be far from uniform.
struct Weights {
  Bf16Data w_xz, w_h, b_h, w_write, tape0;
};

Weights random_weights(std::mt19937_64& rng, std::int64_t d, std::int64_t n, float tape_scale = 1.0f) {
  const auto dd = static_cast<std::size_t>(d * d);
  const float inv = 1.0f / std::sqrt(static_cast<float>(d));
  return {uniform_bf16(rng, 2 * dd, std::sqrt(2.0f) * inv), normal_bf16(rng, dd, 0.45f * inv),
          normal_bf16(rng, static_cast<std::size_t>(d), 0.1f), uniform_bf16(rng, dd, std::sqrt(3.0f) * inv),
          normal_bf16(rng, static_cast<std::size_t>(n * d), tape_scale)};
}

template <typename T>
core::Buffer to_device(const std::vector<T>& values) {
  core::Buffer buffer(core::Device::cuda(), std::max<std::size_t>(values.size(), 1) * sizeof(T));
  if (!values.empty()) {
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(buffer.data(), values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  return buffer;
}

template <typename T>
std::vector<T> from_device(const void* data, std::size_t count) {
  std::vector<T> out(count);
  CUDA_CHECK(cudaDeviceSynchronize());
  if (count) CUDA_CHECK(cudaMemcpy(out.data(), data, count * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

// NaN everywhere (0xFF bytes), so an element a kernel forgets fails.
core::Buffer poisoned(std::size_t bytes) {
  core::Buffer buffer(core::Device::cuda(), std::max<std::size_t>(bytes, 1));
  buffer.fill_bytes(0xFF);
  CUDA_CHECK(cudaDeviceSynchronize());
  return buffer;
}

std::vector<double> bf16_values(const Bits& bits) {
  std::vector<double> out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) out[i] = core::bf16_to_float(bits[i]);
  return out;
}

template <typename T>
std::vector<double> widen(const std::vector<T>& v) {
  return {v.begin(), v.end()};
}

// The largest relative error each tolerance class saw in the current case (printed per case, so a
// run shows the margins).
struct Worst {
  double error = 0.0;
  std::string name;
};
Worst g_worst_fp32, g_worst_bf16;

// ||actual - expected|| <= rtol ||expected|| and every element finite. The error counts in
// `worst`'s class (default: bf16 at kBf16Tolerance, fp32 otherwise).
::testing::AssertionResult normwise_close(std::string_view name, const std::vector<double>& actual,
                                          const std::vector<double>& expected, double rtol, Worst* worst_of = nullptr) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << name << ": size " << actual.size() << " != " << expected.size();
  }
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i]))
      return ::testing::AssertionFailure() << name << ": element " << i << " is " << actual[i];
    diff += (actual[i] - expected[i]) * (actual[i] - expected[i]);
    norm += expected[i] * expected[i];
  }
  const double relative = norm > 0.0 ? std::sqrt(diff / norm) : (diff > 0.0 ? INFINITY : 0.0);
  Worst& worst = worst_of != nullptr ? *worst_of : rtol == kBf16Tolerance ? g_worst_bf16 : g_worst_fp32;
  if (relative > worst.error) worst = {relative, std::string(name)};
  if (std::sqrt(diff) <= rtol * std::sqrt(norm)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << name << ": relative normwise error " << std::sqrt(diff / norm) << " > "
                                       << rtol << " (norm " << std::sqrt(norm) << ")";
}

double bf16_ulp(double value) {
  if (value == 0.0) return 0.0;
  int exponent = 0;
  std::frexp(std::fabs(value), &exponent);
  return std::ldexp(1.0, exponent - 8);
}

// Every element within one bf16 ulp (plus atol) of the reference, except at most `outliers`, each
// within ten times that.
::testing::AssertionResult within_one_bf16_ulp(std::string_view name, const std::vector<double>& actual,
                                               const std::vector<double>& expected, double atol,
                                               std::size_t outliers = 0) {
  std::size_t bad = 0, worst = 0;
  double worst_err = -1.0, worst_excess = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double err = std::fabs(actual[i] - expected[i]), bound = bf16_ulp(expected[i]) + atol;
    if (!(err <= bound)) {
      ++bad;
      worst_excess = std::max(worst_excess, bound > 0.0 ? err / bound : INFINITY);
      if (!(err <= worst_err)) {
        worst_err = err;
        worst = i;
      }
    }
  }
  if (bad == 0 || (bad <= outliers && worst_excess <= 10.0)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << name << ": " << bad << " of " << actual.size()
                                       << " elements beyond one bf16 ulp (" << outliers
                                       << " allowed within 10x); worst at " << worst << ": " << actual[worst] << " vs "
                                       << expected[worst];
}

template <typename T>
::testing::AssertionResult bit_identical(std::string_view name, const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << name << ": sizes differ";
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return ::testing::AssertionFailure() << name << ": differs at " << i;
  }
  return ::testing::AssertionSuccess();
}

struct Case {
  std::int64_t slots, dim, steps, batch;
};

std::string describe(const Case& c) {
  std::ostringstream os;
  os << "N " << c.slots << " D " << c.dim << " T " << c.steps << " B " << c.batch;
  return os.str();
}

// The layer's weights and gradients on the device.
struct DeviceLayer {
  core::Buffer w_xz, w_h, b_h, w_write, tape0;
  core::Buffer g_xz, g_h, g_b, g_write, g_tape0;

  DeviceLayer(const Weights& w, const std::vector<float>& grad_init_xz, const std::vector<float>& grad_init_h,
              const std::vector<float>& grad_init_b, const std::vector<float>& grad_init_write,
              const std::vector<float>& grad_init_tape0)
      : w_xz(to_device(w.w_xz.bits)),
        w_h(to_device(w.w_h.bits)),
        b_h(to_device(w.b_h.bits)),
        w_write(to_device(w.w_write.bits)),
        tape0(to_device(w.tape0.bits)),
        g_xz(to_device(grad_init_xz)),
        g_h(to_device(grad_init_h)),
        g_b(to_device(grad_init_b)),
        g_write(to_device(grad_init_write)),
        g_tape0(to_device(grad_init_tape0)) {}

  e29a::LayerWeightsCuda weights() const {
    return {w_xz.as<__nv_bfloat16>(), w_h.as<__nv_bfloat16>(), b_h.as<__nv_bfloat16>(), w_write.as<__nv_bfloat16>(),
            tape0.as<__nv_bfloat16>()};
  }
  e29a::LayerGradientsCuda grads() {
    return {g_xz.as<float>(), g_h.as<float>(), g_b.as<float>(), g_write.as<float>(), g_tape0.as<float>()};
  }
};

// Everything one GPU forward + backward produces, on the host.
struct GpuResult {
  std::vector<std::uint16_t> y, du;
  std::vector<float> g_xz, g_h, g_b, g_write, g_tape0;
  std::vector<float> h, read_attn, write_attn, score_read, score_write, end_h, end_tape;
};

// Which kernel each direction runs, and the persistent kernels' blocks a sequence and batch parts
// of the rows phase (0: chosen).
struct Kernels {
  e29a::RecurrenceKernel forward = e29a::RecurrenceKernel::hybrid, backward = e29a::RecurrenceKernel::hybrid;
  int cluster = 0, batch_parts = 0;
};

GpuResult run_gpu(const core::DeviceContext& context, const Case& c, const Weights& w, const Bits& u, const Bits& dy,
                  const std::vector<float>& grad_init, std::int64_t interval = 0,
                  const e29a::LayerBackwardOptions& options = {}, Kernels kernels = {}) {
  const std::int64_t B = c.batch, T = c.steps, D = c.dim, N = c.slots;
  auto slice = [&](std::size_t offset, std::size_t count) {
    return std::vector<float>(grad_init.begin() + offset, grad_init.begin() + offset + count);
  };
  const auto dd = static_cast<std::size_t>(D * D);
  DeviceLayer layer(w, slice(0, 2 * dd), slice(2 * dd, dd), slice(3 * dd, D), slice(3 * dd + D, dd),
                    slice(4 * dd + D, N * D));
  e29a::LayerCuda cuda(context, D, N, B, T, interval, options);
  cuda.set_persistent_cluster(kernels.cluster);
  cuda.set_persistent_batch_parts(kernels.batch_parts);
  cuda.set_forward_kernel(kernels.forward);
  cuda.set_backward_kernel(kernels.backward);
  auto acts = cuda.make_activations();
  core::Buffer u_d = to_device(u), dy_d = to_device(dy);
  const std::size_t tokens = static_cast<std::size_t>(B * T * D);
  core::Buffer y_d = poisoned(tokens * 2), du_d = poisoned(tokens * 2);
  core::Buffer end_h = poisoned(B * D * 4), end_tape = poisoned(B * N * D * 4);
  core::Buffer score_r = poisoned(T * B * N * 4), score_w = poisoned(T * B * N * 4);
  const e29a::LayerStateCuda end{end_h.as<float>(), end_tape.as<float>()};
  const e29a::ScoreGradientsCuda scores{score_r.as<float>(), score_w.as<float>()};
  cuda.forward(layer.weights(), u_d.as<__nv_bfloat16>(), B, T, y_d.as<__nv_bfloat16>(), acts, nullptr, &end);
  EXPECT_EQ(cuda.last_forward_kernel(), kernels.forward);
  cuda.backward(layer.weights(), u_d.as<__nv_bfloat16>(), dy_d.as<__nv_bfloat16>(), du_d.as<__nv_bfloat16>(),
                layer.grads(), acts, &scores);
  EXPECT_EQ(cuda.last_backward_kernel(), kernels.backward);
  context.synchronize();
  cuda.check();
  GpuResult r;
  r.y = from_device<std::uint16_t>(y_d.data(), tokens);
  r.du = from_device<std::uint16_t>(du_d.data(), tokens);
  r.g_xz = from_device<float>(layer.g_xz.data(), 2 * dd);
  r.g_h = from_device<float>(layer.g_h.data(), dd);
  r.g_b = from_device<float>(layer.g_b.data(), D);
  r.g_write = from_device<float>(layer.g_write.data(), dd);
  r.g_tape0 = from_device<float>(layer.g_tape0.data(), N * D);
  r.h = from_device<float>(acts.h(), (T + 1) * B * D);
  r.read_attn = from_device<float>(acts.read_attn(), T * B * N);
  r.write_attn = from_device<float>(acts.write_attn(), T * B * N);
  r.score_read = from_device<float>(score_r.data(), T * B * N);
  r.score_write = from_device<float>(score_w.data(), T * B * N);
  r.end_h = from_device<float>(end_h.data(), B * D);
  r.end_tape = from_device<float>(end_tape.data(), B * N * D);
  return r;
}

// The fp64 reference on the same values.
struct Reference {
  std::vector<double> y, du, g_xz, g_h, g_b, g_write, g_tape0;
  e29a::LayerActivations<double> acts;
  e29a::LayerBackwardTrace<double> scores;
  e29a::LayerState<double> end;
};

Reference run_reference(const Case& c, const Weights& w, const std::vector<double>& u, const std::vector<double>& dy,
                        const e29a::LayerBackwardOptions& options = {}) {
  const std::int64_t B = c.batch, T = c.steps, D = c.dim, N = c.slots;
  const e29a::LayerShape shape{B, T, D, N};
  const e29a::LayerWeights<double> view{w.w_xz.values, w.w_h.values, w.b_h.values, w.w_write.values, w.tape0.values};
  Reference r;
  r.y.resize(static_cast<std::size_t>(B * T * D));
  r.du.resize(r.y.size());
  r.g_xz.assign(static_cast<std::size_t>(2 * D * D), 0.0);
  r.g_h.assign(static_cast<std::size_t>(D * D), 0.0);
  r.g_b.assign(static_cast<std::size_t>(D), 0.0);
  r.g_write.assign(static_cast<std::size_t>(D * D), 0.0);
  r.g_tape0.assign(static_cast<std::size_t>(N * D), 0.0);
  e29a::layer_forward_cpu<double>(shape, view, u, r.y, &r.acts, nullptr, &r.end);
  e29a::layer_backward_cpu<double>(view, r.acts, u, dy, r.du, {r.g_xz, r.g_h, r.g_b, r.g_write, r.g_tape0}, &r.scores,
                                   options);
  return r;
}

// gpu - init, the gradient the backward added.
std::vector<double> added(const std::vector<float>& after, const std::vector<float>& init, std::size_t offset) {
  std::vector<double> out(after.size());
  for (std::size_t i = 0; i < after.size(); ++i) out[i] = double(after[i]) - double(init[offset + i]);
  return out;
}

double relative_error(const std::vector<float>& actual, const std::vector<double>& expected) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    diff += (actual[i] - expected[i]) * (actual[i] - expected[i]);
    norm += expected[i] * expected[i];
  }
  return norm > 0.0 ? std::sqrt(diff / norm) : 0.0;
}

// The case's fp32 tolerance: the largest error on the fp32 paths of two fp32 CPU runs, times 100
// (at least kFp32Tolerance), so a draw whose recurrence amplifies rounding gets the room it needs.
// The second run takes the input u with every value moved one fp32 ulp up or down at random:
// rounding-sized noise entering at every step, as a GPU's other summation orders put it there. One
// run alone under-measures a draw on which the recurrence is chaotic: its own error may happen to
// stay small while another rounding grows (N 8 D 1024 T 129 B 3 on an H100: on 5 draws of 25 the
// hybrid or the persistent path, or both, went past 100 times the one run's error, up to 7x).
double fp32_tolerance(const Case& c, const Weights& w, const std::vector<double>& u, const std::vector<double>& dy,
                      const Reference& r, const e29a::LayerBackwardOptions& options = {}) {
  const std::int64_t B = c.batch, T = c.steps, D = c.dim, N = c.slots;
  auto narrow = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  const std::vector<float> w_xz = narrow(w.w_xz.values), w_h = narrow(w.w_h.values), b_h = narrow(w.b_h.values),
                           w_write = narrow(w.w_write.values), tape0 = narrow(w.tape0.values), dy32 = narrow(dy);
  const e29a::LayerWeights<float> view{w_xz, w_h, b_h, w_write, tape0};
  auto error_of_run = [&](const std::vector<float>& u32) {
    std::vector<float> y(u32.size()), du(u32.size()), g_xz(static_cast<std::size_t>(2 * D * D)),
        g_h(static_cast<std::size_t>(D * D)), g_b(static_cast<std::size_t>(D)), g_write(g_h.size()),
        g_tape0(static_cast<std::size_t>(N * D));
    e29a::LayerActivations<float> acts;
    e29a::LayerBackwardTrace<float> scores;
    e29a::LayerState<float> end;
    e29a::layer_forward_cpu<float>({B, T, D, N}, view, u32, y, &acts, nullptr, &end);
    e29a::layer_backward_cpu<float>(view, acts, u32, dy32, du, {g_xz, g_h, g_b, g_write, g_tape0}, &scores, options);
    return std::max({relative_error(acts.h, r.acts.h), relative_error(acts.read_attn, r.acts.read_attn),
                     relative_error(acts.write_attn, r.acts.write_attn), relative_error(end.tape, r.end.tape),
                     relative_error(scores.read, r.scores.read), relative_error(scores.write, r.scores.write),
                     relative_error(g_b, r.g_b), relative_error(g_tape0, r.g_tape0)});
  };
  const std::vector<float> u32 = narrow(u);
  std::vector<float> nudged = u32;
  std::mt19937_64 coin(static_cast<std::uint64_t>(B * 1000003 + T * 1009 + D * 31 + N));
  for (float& v : nudged) v = std::nextafter(v, (coin() & 1) != 0 ? INFINITY : -INFINITY);
  const double e = std::max(error_of_run(u32), error_of_run(nudged));
  return std::max(kFp32Tolerance, 100.0 * e);
}

void compare(const Case& c, const GpuResult& g, const Reference& r, const std::vector<float>& grad_init,
             double fp32_tol = kFp32Tolerance) {
  const auto dd = static_cast<std::size_t>(c.dim * c.dim);
  g_worst_fp32 = {};
  g_worst_bf16 = {};
  const std::vector<double> y = bf16_values(g.y);
  double y_rms = 0.0;
  for (const double v : r.y) y_rms += v * v;
  y_rms = std::sqrt(y_rms / std::max<std::size_t>(r.y.size(), 1));
  // One element in 100,000 may stray further: on a long sequence a single feature can drift more
  // than the state's norm says (N 8 D 1024 T 129 B 3, one draw: one y element of 396,288 at 5%
  // from the reference on the hybrid and the persistent path alike, normwise 2.3e-5).
  EXPECT_TRUE(within_one_bf16_ulp("y", y, r.y, fp32_tol * y_rms, y.size() / 100000));
  EXPECT_TRUE(normwise_close("y", y, r.y, kBf16Tolerance));
  EXPECT_TRUE(normwise_close("h", widen(g.h), r.acts.h, fp32_tol));
  EXPECT_TRUE(normwise_close("read attention", widen(g.read_attn), r.acts.read_attn, fp32_tol));
  EXPECT_TRUE(normwise_close("write attention", widen(g.write_attn), r.acts.write_attn, fp32_tol));
  EXPECT_TRUE(normwise_close("end h", widen(g.end_h), r.end.h, fp32_tol));
  EXPECT_TRUE(normwise_close("end tape", widen(g.end_tape), r.end.tape, fp32_tol));
  EXPECT_TRUE(normwise_close("read score gradients", widen(g.score_read), r.scores.read, fp32_tol));
  EXPECT_TRUE(normwise_close("write score gradients", widen(g.score_write), r.scores.write, fp32_tol));
  EXPECT_TRUE(normwise_close("dL/db_h", added(g.g_b, grad_init, 3 * dd), r.g_b, fp32_tol));
  EXPECT_TRUE(normwise_close("dL/dH_0", added(g.g_tape0, grad_init, 4 * dd + c.dim), r.g_tape0, fp32_tol));
  EXPECT_TRUE(normwise_close("du", bf16_values(g.du), r.du, kBf16Tolerance));
  EXPECT_TRUE(normwise_close("dL/dW_xz", added(g.g_xz, grad_init, 0), r.g_xz, kBf16Tolerance));
  EXPECT_TRUE(normwise_close("dL/dW_h", added(g.g_h, grad_init, 2 * dd), r.g_h, kBf16Tolerance));
  EXPECT_TRUE(normwise_close("dL/dW_write", added(g.g_write, grad_init, 3 * dd + c.dim), r.g_write, kBf16Tolerance));
  std::printf("[ errors   ] %s: fp32 paths worst %.3g (%s; tolerance %.3g), bf16 paths worst %.3g (%s)\n",
              describe(c).c_str(), g_worst_fp32.error, g_worst_fp32.name.c_str(), fp32_tol, g_worst_bf16.error,
              g_worst_bf16.name.c_str());
}

constexpr e29a::RecurrenceKernel kHybrid = e29a::RecurrenceKernel::hybrid;
constexpr e29a::RecurrenceKernel kPersistent = e29a::RecurrenceKernel::persistent;
constexpr e29a::RecurrenceKernel kKernels[] = {kHybrid, kPersistent};

// Whether the persistent kernels take the case on this GPU (N 64 at D 1024 does not: its tape;
// the backward keeps two tapes on chip), with `cluster` blocks a sequence and the batch in `parts`
// (0: chosen).
bool persistent_forward_takes(const Case& c, int cluster = 0, int parts = 0) {
  return e29a::kernels::persistent_forward_refusal(static_cast<int>(c.dim), static_cast<int>(c.slots), c.batch, cluster,
                                                   parts)
      .empty();
}
bool persistent_backward_takes(const Case& c, int cluster = 0, int parts = 0) {
  return e29a::kernels::persistent_backward_refusal(static_cast<int>(c.dim), static_cast<int>(c.slots), c.batch,
                                                    cluster, parts)
      .empty();
}

// `kernel` in both directions where the case allows it (else hybrid); nullopt when persistent
// takes neither.
std::optional<Kernels> both(e29a::RecurrenceKernel kernel, const Case& c, int cluster = 0, int parts = 0) {
  if (kernel == kHybrid) return Kernels{};
  Kernels k{persistent_forward_takes(c, cluster, parts) ? kPersistent : kHybrid,
            persistent_backward_takes(c, cluster, parts) ? kPersistent : kHybrid, cluster, parts};
  if (k.forward == kHybrid && k.backward == kHybrid) return std::nullopt;
  return k;
}

std::string kernel_name(Kernels k) {
  auto name = [](e29a::RecurrenceKernel kernel) { return kernel == kPersistent ? "persistent" : "hybrid"; };
  auto chosen = [](int v) { return v > 0 ? std::to_string(v) : std::string("chosen"); };
  const bool persistent = k.forward == kPersistent || k.backward == kPersistent;
  return std::string(name(k.forward)) + " forward, " + name(k.backward) + " backward" +
         (persistent ? ", cluster " + chosen(k.cluster) + ", batch parts " + chosen(k.batch_parts) : "");
}

// The persistent kernels' shapes a test runs: the launch's choice, then each cluster size, then the
// rows phase's batch in one part and in two (a block multiplying twice the rows by half the batch).
struct Shape {
  int cluster, parts;
};
constexpr Shape kShapes[] = {{0, 0}, {1, 0}, {2, 0}, {4, 0}, {0, 1}, {0, 2}};

std::size_t gradient_count(const Case& c) {
  return static_cast<std::size_t>(4 * c.dim * c.dim + c.dim + c.slots * c.dim);
}

TEST(E29aGpu, MatchesReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  // Each value of N, D, T and B appears at least once; the CPU reference's cost (B T D (D + N))
  // keeps D = 1024 to short or narrow runs.
  const Case cases[] = {
      {8, 64, 1, 1},     {16, 72, 512, 3}, {32, 200, 7, 64}, {64, 64, 129, 64}, {8, 1024, 129, 3}, {64, 1024, 7, 1},
      {16, 200, 129, 3}, {32, 72, 512, 1}, {5, 72, 7, 3},    {40, 200, 7, 3},   {8, 5, 37, 2},     {16, 12, 7, 5},
      {8, 1024, 16, 64}, {16, 800, 33, 5}, {8, 900, 9, 7},   {16, 200, 9, 13},  {8, 900, 5, 11},   {16, 1024, 9, 3},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c));
    const Weights w = random_weights(rng, c.dim, c.slots);
    const std::size_t tokens = static_cast<std::size_t>(c.batch * c.steps * c.dim);
    const Bf16Data u = normal_bf16(rng, tokens, 1.0f), dy = normal_bf16(rng, tokens, 1.0f);
    const std::vector<float> grad_init = test::random_normal(rng, gradient_count(c), 0.5f);
    const Reference r = run_reference(c, w, u.values, dy.values);
    const double tol = fp32_tolerance(c, w, u.values, dy.values, r);
    for (const e29a::RecurrenceKernel kernel : kKernels) {
      for (const Shape shape : kShapes) {
        if (kernel == kHybrid && (shape.cluster != 0 || shape.parts != 0)) continue;
        const std::optional<Kernels> k = both(kernel, c, shape.cluster, shape.parts);
        if (!k) continue;
        SCOPED_TRACE(kernel_name(*k));
        const GpuResult g = run_gpu(context, c, w, u.bits, dy.bits, grad_init, 0, {}, *k);
        compare(c, g, r, grad_init, tol);
      }
    }
  }
}

// The backward's options (detached scores, the carried gradient's bound) on the GPU as in the
// reference, both backwards (the persistent one refuses the bound); the bound (1.0) is below the
// carried norms of these draws, so it acts.
TEST(E29aGpu, BackwardOptionsMatchReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const Case cases[] = {{16, 72, 129, 3}, {8, 200, 37, 2}, {64, 64, 65, 1}};
  e29a::LayerBackwardOptions read, write, both, clip, clip_both;
  read.detach_read_scores = true;
  write.detach_write_scores = true;
  both.detach_read_scores = both.detach_write_scores = true;
  clip.carry_clip = 1.0;
  clip_both = both;
  clip_both.carry_clip = 1.0;
  const std::pair<const char*, e29a::LayerBackwardOptions> variants[] = {{"detach read", read},
                                                                         {"detach write", write},
                                                                         {"detach both", both},
                                                                         {"carry clip", clip},
                                                                         {"both + clip", clip_both}};
  for (const Case& c : cases) {
    for (const auto& [name, options] : variants) {
      SCOPED_TRACE(describe(c) + ", " + name);
      const Weights w = random_weights(rng, c.dim, c.slots);
      const std::size_t tokens = static_cast<std::size_t>(c.batch * c.steps * c.dim);
      const Bf16Data u = normal_bf16(rng, tokens, 1.0f), dy = normal_bf16(rng, tokens, 1.0f);
      const std::vector<float> grad_init = test::random_normal(rng, gradient_count(c), 0.5f);
      const Reference r = run_reference(c, w, u.values, dy.values, options);
      const double tol = fp32_tolerance(c, w, u.values, dy.values, r, options);
      for (const e29a::RecurrenceKernel backward : kKernels) {
        if (backward == kPersistent && options.carry_clip > 0) continue;
        SCOPED_TRACE(backward == kPersistent ? "persistent backward" : "hybrid backward");
        const GpuResult g = run_gpu(context, c, w, u.bits, dy.bits, grad_init, 0, options, {kHybrid, backward});
        compare(c, g, r, grad_init, tol);
      }
    }
  }
}

// The backward replays the tape from checkpoints with the forward's arithmetic, so every result is
// bit-identical whatever the checkpoint interval, and run to run; D 512 also with a sequence spread
// over a cluster of 2 (each block replays its slice).
TEST(E29aGpu, BitIdenticalAcrossRunsAndCheckpointIntervals) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  struct Run {
    Case c;
    int cluster;  // the persistent kernels' blocks a sequence (0: chosen)
  };
  for (const Run& run : {Run{{16, 200, 37, 5}, 0}, Run{{8, 512, 37, 5}, 2}}) {
    const Case& c = run.c;
    SCOPED_TRACE(describe(c));
    const Weights w = random_weights(rng, c.dim, c.slots);
    const std::size_t tokens = static_cast<std::size_t>(c.batch * c.steps * c.dim);
    const Bf16Data u = normal_bf16(rng, tokens, 1.0f), dy = normal_bf16(rng, tokens, 1.0f);
    const std::vector<float> grad_init = test::random_normal(rng, gradient_count(c), 0.5f);
    for (const e29a::RecurrenceKernel kernel : kKernels) {
      const Kernels k = *both(kernel, c, run.cluster);
      SCOPED_TRACE(kernel_name(k));
      const GpuResult base = run_gpu(context, c, w, u.bits, dy.bits, grad_init, 0, {}, k);
      for (const std::int64_t interval : {std::int64_t{0}, std::int64_t{1}, std::int64_t{5}, std::int64_t{36},
                                          std::int64_t{37}, std::int64_t{1000}}) {
        SCOPED_TRACE("interval " + std::to_string(interval));
        const GpuResult again = run_gpu(context, c, w, u.bits, dy.bits, grad_init, interval, {}, k);
        EXPECT_TRUE(bit_identical("y", again.y, base.y));
        EXPECT_TRUE(bit_identical("du", again.du, base.du));
        EXPECT_TRUE(bit_identical("dW_xz", again.g_xz, base.g_xz));
        EXPECT_TRUE(bit_identical("dW_h", again.g_h, base.g_h));
        EXPECT_TRUE(bit_identical("db_h", again.g_b, base.g_b));
        EXPECT_TRUE(bit_identical("dW_write", again.g_write, base.g_write));
        EXPECT_TRUE(bit_identical("dH_0", again.g_tape0, base.g_tape0));
        EXPECT_TRUE(bit_identical("write score gradients", again.score_write, base.score_write));
        EXPECT_TRUE(bit_identical("read score gradients", again.score_read, base.score_read));
      }
    }
  }
}

// At the benchmark's size (no reference: too slow on a CPU): finite and bit-identical run to run.
TEST(E29aGpu, BenchmarkShapeIsFiniteAndDeterministic) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const Case c{8, 1024, 512, 64};
  const Weights w = random_weights(rng, c.dim, c.slots);
  const std::size_t tokens = static_cast<std::size_t>(c.batch * c.steps * c.dim);
  const Bf16Data u = normal_bf16(rng, tokens, 1.0f), dy = normal_bf16(rng, tokens, 1.0f);
  const std::vector<float> grad_init(gradient_count(c), 0.0f);
  for (const e29a::RecurrenceKernel kernel : kKernels) {
    const Kernels k = *both(kernel, c);
    SCOPED_TRACE(kernel_name(k));
    const GpuResult a = run_gpu(context, c, w, u.bits, dy.bits, grad_init, 0, {}, k);
    const GpuResult b = run_gpu(context, c, w, u.bits, dy.bits, grad_init, 0, {}, k);
    for (const float v : a.g_tape0) ASSERT_TRUE(std::isfinite(v));
    for (const float v : a.g_h) ASSERT_TRUE(std::isfinite(v));
    for (const auto v : a.du) ASSERT_TRUE(std::isfinite(core::bf16_to_float(v)));
    EXPECT_TRUE(bit_identical("y", a.y, b.y));
    EXPECT_TRUE(bit_identical("du", a.du, b.du));
    EXPECT_TRUE(bit_identical("dW_h", a.g_h, b.g_h));
    EXPECT_TRUE(bit_identical("dW_xz", a.g_xz, b.g_xz));
    EXPECT_TRUE(bit_identical("dH_0", a.g_tape0, b.g_tape0));
  }
}

// A zero tape (upstream's start) on the GPU: every slot stays equal, both attentions are exactly
// uniform, the score gradients are exactly zero and every slot of dL/dH_0 is the same.
TEST(E29aGpu, ZeroTapeDegeneracy) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  for (const auto& [c, kernel] : {std::pair{Case{8, 72, 19, 3}, kHybrid}, std::pair{Case{64, 200, 7, 2}, kHybrid},
                                  std::pair{Case{40, 64, 9, 1}, kHybrid}, std::pair{Case{8, 72, 19, 3}, kPersistent},
                                  std::pair{Case{40, 64, 9, 2}, kPersistent}}) {
    const Kernels k = *both(kernel, c);
    SCOPED_TRACE(describe(c) + ", " + kernel_name(k));
    Weights w = random_weights(rng, c.dim, c.slots);
    std::fill(w.tape0.bits.begin(), w.tape0.bits.end(), std::uint16_t{0});
    std::fill(w.tape0.values.begin(), w.tape0.values.end(), 0.0);
    const std::size_t tokens = static_cast<std::size_t>(c.batch * c.steps * c.dim);
    const Bf16Data u = normal_bf16(rng, tokens, 1.0f), dy = normal_bf16(rng, tokens, 1.0f);
    const std::vector<float> grad_init(gradient_count(c), 0.0f);
    const GpuResult g = run_gpu(context, c, w, u.bits, dy.bits, grad_init, 0, {}, k);
    const float uniform = 1.0f / static_cast<float>(c.slots);
    for (const float a : g.read_attn) ASSERT_EQ(a, uniform);
    for (const float a : g.write_attn) ASSERT_EQ(a, uniform);
    for (const float s : g.score_read) ASSERT_EQ(s, 0.0f);
    for (const float s : g.score_write) ASSERT_EQ(s, 0.0f);
    const auto D = static_cast<std::size_t>(c.dim);
    for (std::int64_t b = 0; b < c.batch; ++b) {
      const float* tape = g.end_tape.data() + b * c.slots * c.dim;
      for (std::int64_t n = 1; n < c.slots; ++n) {
        ASSERT_EQ(std::memcmp(tape, tape + n * D, D * sizeof(float)), 0) << "sequence " << b << " slot " << n;
      }
    }
    bool nonzero = false;
    for (std::int64_t n = 0; n < c.slots; ++n) {
      ASSERT_EQ(std::memcmp(g.g_tape0.data(), g.g_tape0.data() + n * D, D * sizeof(float)), 0) << "slot " << n;
    }
    for (std::size_t d = 0; d < D; ++d) nonzero = nonzero || g.g_tape0[d] != 0.0f;
    EXPECT_TRUE(nonzero) << "dL/dH_0 should still be non-zero (the read value and the write keep it)";
    // And the values match the reference.
    const Reference r = run_reference(c, w, u.values, dy.values);
    compare(c, g, r, grad_init);
  }
}

// A forward over T steps equals two forwards over T1 and T - T1 handing the state over.
TEST(E29aGpu, StateCarriesAcrossCalls) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const std::int64_t B = 3, T = 23, T1 = 9, D = 72, N = 16;
  const Weights w = random_weights(rng, D, N);
  const Bf16Data u = normal_bf16(rng, static_cast<std::size_t>(B * T * D), 1.0f);
  auto slice = [&](std::size_t n) { return std::vector<float>(n, 0.0f); };
  const auto dd = static_cast<std::size_t>(D * D);
  DeviceLayer layer(w, slice(2 * dd), slice(dd), slice(D), slice(dd), slice(N * D));
  for (const e29a::RecurrenceKernel kernel : kKernels) {
    SCOPED_TRACE(kernel == kPersistent ? "persistent forward" : "hybrid forward");
    e29a::LayerCuda cuda(context, D, N, B, T);
    cuda.set_forward_kernel(kernel);
    auto acts = cuda.make_activations();
    core::Buffer u_d = to_device(u.bits);
    core::Buffer y_full = poisoned(B * T * D * 2);
    core::Buffer end_h = poisoned(B * D * 4), end_tape = poisoned(B * N * D * 4);
    const e29a::LayerStateCuda end{end_h.as<float>(), end_tape.as<float>()};
    cuda.forward(layer.weights(), u_d.as<__nv_bfloat16>(), B, T, y_full.as<__nv_bfloat16>(), acts, nullptr, &end);
    const auto y_ref = bf16_values(from_device<std::uint16_t>(y_full.data(), B * T * D));
    const auto end_h_ref = widen(from_device<float>(end_h.data(), B * D));
    const auto end_tape_ref = widen(from_device<float>(end_tape.data(), B * N * D));

    // The two halves: [B, T1, D] and [B, T - T1, D] slices of u.
    auto part = [&](std::int64_t t0, std::int64_t len) {
      Bits out(static_cast<std::size_t>(B * len * D));
      for (std::int64_t b = 0; b < B; ++b) {
        std::copy_n(u.bits.begin() + (b * T + t0) * D, len * D, out.begin() + b * len * D);
      }
      return out;
    };
    core::Buffer u1 = to_device(part(0, T1)), u2 = to_device(part(T1, T - T1));
    core::Buffer y1 = poisoned(B * T1 * D * 2), y2 = poisoned(B * (T - T1) * D * 2);
    core::Buffer mid_h = poisoned(B * D * 4), mid_tape = poisoned(B * N * D * 4);
    core::Buffer fin_h = poisoned(B * D * 4), fin_tape = poisoned(B * N * D * 4);
    const e29a::LayerStateCuda mid{mid_h.as<float>(), mid_tape.as<float>()};
    const e29a::LayerStateCuda fin{fin_h.as<float>(), fin_tape.as<float>()};
    cuda.forward(layer.weights(), u1.as<__nv_bfloat16>(), B, T1, y1.as<__nv_bfloat16>(), acts, nullptr, &mid);
    cuda.forward(layer.weights(), u2.as<__nv_bfloat16>(), B, T - T1, y2.as<__nv_bfloat16>(), acts, &mid, &fin);
    const auto y1h = bf16_values(from_device<std::uint16_t>(y1.data(), B * T1 * D));
    const auto y2h = bf16_values(from_device<std::uint16_t>(y2.data(), B * (T - T1) * D));
    std::vector<double> joined(static_cast<std::size_t>(B * T * D));
    for (std::int64_t b = 0; b < B; ++b) {
      std::copy_n(y1h.begin() + b * T1 * D, T1 * D, joined.begin() + b * T * D);
      std::copy_n(y2h.begin() + b * (T - T1) * D, (T - T1) * D, joined.begin() + (b * T + T1) * D);
    }
    // The input projection over a different number of rows may sum in another order (fp32 rounding
    // of x/z), which may move a bf16 output by one ulp.
    EXPECT_TRUE(within_one_bf16_ulp("y", joined, y_ref, 0.0));
    EXPECT_TRUE(normwise_close("end h", widen(from_device<float>(fin_h.data(), B * D)), end_h_ref, 1e-5));
    EXPECT_TRUE(normwise_close("end tape", widen(from_device<float>(fin_tape.data(), B * N * D)), end_tape_ref, 1e-5));
  }
}

// The persistent kernels against the hybrid path on the same draw, in every pairing of forward and
// backward: every saved tensor and every gradient close. They differ only in the recurrent
// products' summation order, fp32 rounding that the recurrence carries and may amplify (on a
// D 1024, B 64 draw the fp32 CPU reference itself is up to 1e-4 from fp64; see MatchesReference,
// which holds both to the reference), so fp32 paths are compared normwise at 10x the fp32 floor
// and bf16 outputs and products at the bf16 tolerance, each at least the draw's fp32 tolerance
// (fp32_tolerance): on a chaotic draw (N 16 D 1024 T 33 B 16, H100) both the FMA and the
// tensor-core rows phase ended 2.5-3.5e-2 from the hybrid path in every gradient, with the forward
// 5-7e-4 apart. A wrong row, slot or step moves them by 1e-2 or more on the other draws.
TEST(E29aGpu, PersistentKernelsMatchHybrid) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  for (const Case c : {Case{8, 1024, 64, 64}, Case{16, 1024, 33, 16}, Case{64, 200, 19, 7}, Case{5, 24, 9, 120}}) {
    const Weights w = random_weights(rng, c.dim, c.slots);
    const std::size_t tokens = static_cast<std::size_t>(c.batch * c.steps * c.dim);
    const Bf16Data u = normal_bf16(rng, tokens, 1.0f), dy = normal_bf16(rng, tokens, 1.0f);
    const double draw_tol = fp32_tolerance(c, w, u.values, dy.values, run_reference(c, w, u.values, dy.values));
    const double fp32_tol = std::max(10 * kFp32Tolerance, draw_tol), bf16_tol = std::max(kBf16Tolerance, draw_tol);
    const std::vector<float> grad_init(gradient_count(c), 0.0f);
    const GpuResult hybrid = run_gpu(context, c, w, u.bits, dy.bits, grad_init, 0, {}, {});
    for (const Kernels k :
         {Kernels{kPersistent, kPersistent}, Kernels{kPersistent, kHybrid}, Kernels{kHybrid, kPersistent}}) {
      SCOPED_TRACE(describe(c) + ", " + kernel_name(k));
      ASSERT_TRUE(persistent_forward_takes(c) && persistent_backward_takes(c));
      const GpuResult persistent = run_gpu(context, c, w, u.bits, dy.bits, grad_init, 0, {}, k);
      g_worst_fp32 = {};
      g_worst_bf16 = {};
      EXPECT_TRUE(normwise_close("y", bf16_values(persistent.y), bf16_values(hybrid.y), bf16_tol, &g_worst_bf16));
      EXPECT_TRUE(normwise_close("h", widen(persistent.h), widen(hybrid.h), fp32_tol));
      EXPECT_TRUE(normwise_close("read attention", widen(persistent.read_attn), widen(hybrid.read_attn), fp32_tol));
      EXPECT_TRUE(normwise_close("write attention", widen(persistent.write_attn), widen(hybrid.write_attn), fp32_tol));
      EXPECT_TRUE(normwise_close("end h", widen(persistent.end_h), widen(hybrid.end_h), fp32_tol));
      EXPECT_TRUE(normwise_close("end tape", widen(persistent.end_tape), widen(hybrid.end_tape), fp32_tol));
      EXPECT_TRUE(normwise_close("read score gradients", widen(persistent.score_read), widen(hybrid.score_read),
                                 bf16_tol, &g_worst_bf16));
      EXPECT_TRUE(normwise_close("write score gradients", widen(persistent.score_write), widen(hybrid.score_write),
                                 bf16_tol, &g_worst_bf16));
      EXPECT_TRUE(normwise_close("dL/dH_0", widen(persistent.g_tape0), widen(hybrid.g_tape0), bf16_tol, &g_worst_bf16));
      EXPECT_TRUE(normwise_close("dL/db_h", widen(persistent.g_b), widen(hybrid.g_b), bf16_tol, &g_worst_bf16));
      EXPECT_TRUE(normwise_close("dL/dW_h", widen(persistent.g_h), widen(hybrid.g_h), bf16_tol, &g_worst_bf16));
      EXPECT_TRUE(
          normwise_close("dL/dW_write", widen(persistent.g_write), widen(hybrid.g_write), bf16_tol, &g_worst_bf16));
      EXPECT_TRUE(normwise_close("dL/dW_xz", widen(persistent.g_xz), widen(hybrid.g_xz), bf16_tol, &g_worst_bf16));
      EXPECT_TRUE(normwise_close("du", bf16_values(persistent.du), bf16_values(hybrid.du), bf16_tol, &g_worst_bf16));
      std::printf("[ errors   ] %s, %s: against hybrid worst fp32 %.3g (%s), bf16 %.3g (%s); tolerances %.3g, %.3g\n",
                  describe(c).c_str(), kernel_name(k).c_str(), g_worst_fp32.error, g_worst_fp32.name.c_str(),
                  g_worst_bf16.error, g_worst_bf16.name.c_str(), fp32_tol, bf16_tol);
    }
  }
}

// At a trained state: layer 0 of a byte-level E29a trained 300 steps on the King James Bible
// (tests/fixtures/e29a/trained/, made by tests/fixtures/make_e29a_trained_fixture.sh: learned tape,
// D 64, N 8), its input the normed embeddings of held-out text, as the model feeds it. Both kinds
// against the fp64 reference and the persistent kernels against the hybrid path, as on random
// draws.
TEST(E29aGpu, TrainedStateMatchesReferenceAndHybrid) {
  REQUIRE_GPU();
  std::mt19937_64 rng(test::fresh_seed());
  core::DeviceContext context(core::Device::cuda());
  const std::string dir = std::string(LLMTRAIN_FIXTURES_DIR) + "/e29a/trained";
  const models::SafetensorsFile file(dir + "/model.safetensors");
  const std::string layer = "model.layers.0.";
  const Weights w{to_bf16(file.read_f32(layer + "mixer.W_xz.weight")),
                  to_bf16(file.read_f32(layer + "mixer.W_h.weight")), to_bf16(file.read_f32(layer + "mixer.b_h")),
                  to_bf16(file.read_f32(layer + "mixer.W_write.weight")),
                  to_bf16(file.read_f32(layer + "mixer.tape_init"))};
  const std::vector<float> embedding = file.read_f32("model.embed_tokens.weight");
  const std::vector<float> norm = file.read_f32(layer + "input_layernorm.weight");
  const auto D = static_cast<std::int64_t>(norm.size());
  ASSERT_EQ(w.tape0.values.size() % static_cast<std::size_t>(D), 0u);
  const Case c{static_cast<std::int64_t>(w.tape0.values.size()) / D, D, 129, 5};
  std::ifstream text_file(dir + "/text.txt", std::ios::binary);
  ASSERT_TRUE(text_file) << "missing " << dir << "/text.txt (tests/fixtures/make_e29a_trained_fixture.sh)";
  const std::string text((std::istreambuf_iterator<char>(text_file)), std::istreambuf_iterator<char>());
  ASSERT_GE(text.size(), static_cast<std::size_t>(c.batch * c.steps));
  // u = RMSNorm(embedding of each byte) * weight, eps 1e-6, rounded to bf16 like the model's input.
  std::vector<float> raw(static_cast<std::size_t>(c.batch * c.steps * D));
  for (std::int64_t i = 0; i < c.batch * c.steps; ++i) {
    const float* e = embedding.data() + static_cast<unsigned char>(text[static_cast<std::size_t>(i)]) * D;
    double sq = 0.0;
    for (std::int64_t d = 0; d < D; ++d) sq += static_cast<double>(e[d]) * e[d];
    const double inv = 1.0 / std::sqrt(sq / static_cast<double>(D) + 1e-6);
    for (std::int64_t d = 0; d < D; ++d)
      raw[static_cast<std::size_t>(i * D + d)] = static_cast<float>(e[d] * inv * norm[d]);
  }
  const Bf16Data u = to_bf16(raw);
  const Bf16Data dy = normal_bf16(rng, raw.size(), 1.0f);
  const std::vector<float> grad_init = test::random_normal(rng, gradient_count(c), 0.5f);
  const Reference r = run_reference(c, w, u.values, dy.values);
  const double tol = fp32_tolerance(c, w, u.values, dy.values, r);
  ASSERT_TRUE(persistent_forward_takes(c) && persistent_backward_takes(c));
  const GpuResult hybrid = run_gpu(context, c, w, u.bits, dy.bits, grad_init, 0, {}, {});
  const GpuResult persistent = run_gpu(context, c, w, u.bits, dy.bits, grad_init, 0, {}, {kPersistent, kPersistent});
  {
    SCOPED_TRACE("hybrid against the reference");
    compare(c, hybrid, r, grad_init, tol);
  }
  {
    SCOPED_TRACE("persistent against the reference");
    compare(c, persistent, r, grad_init, tol);
  }
  g_worst_fp32 = {};
  g_worst_bf16 = {};
  EXPECT_TRUE(normwise_close("h", widen(persistent.h), widen(hybrid.h), 10 * kFp32Tolerance));
  EXPECT_TRUE(
      normwise_close("write attention", widen(persistent.write_attn), widen(hybrid.write_attn), 10 * kFp32Tolerance));
  EXPECT_TRUE(normwise_close("dL/dH_0", widen(persistent.g_tape0), widen(hybrid.g_tape0), kBf16Tolerance));
  EXPECT_TRUE(normwise_close("dL/dW_h", widen(persistent.g_h), widen(hybrid.g_h), kBf16Tolerance));
  EXPECT_TRUE(normwise_close("du", bf16_values(persistent.du), bf16_values(hybrid.du), kBf16Tolerance));
  std::printf("[ errors   ] trained state %s: persistent against hybrid worst fp32 %.3g (%s), bf16 %.3g (%s)\n",
              describe(c).c_str(), g_worst_fp32.error, g_worst_fp32.name.c_str(), g_worst_bf16.error,
              g_worst_bf16.name.c_str());
}

// A small layer on the persistent forward with a 50 ms deadline, its input and an output buffer;
// `cluster` blocks a sequence (0: chosen).
struct DeadlineCase {
  static constexpr std::int64_t B = 4, T = 5, N = 8;
  static std::vector<float> zeros(std::int64_t n) { return std::vector<float>(static_cast<std::size_t>(n), 0.0f); }
  std::int64_t D;
  std::mt19937_64 rng{test::fresh_seed()};
  core::DeviceContext context{core::Device::cuda()};
  Weights w = random_weights(rng, D, N);
  Bf16Data u = normal_bf16(rng, static_cast<std::size_t>(B* T* D), 1.0f);
  DeviceLayer layer{w, zeros(2 * D * D), zeros(D* D), zeros(D), zeros(D* D), zeros(N* D)};
  e29a::LayerCuda cuda{context, D, N, B, T};
  e29a::LayerActivationsCuda acts;
  core::Buffer u_d = to_device(u.bits), y = poisoned(B * T * D * 2);

  explicit DeadlineCase(std::int64_t dim = 64, int cluster = 0) : D(dim) {
    cuda.set_persistent_cluster(cluster);
    cuda.set_forward_kernel(e29a::RecurrenceKernel::persistent);
    cuda.set_persistent_timeout(0.05);
    acts = cuda.make_activations();
  }
  void forward() { cuda.forward(layer.weights(), u_d.as<__nv_bfloat16>(), B, T, y.as<__nv_bfloat16>(), acts); }
  void expect_finite_output() {
    for (const double v : bf16_values(from_device<std::uint16_t>(y.data(), B * T * D))) ASSERT_TRUE(std::isfinite(v));
  }
};

// Block `forward_block` never arrives at the forward's first barrier, then `backward_block` at the
// backward's: every block leaves at the deadline, check() says where, and the next launch runs
// normally.
void stall_and_recover(DeadlineCase& c, int forward_block, int backward_block) {
  constexpr std::int64_t B = DeadlineCase::B, T = DeadlineCase::T;
  const std::int64_t D = c.D;
  c.cuda.stall_block_for_tests(forward_block);
  c.forward();
  try {
    c.cuda.check();
    ADD_FAILURE() << "a stalled launch should throw";
  } catch (const core::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("grid barrier 1"), std::string::npos) << what;
    EXPECT_NE(what.find("waited more than"), std::string::npos) << what;
  }
  c.cuda.stall_block_for_tests(-1);
  c.forward();
  EXPECT_NO_THROW(c.cuda.check());
  c.expect_finite_output();

  // The backward: the same deadline, its own message, and the next backward runs normally.
  core::Buffer dy_d = to_device(c.u.bits), du = poisoned(B * T * D * 2);
  c.cuda.set_backward_kernel(e29a::RecurrenceKernel::persistent);
  c.cuda.stall_block_for_tests(backward_block);
  c.cuda.backward(c.layer.weights(), c.u_d.as<__nv_bfloat16>(), dy_d.as<__nv_bfloat16>(), du.as<__nv_bfloat16>(),
                  c.layer.grads(), c.acts);
  try {
    c.cuda.check();
    ADD_FAILURE() << "a stalled backward should throw";
  } catch (const core::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("persistent backward"), std::string::npos) << what;
    EXPECT_NE(what.find("grid barrier 1"), std::string::npos) << what;
  }
  c.cuda.stall_block_for_tests(-1);
  c.cuda.backward(c.layer.weights(), c.u_d.as<__nv_bfloat16>(), dy_d.as<__nv_bfloat16>(), du.as<__nv_bfloat16>(),
                  c.layer.grads(), c.acts);
  EXPECT_NO_THROW(c.cuda.check());
  for (const double v : bf16_values(from_device<std::uint16_t>(du.data(), B * T * D))) ASSERT_TRUE(std::isfinite(v));
}

TEST(E29aGpu, PersistentStallLeavesAtDeadline) {
  REQUIRE_GPU();
  DeadlineCase c;
  stall_and_recover(c, 1, 2);
}

// The same with each sequence spread over a cluster of 2 blocks (D 512): the stalled block is
// rank 1 of sequence 0's cluster in the forward and rank 0 of sequence 1's in the backward; its
// peer goes on to their next exchange and the cluster leaves together.
TEST(E29aGpu, PersistentClusterStallLeavesAtDeadline) {
  REQUIRE_GPU();
  DeadlineCase c(512, 2);
  ASSERT_TRUE(c.cuda.persistent_refusal().empty()) << c.cuda.persistent_refusal();
  stall_and_recover(c, 1, 2);
}

// The abort record is sticky: a stalled launch followed at once by a normal one (whose copy of the
// words lands last) is still reported, by the second forward or by check(), once; then launches
// run normally again.
TEST(E29aGpu, PersistentAbortIsReportedThroughALaterLaunch) {
  REQUIRE_GPU();
  DeadlineCase c;
  c.cuda.stall_block_for_tests(1);
  c.forward();
  c.cuda.stall_block_for_tests(-1);
  int reports = 0;
  try {
    c.forward();
    c.cuda.check();
  } catch (const core::Error& e) {
    ++reports;
    EXPECT_NE(std::string(e.what()).find("grid barrier 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(reports, 1);
  EXPECT_NO_THROW(c.cuda.check());  // reported once
  c.forward();
  EXPECT_NO_THROW(c.cuda.check());
  c.expect_finite_output();
}

// A width whose rows do not fit a block's shared memory: the persistent forward refuses by name,
// and the default takes the hybrid path.
TEST(E29aGpu, PersistentRefusesWhatDoesNotFit) {
  REQUIRE_GPU();
  core::DeviceContext context(core::Device::cuda());
  e29a::LayerCuda wide(context, 8192, 8, 1, 1);
  EXPECT_FALSE(wide.persistent_refusal().empty());
  try {
    wide.set_forward_kernel(e29a::RecurrenceKernel::persistent);
    ADD_FAILURE() << "dim 8192 should be refused";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("persistent forward cannot run"), std::string::npos) << e.what();
  }
  e29a::LayerCuda narrow(context, 1024, 8, 64, 4);
  EXPECT_TRUE(narrow.persistent_refusal().empty()) << narrow.persistent_refusal();
  // The sequence phase's threads own 4 features each: 1,024 at most.
  e29a::LayerCuda wider(context, 1032, 8, 1, 1);
  EXPECT_NE(wider.persistent_refusal().find("dim 1032 is above 1024"), std::string::npos) << wider.persistent_refusal();
  // A block per sequence: more sequences than SMs go to the hybrid path.
  e29a::LayerCuda many(context, 64, 8, 100000, 1);
  EXPECT_NE(many.persistent_refusal().find("batch 100000"), std::string::npos) << many.persistent_refusal();
  // The tape on chip: N 64 at D 1024 is 256 KB.
  e29a::LayerCuda big_tape(context, 1024, 64, 4, 4);
  EXPECT_NE(big_tape.persistent_refusal().find("shared memory"), std::string::npos) << big_tape.persistent_refusal();
  // The backward keeps two tapes: N 32 at D 1024 fits the forward only.
  e29a::LayerCuda two_tapes(context, 1024, 32, 4, 4);
  EXPECT_TRUE(two_tapes.persistent_refusal().empty()) << two_tapes.persistent_refusal();
  EXPECT_NE(two_tapes.persistent_backward_refusal().find("two tapes"), std::string::npos)
      << two_tapes.persistent_backward_refusal();
  try {
    two_tapes.set_backward_kernel(e29a::RecurrenceKernel::persistent);
    ADD_FAILURE() << "N 32 at D 1024 should be refused by the persistent backward";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("persistent backward cannot run"), std::string::npos) << e.what();
  }
  // The carried gradient's bound needs the whole carried norm before each step.
  e29a::LayerBackwardOptions clip;
  clip.carry_clip = 1.0;
  e29a::LayerCuda clipped(context, 64, 8, 4, 4, 0, clip);
  EXPECT_NE(clipped.persistent_backward_refusal().find("carry_grad_clip"), std::string::npos)
      << clipped.persistent_backward_refusal();
  EXPECT_TRUE(narrow.persistent_backward_refusal().empty()) << narrow.persistent_backward_refusal();
  // Blocks a sequence: 1, 2 or 4, each with a 256-feature chunk of its own, within the SMs.
  e29a::LayerCuda odd(context, 1024, 8, 4, 4);
  odd.set_persistent_cluster(3);
  EXPECT_NE(odd.persistent_refusal().find("must be 1, 2 or 4"), std::string::npos) << odd.persistent_refusal();
  e29a::LayerCuda thin(context, 200, 8, 4, 4);
  thin.set_persistent_cluster(2);
  EXPECT_NE(thin.persistent_refusal().find("fewer than 2 chunks"), std::string::npos) << thin.persistent_refusal();
  narrow.set_persistent_cluster(4);
  EXPECT_NE(narrow.persistent_refusal().find("more than the"), std::string::npos) << narrow.persistent_refusal();
  try {
    narrow.set_forward_kernel(e29a::RecurrenceKernel::persistent);
    ADD_FAILURE() << "64 sequences of 4 blocks should be refused";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cluster 4"), std::string::npos) << e.what();
  }
  narrow.set_persistent_cluster(0);
  EXPECT_TRUE(narrow.persistent_refusal().empty()) << narrow.persistent_refusal();
  // Batch parts of the rows phase: 1 or 2, each part at least one group of 8 sequences.
  odd.set_persistent_cluster(0);
  odd.set_persistent_batch_parts(3);
  EXPECT_NE(odd.persistent_refusal().find("batch parts 3: must be 1 or 2"), std::string::npos)
      << odd.persistent_refusal();
  odd.set_persistent_batch_parts(2);
  EXPECT_NE(odd.persistent_refusal().find("batch 4 has fewer than 2 groups"), std::string::npos)
      << odd.persistent_refusal();
  EXPECT_NE(odd.persistent_backward_refusal().find("batch 4 has fewer than 2 groups"), std::string::npos)
      << odd.persistent_backward_refusal();
  e29a::LayerCuda halves(context, 1024, 8, 16, 4);
  halves.set_persistent_batch_parts(2);
  EXPECT_TRUE(halves.persistent_refusal().empty()) << halves.persistent_refusal();
  EXPECT_TRUE(halves.persistent_backward_refusal().empty()) << halves.persistent_backward_refusal();
}

TEST(E29aGpu, RejectsBadShapes) {
  REQUIRE_GPU();
  core::DeviceContext context(core::Device::cuda());
  EXPECT_THROW(e29a::LayerCuda(context, 64, 65, 1, 1), core::Error);
  EXPECT_THROW(e29a::LayerCuda(context, 64, 0, 1, 1), core::Error);
  EXPECT_THROW(e29a::LayerCuda(context, 0, 8, 1, 1), core::Error);
  e29a::LayerCuda cuda(context, 64, 8, 2, 4);
  auto acts = cuda.make_activations();
  EXPECT_THROW(cuda.forward({}, nullptr, 3, 4, nullptr, acts), core::Error);
  EXPECT_THROW(cuda.forward({}, nullptr, 2, 5, nullptr, acts), core::Error);
}

}  // namespace
