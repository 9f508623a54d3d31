// Seeded initialisation (optim/initialize.h): the values depend on the seed, tensor and element
// alone (a rank's shard equals the same range of the whole model, for several world sizes), each
// kind has its distribution (normal std, xavier bound, orthogonal Q Q^T = gain^2 I, zeros, ones),
// and the cuda kernel draws what the host loop draws (bit for bit for the uniform-based kinds;
// normal within a few fp32 ulp, device logf/cosf against the host's).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "optim/initialize.h"
#include "support/test_support.h"

namespace {

std::vector<optim::ParamSpec> mixed_specs() {
  using optim::InitKind;
  return {
      {.name = "embed", .shape = {37, 29}, .init = InitKind::normal, .init_std = 0.02f},
      {.name = "norm", .shape = {29}, .decay = false, .init = InitKind::ones},
      {.name = "wide", .shape = {13, 41}, .init = InitKind::xavier_uniform, .init_gain = 1.5f},
      {.name = "recurrent", .shape = {23, 23}, .init = InitKind::orthogonal, .init_gain = 0.9f},
      {.name = "tall", .shape = {31, 7}, .init = InitKind::orthogonal},
      {.name = "bias", .shape = {23}, .decay = false, .init = InitKind::zeros},
      {.name = "big", .shape = {301, 257}, .init = InitKind::normal, .init_std = 1.0f},
  };
}

// The whole model's master weights laid out for `world` ranks, initialised rank by rank and
// concatenated in global order (padding excluded by comparing tensor by tensor).
std::vector<float> initialized(core::Device device, int world, std::uint64_t seed) {
  const optim::SlabLayout layout(mixed_specs(), world);
  std::vector<float> whole(static_cast<std::size_t>(layout.total_elements()), -7.0f);
  for (int rank = 0; rank < world; ++rank) {
    core::DeviceContext context(device);
    optim::Slab slab(layout, context, {.rank = rank, .zero_stage = world > 1 ? 1 : 0});
    optim::initialize_owned(slab, context, seed);
    const std::vector<float> owned = test::to_host<float>(slab.master());
    std::copy(owned.begin(), owned.end(), whole.begin() + slab.owned().begin);
  }
  return whole;
}

std::vector<float> tensor_values(const std::vector<float>& whole, int world, const char* name) {
  const optim::SlabLayout layout(mixed_specs(), world);
  const optim::SlabTensor& t = layout.tensor(name);
  return {whole.begin() + t.offset, whole.begin() + t.offset + t.numel};
}

TEST(Initialize, ShardsEqualTheWholeModelForEveryWorldSize) {
  const std::uint64_t seed = test::fresh_seed();
  const std::vector<float> one = initialized(core::Device::cpu(), 1, seed);
  for (int world : {2, 3, 5}) {
    const std::vector<float> sharded = initialized(core::Device::cpu(), world, seed);
    for (const optim::ParamSpec& spec : mixed_specs()) {
      EXPECT_EQ(tensor_values(one, 1, spec.name.c_str()), tensor_values(sharded, world, spec.name.c_str()))
          << spec.name << " at world " << world;
    }
  }
  EXPECT_NE(tensor_values(one, 1, "embed"), tensor_values(initialized(core::Device::cpu(), 1, seed + 1), 1, "embed"));
}

TEST(Initialize, EachKindHasItsDistribution) {
  const std::vector<float> all = initialized(core::Device::cpu(), 1, test::fresh_seed());
  const auto big = tensor_values(all, 1, "big");
  double sum = 0, sq = 0;
  for (float v : big) sum += v, sq += static_cast<double>(v) * v;
  const double n = static_cast<double>(big.size());
  EXPECT_NEAR(sum / n, 0.0, 5.0 / std::sqrt(n));
  EXPECT_NEAR(std::sqrt(sq / n), 1.0, 0.01);
  for (float v : tensor_values(all, 1, "norm")) EXPECT_EQ(v, 1.0f);
  for (float v : tensor_values(all, 1, "bias")) EXPECT_EQ(v, 0.0f);
  const float bound = 1.5f * std::sqrt(6.0f / (13 + 41));
  float largest = 0;
  for (float v : tensor_values(all, 1, "wide")) largest = std::max(largest, std::fabs(v));
  EXPECT_LE(largest, bound);
  EXPECT_GT(largest, 0.8f * bound);
  // Orthogonal: the fewer of rows/columns are orthonormal, times the gain.
  auto check_orthogonal = [&](const char* name, int rows, int cols, double gain) {
    const auto w = tensor_values(all, 1, name);
    const bool by_rows = rows <= cols;
    const int k = by_rows ? rows : cols, len = by_rows ? cols : rows;
    auto at = [&](int vec, int i) { return static_cast<double>(by_rows ? w[vec * cols + i] : w[i * cols + vec]); };
    for (int a = 0; a < k; ++a) {
      for (int b = 0; b < k; ++b) {
        double dot = 0;
        for (int i = 0; i < len; ++i) dot += at(a, i) * at(b, i);
        EXPECT_NEAR(dot, a == b ? gain * gain : 0.0, 1e-5) << name << " " << a << "," << b;
      }
    }
  };
  check_orthogonal("recurrent", 23, 23, 0.9);
  check_orthogonal("tall", 31, 7, 1.0);
}

TEST(InitializeGpu, DeviceDrawsWhatTheHostDraws) {
  REQUIRE_GPU();
  const std::uint64_t seed = test::fresh_seed();
  const std::vector<float> host = initialized(core::Device::cpu(), 1, seed);
  for (int world : {1, 3}) {
    const std::vector<float> device = initialized(core::Device::cuda(0), world, seed);
    for (const optim::ParamSpec& spec : mixed_specs()) {
      const auto h = tensor_values(host, 1, spec.name.c_str()), d = tensor_values(device, world, spec.name.c_str());
      if (spec.init != optim::InitKind::normal) {
        EXPECT_EQ(h, d) << spec.name << " at world " << world;
        continue;
      }
      for (std::size_t i = 0; i < h.size(); ++i) {
        // Box-Muller through logf and cosf: device and host agree to a few ulp of the result.
        ASSERT_NEAR(d[i], h[i], 8 * std::numeric_limits<float>::epsilon() * std::max(std::fabs(h[i]), spec.init_std))
            << spec.name << "[" << i << "] at world " << world;
      }
    }
  }
}

}  // namespace
