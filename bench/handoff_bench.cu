// Hand-off latency between the blocks of a persistent grid: the floor under each dependent phase
// of the decode megakernel. Every block owns a slice of an n-element vector; in each round every
// block writes its slice, signals, waits until the whole vector of the round is visible, reads it
// all and sums it; the next round's values depend on that sum, so rounds form a chain and
// (total time / rounds) is one phase's hand-off with no weight work. Methods:
//   tagged      64-bit words (fp32 value, round tag), spin per word until the tag is this round's
//   tagged+hint the same, one thread first polls a relaxed counter (the megakernel's default)
//   f32         fp32 words; writers barrier, one thread fence + add; readers acquire the counter,
//               barrier, then read through L2 (ld.global.cg)
//   bf16        the same with bf16 words (half the bytes)
//   f32-flags   fp32 words; one release flag per writing block, readers acquire all flags in parallel
// Each result is checked (every block sums the exact expected value every round).
// usage: handoff_bench [rounds] [sizes...]; with E29a's state sizes (B * D, e.g. 16384 65536) a
// round is the floor of one recurrent step on a persistent grid (read the state, write a slice,
// synchronise).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "bench/event_timer.h"
#include "core/error.h"
#include "core/memory_order.cuh"

namespace {

enum Method { tagged = 0, tagged_hint = 1, f32 = 2, bf16 = 3, f32_flags = 4, kMethods = 5 };
const char* kNames[] = {"tagged", "tagged+hint", "f32", "bf16", "f32-flags"};

constexpr int kThreads = 256;
constexpr int kLineWords = 32;  // counters and flags one per 128-byte line

struct Args {
  int n = 0, rounds = 0;
  std::uint64_t* tagged = nullptr;  // [2][n]
  float* f32 = nullptr;             // [2][n]
  std::uint16_t* b16 = nullptr;     // [2][n]
  std::uint32_t* counter = nullptr;
  std::uint32_t* flags = nullptr;  // [blocks][kLineWords]
  int* errors = nullptr;
};

using core::ld_acquire_u32;
using core::ld_relaxed_u32;
using core::ld_relaxed_u64;
using core::red_add_relaxed;
using core::red_add_release;
using core::st_relaxed_u64;
using core::st_release_u32;

__device__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) s += red[w];
  __syncthreads();
  return s;
}

template <int M>
__global__ void __launch_bounds__(kThreads, 1) handoff(Args a) {
  __shared__ float red[kThreads / 32];
  const int blocks = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x), tid = static_cast<int>(threadIdx.x);
  const int lo = static_cast<int>(static_cast<std::int64_t>(a.n) * b / blocks);
  const int hi = static_cast<int>(static_cast<std::int64_t>(a.n) * (b + 1) / blocks);
  float sum = 0.0f;
  for (int r = 0; r < a.rounds; ++r) {
    const int parity = r & 1;
    const std::uint32_t tag = static_cast<std::uint32_t>(r + 1);
    // The round's value depends on the previous round's sum (0 * sum keeps the chain).
    const float value = static_cast<float>(r % 7 + 1) + 0.0f * sum;
    // Write this block's slice, then signal.
    for (int j = lo + tid; j < hi; j += kThreads) {
      if constexpr (M == tagged || M == tagged_hint) {
        st_relaxed_u64(a.tagged + parity * a.n + j, (static_cast<std::uint64_t>(tag) << 32) | __float_as_uint(value));
      } else if constexpr (M == bf16) {
        a.b16[parity * a.n + j] = __bfloat16_as_ushort(__float2bfloat16_rn(value));
      } else {
        a.f32[parity * a.n + j] = value;
      }
    }
    __syncthreads();
    if (tid == 0) {
      if constexpr (M == tagged_hint) red_add_relaxed(a.counter, 1);
      if constexpr (M == f32 || M == bf16) red_add_release(a.counter, 1);
      if constexpr (M == f32_flags) st_release_u32(a.flags + b * kLineWords, tag);
    }
    // Wait for the round, then read the whole vector.
    const std::uint32_t want = static_cast<std::uint32_t>(blocks) * tag;
    if constexpr (M == tagged_hint) {
      if (tid == 0)
        while (ld_relaxed_u32(a.counter) < want) {
        }
      __syncthreads();
    } else if constexpr (M == f32 || M == bf16) {
      if (tid == 0)
        while (ld_acquire_u32(a.counter) < want) {
        }
      __syncthreads();
    } else if constexpr (M == f32_flags) {
      for (int i = tid; i < blocks; i += kThreads)
        while (ld_acquire_u32(a.flags + i * kLineWords) < tag) {
        }
      __syncthreads();
    }
    float s = 0.0f;
    if constexpr (M == tagged || M == tagged_hint) {
      constexpr int kBatch = 8;
      const std::uint64_t* src = a.tagged + parity * a.n;
      for (int j0 = tid; j0 < a.n; j0 += kBatch * kThreads) {
        std::uint64_t v[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) v[i] = j0 + i * kThreads < a.n ? ld_relaxed_u64(src + j0 + i * kThreads) : 0;
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const int j = j0 + i * kThreads;
          if (j >= a.n) continue;
          while (static_cast<std::uint32_t>(v[i] >> 32) != tag) v[i] = ld_relaxed_u64(src + j);
          s += __uint_as_float(static_cast<std::uint32_t>(v[i]));
        }
      }
    } else if constexpr (M == bf16) {
      const uint4* src = reinterpret_cast<const uint4*>(a.b16 + parity * a.n);
      for (int c = tid; c < a.n / 8; c += kThreads) {
        const uint4 w = __ldcg(src + c);
        s += __uint_as_float(w.x << 16) + __uint_as_float(w.x & 0xffff0000u) + __uint_as_float(w.y << 16) +
             __uint_as_float(w.y & 0xffff0000u) + __uint_as_float(w.z << 16) + __uint_as_float(w.z & 0xffff0000u) +
             __uint_as_float(w.w << 16) + __uint_as_float(w.w & 0xffff0000u);
      }
    } else {
      const float4* src = reinterpret_cast<const float4*>(a.f32 + parity * a.n);
      for (int c = tid; c < a.n / 4; c += kThreads) {
        const float4 w = __ldcg(src + c);
        s += w.x + w.y + w.z + w.w;
      }
    }
    sum = block_sum(s, red);
    if (tid == 0 && sum != static_cast<float>(a.n) * value) atomicAdd(a.errors, 1);
  }
}

