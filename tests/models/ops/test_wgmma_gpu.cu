// Hopper's wgmma primitives (models/ops/wgmma.cuh) against a CPU product: the swizzled layout is a
// permutation of each 1024-byte atom, and one warpgroup's D[64, N] = A[64, K] B[N, K]^T over k16
// steps through descriptors (N 64 and 128, K 64 and 128: one and two 64-column tiles; A from shared
// memory or from registers; B also MN-major, as a row-major [K, N] lies) equals the fp64 product of the same bf16
// values within fp32 accumulation error, for fresh random inputs, also when a second product accumulates onto the
// first. Skips off Hopper or without sm_90a code.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/half.h"
#include "models/ops/wgmma.cuh"
#include "support/test_support.h"

namespace {

namespace gpu = models::ops::gpu;

__global__ void wgmma_probe(int* compiled) {
#ifdef LLMTRAIN_WGMMA
  *compiled = 1;
#else
  *compiled = 0;
#endif
}

// Copies rows x 64 bf16 (row-major, `stride` elements a row, starting at column `column0`) into a
// swizzled tile, 16 bytes a thread at a time.
__device__ void load_tile(const std::uint16_t* src, int rows, int stride, int column0, std::uint8_t* tile) {
  for (int chunk = threadIdx.x; chunk < rows * 8; chunk += blockDim.x) {
    const int row = chunk / 8, q = chunk % 8;
    const uint4 v = *reinterpret_cast<const uint4*>(src + row * stride + column0 + q * 8);
    *reinterpret_cast<uint4*>(tile + gpu::swizzled_offset(row, q * 8)) = v;
  }
}

// This thread's A fragment of the k16 step at column k0 (wgmma_rs's layout), from row-major a.
__device__ void load_fragment(const std::uint16_t* a, int stride, int k0, std::uint32_t (&frag)[4]) {
  const int lane = threadIdx.x % 32;
  const int r = 16 * (threadIdx.x / 32) + lane / 4, c = k0 + 2 * (lane % 4);
  const auto pair = [&](int row, int column) {
    return static_cast<std::uint32_t>(a[row * stride + column]) |
           (static_cast<std::uint32_t>(a[row * stride + column + 1]) << 16);
  };
  frag[0] = pair(r, c);
  frag[1] = pair(r + 8, c);
  frag[2] = pair(r, c + 8);
  frag[3] = pair(r + 8, c + 8);
}

// Writes a warpgroup's accumulators D[64, N] row-major to c.
template <int N>
__device__ void store_accumulators(const float (&d)[N / 2], float* c) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int col = 0; col < 2; ++col) {
        const int row = 16 * warp + lane / 4 + 8 * i, column = 8 * j + 2 * (lane % 4) + col;
        c[row * N + column] = d[4 * j + 2 * i + col];
      }
    }
  }
}

// c[64, N] = a[64, K] b[N, K]^T (+ the same again when `twice`), one warpgroup; K a multiple of 64;
// A through shared memory, or from registers when `FromRegisters`.
template <int N, bool FromRegisters>
__global__ void __launch_bounds__(128)
    product_kernel(const std::uint16_t* a, const std::uint16_t* b, int k_total, bool twice, float* c) {
  __shared__ __align__(1024) std::uint8_t tile_a[64 * 128];
  __shared__ __align__(1024) std::uint8_t tile_b[N * 128];
  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
  const std::uint64_t desc_a =
      gpu::swizzled_tile_descriptor(static_cast<std::uint32_t>(__cvta_generic_to_shared(tile_a)));
  const std::uint64_t desc_b =
      gpu::swizzled_tile_descriptor(static_cast<std::uint32_t>(__cvta_generic_to_shared(tile_b)));
  bool accumulate = false;
  for (int pass = 0; pass < (twice ? 2 : 1); ++pass) {
    for (int k0 = 0; k0 < k_total; k0 += 64) {
      __syncthreads();  // the previous tiles' products have been waited for
      load_tile(a, 64, k_total, k0, tile_a);
      load_tile(b, N, k_total, k0, tile_b);
      gpu::fence_shared_for_wgmma();
      __syncthreads();
      std::uint32_t frags[4][4];
      if constexpr (FromRegisters) {
#pragma unroll
        for (int k = 0; k < 4; ++k) load_fragment(a, k_total, k0 + 16 * k, frags[k]);
      }
      gpu::wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if constexpr (FromRegisters) {
          gpu::wgmma_rs<N>(d, frags[k], gpu::descriptor_at_k(desc_b, k), accumulate);
        } else {
          gpu::wgmma_ss<N>(d, gpu::descriptor_at_k(desc_a, k), gpu::descriptor_at_k(desc_b, k), accumulate);
        }
        accumulate = true;
      }
      gpu::wgmma_commit();
      gpu::wgmma_wait<0>();
    }
  }
  store_accumulators<N>(d, c);
}