template <int M>
double time_method(const Args& base, int blocks, int n, int rounds) {
  Args a = base;
  a.n = n;
  a.rounds = rounds;
  CUDA_CHECK(cudaMemset(a.counter, 0, 4 * kLineWords));
  CUDA_CHECK(cudaMemset(a.flags, 0, 4 * kLineWords * static_cast<std::size_t>(blocks)));
  CUDA_CHECK(cudaMemset(a.tagged, 0, 16 * static_cast<std::size_t>(n)));
  void* args[] = {&a};
  const float ms = bench::launch_ms([&] {
    return cudaLaunchCooperativeKernel(reinterpret_cast<void*>(handoff<M>), blocks, kThreads, args, 0, nullptr);
  });
  if (ms < 0.0f)
    throw core::Error("handoff_bench: the cooperative launch of " + std::to_string(blocks) + " blocks failed");
  return 1000.0 * ms / rounds;
}

using TimeFn = double (*)(const Args&, int, int, int);
const TimeFn kTimers[] = {time_method<tagged>, time_method<tagged_hint>, time_method<f32>, time_method<bf16>,
                          time_method<f32_flags>};

}  // namespace

int bench_main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 4000;
  if (rounds < 1) {
    std::fprintf(stderr, "usage: handoff_bench [rounds (default 4000)] [vector sizes, multiples of 8]\n");
    return 2;
  }
  // Vector sizes: the megakernel's activations by default; E29a's recurrent state [B, D] (every
  // block reads all of it each step, writes its slice and synchronises) is B * D, e.g. 16384 65536.
  std::vector<int> sizes = {256, 1024, 2048, 3072, 8192};
  if (argc > 2) sizes.clear();
  for (int i = 2; i < argc; ++i) {
    const int n = std::atoi(argv[i]);
    if (n <= 0 || n % 8 != 0) {
      std::fprintf(stderr, "handoff_bench: size '%s' must be a positive multiple of 8\n", argv[i]);
      return 2;
    }
    sizes.push_back(n);
  }
  const int max_n = *std::max_element(sizes.begin(), sizes.end());
  int device = 0, sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  Args a;
  CUDA_CHECK(cudaMalloc(&a.tagged, 16 * static_cast<std::size_t>(max_n)));
  CUDA_CHECK(cudaMalloc(&a.f32, 8 * static_cast<std::size_t>(max_n)));
  CUDA_CHECK(cudaMalloc(&a.b16, 4 * static_cast<std::size_t>(max_n)));
  CUDA_CHECK(cudaMalloc(&a.counter, 4 * kLineWords));
  CUDA_CHECK(cudaMalloc(&a.flags, 4 * kLineWords * static_cast<std::size_t>(sms)));
  CUDA_CHECK(cudaMalloc(&a.errors, 4));
  CUDA_CHECK(cudaMemset(a.errors, 0, 4));
  std::printf("%s, %d blocks x %d threads, %d rounds: microseconds per round (median of 5)\n", prop.name, sms, kThreads,
              rounds);
  std::printf("%-12s", "n");
  for (int n : sizes) std::printf(" %8d", n);
  std::printf("\n");
  for (int m = 0; m < kMethods; ++m) {
    std::printf("%-12s", kNames[m]);
    for (int n : sizes) {
      kTimers[m](a, sms, n, 200);  // warm-up
      std::vector<double> t;
      for (int i = 0; i < 5; ++i) t.push_back(kTimers[m](a, sms, n, rounds));
      std::sort(t.begin(), t.end());
      std::printf(" %8.3f", t[2]);
    }
    std::printf("\n");
  }
  int errors = 0;
  CUDA_CHECK(cudaMemcpy(&errors, a.errors, 4, cudaMemcpyDeviceToHost));
  std::printf("wrong sums: %d\n", errors);
  return errors == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  try {
    return bench_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", "handoff_bench", e.what());
    return 1;
  }
}