// c[64, N] = a[64, K] b[K, N] with b row-major (B MN-major in shared memory, wgmma_rs_mn), A from
// registers, one warpgroup; K a multiple of 64.
template <int N>
__global__ void __launch_bounds__(128)
    product_mn_kernel(const std::uint16_t* a, const std::uint16_t* b, int k_total, float* c) {
  __shared__ __align__(1024) std::uint8_t tile_b[64 * N * 2];
  constexpr std::uint32_t kColumnTileBytes = 64 * 128;  // 64 rows (k) of one 64-column tile
  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
  const auto base = static_cast<std::uint32_t>(__cvta_generic_to_shared(tile_b));
  for (int k0 = 0; k0 < k_total; k0 += 64) {
    __syncthreads();
    for (int t = 0; t < N / 64; ++t) load_tile(b + k0 * N, 64, N, 64 * t, tile_b + t * kColumnTileBytes);
    gpu::fence_shared_for_wgmma();
    __syncthreads();
    std::uint32_t frags[4][4];
#pragma unroll
    for (int k = 0; k < 4; ++k) load_fragment(a, k_total, k0 + 16 * k, frags[k]);
    gpu::wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      gpu::wgmma_rs_mn<N>(d, frags[k], gpu::swizzled_mn_major_descriptor(base + 2048 * k, kColumnTileBytes), true);
    }
    gpu::wgmma_commit();
    gpu::wgmma_wait<0>();
    gpu::keep_in_registers(d);
  }
  store_accumulators<N>(d, c);
}

bool built_for_wgmma() {
  core::Buffer flag(core::Device::cuda(), sizeof(int));
  wgmma_probe<<<1, 1>>>(flag.as<int>());
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
  return test::to_host<int>(flag)[0] == 1;
}

std::vector<std::uint16_t> random_bf16_bits(std::mt19937_64& rng, std::size_t n) {
  const std::vector<float> values = test::random_normal(rng, n);
  std::vector<std::uint16_t> bits(n);
  for (std::size_t i = 0; i < n; ++i) bits[i] = core::float_to_bf16(values[i]);
  return bits;
}

// |c - reference| within fp32 accumulation error of every element; reference(row, column) returns
// {sum, sum of magnitudes} in double. fp32 accumulation (the tensor cores may align the addends with
// fewer guard bits than an FMA chain): 5e-5 of the sum of magnitudes, about 800 fp32 ulps; a wrong
// layout is off by O(1).
template <typename Reference>
void expect_product(const std::vector<float>& c, int n, Reference reference) {
  std::size_t bad = 0;
  for (int row = 0; row < 64; ++row) {
    for (int column = 0; column < n; ++column) {
      const auto [sum, magnitude] = reference(row, column);
      const double err = std::fabs(c[row * n + column] - sum);
      if (!(err <= 5e-5 * magnitude + 1e-6) && bad++ < 5) {
        ADD_FAILURE() << "D[" << row << ", " << column << "] = " << c[row * n + column] << ", expected " << sum;
      }
    }
  }
  EXPECT_EQ(bad, 0u);
}

// c[64, n] from a kernel launched with (a, b, c) on the device, a and b copied there.
template <typename Launch>
std::vector<float> device_product(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& b, int n,
                                  Launch launch) {
  core::Buffer a_d(core::Device::cuda(), a.size() * 2), b_d(core::Device::cuda(), b.size() * 2);
  core::Buffer c_d(core::Device::cuda(), static_cast<std::size_t>(64 * n) * sizeof(float));
  test::from_host(a_d, a);
  test::from_host(b_d, b);
  launch(a_d.as<std::uint16_t>(), b_d.as<std::uint16_t>(), c_d.as<float>());
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
  return test::to_host<float>(c_d);
}

// {sum, sum of magnitudes} of a[row, :] . b[:, column] in double, b's element k of column `column`
// at b[b_at(k, column)].
template <typename BAt>
std::pair<double, double> reference_dot(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& b,
                                        int k_total, int row, int column, BAt b_at) {
  double sum = 0.0, magnitude = 0.0;
  for (int k = 0; k < k_total; ++k) {
    const double term = double(core::bf16_to_float(a[row * k_total + k])) * core::bf16_to_float(b[b_at(k, column)]);
    sum += term;
    magnitude += std::fabs(term);
  }
  return {sum, magnitude};
}

template <int N>
void check_product_mn(std::mt19937_64& rng, int k_total) {
  SCOPED_TRACE("N " + std::to_string(N) + " K " + std::to_string(k_total) + " B MN-major");
  const auto a = random_bf16_bits(rng, static_cast<std::size_t>(64 * k_total));
  const auto b = random_bf16_bits(rng, static_cast<std::size_t>(N * k_total));
  const auto c = device_product(a, b, N, [&](const std::uint16_t* a_d, const std::uint16_t* b_d, float* c_d) {
    product_mn_kernel<N><<<1, 128>>>(a_d, b_d, k_total, c_d);
  });
  expect_product(c, N, [&](int row, int column) {
    return reference_dot(a, b, k_total, row, column, [](int k, int n) { return k * N + n; });
  });
}

template <int N, bool FromRegisters = false>
void check_product(std::mt19937_64& rng, int k_total, bool twice) {
  SCOPED_TRACE("N " + std::to_string(N) + " K " + std::to_string(k_total) + (twice ? " twice" : "") +
               (FromRegisters ? " A from registers" : ""));
  const auto a = random_bf16_bits(rng, static_cast<std::size_t>(64 * k_total));
  const auto b = random_bf16_bits(rng, static_cast<std::size_t>(N * k_total));
  const auto c = device_product(a, b, N, [&](const std::uint16_t* a_d, const std::uint16_t* b_d, float* c_d) {
    product_kernel<N, FromRegisters><<<1, 128>>>(a_d, b_d, k_total, twice, c_d);
  });
  expect_product(c, N, [&](int row, int column) {
    auto [sum, magnitude] = reference_dot(a, b, k_total, row, column, [&](int k, int n) { return n * k_total + k; });
    if (twice) {
      sum *= 2;
      magnitude *= 2;
    }
    return std::pair{sum, magnitude};
  });
}

TEST(WgmmaGpu, SwizzledLayoutPermutesEachAtom) {
  std::set<std::uint32_t> offsets;
  for (std::uint32_t row = 0; row < 8; ++row) {
    for (std::uint32_t column = 0; column < 64; column += 8) offsets.insert(gpu::swizzled_offset(row, column));
  }
  EXPECT_EQ(offsets.size(), 64u);
  EXPECT_EQ(*offsets.rbegin(), 1024u - 16);
  EXPECT_EQ(gpu::swizzled_offset(9, 3), 1024u + 128 + (1u << 4) + 6);  // row 9: chunk 0 ^ 1, byte 6
  const std::uint64_t desc = gpu::swizzled_tile_descriptor(0x2400);
  EXPECT_EQ(desc & 0x3FFF, 0x240u);
  EXPECT_EQ((desc >> 32) & 0x3FFF, 64u);
  EXPECT_EQ(desc >> 62, 1u);
  EXPECT_EQ(gpu::descriptor_at_k(desc, 3) & 0x3FFF, 0x240u + 6);
}

TEST(WgmmaGpu, WarpgroupProductMatchesReference) {
  REQUIRE_GPU();
  int major = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major != 9) GTEST_SKIP() << "SKIPPED: wgmma needs a Hopper GPU (compute capability 9.x), found " << major;
  if (!built_for_wgmma()) GTEST_SKIP() << "SKIPPED: this build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES)";
  std::mt19937_64 rng(test::fresh_seed());
  check_product<64>(rng, 64, false);
  check_product<128>(rng, 64, false);
  check_product<64>(rng, 128, false);
  check_product<128>(rng, 128, true);
  check_product<64, true>(rng, 64, false);
  check_product<128, true>(rng, 128, true);
  check_product_mn<64>(rng, 64);
  check_product_mn<128>(rng, 128);
  check_product_mn<128>(rng, 192);
}

}  // namespace
