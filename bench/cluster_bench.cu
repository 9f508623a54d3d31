// What thread-block clusters cost on this GPU, for a decode megakernel whose dependent steps run
// inside clusters and only a few hand-offs per layer cross the whole grid:
//  - how many clusters of C blocks (one block per SM, the megakernel's shared memory) can be
//    co-resident, by the occupancy query and by a cooperative cluster launch;
//  - a cluster barrier alone, and an all-gather of n floats through distributed shared memory
//    (every block writes its slice into every block's shared memory, then the cluster barrier);
//  - a grid hand-off of K partial vectors (every block writes its rows of its cluster's partial,
//    release-adds one counter; every block acquires it and sums the K partials);
//  - a layer's skeleton: grid hand-off, cluster all-gather of the q/k/v rows, a broadcast of one
//    head group's attention output, grid hand-off, cluster all-gather of the activation slice;
//  - slot sums (E29a's attention over N slots with a sequence spread over a cluster): every block
//    sends its n partial sums to every block, each sums the cluster's in rank order; once with a
//    cluster barrier, once with a flag a sender stores (release) into each receiver's shared
//    memory and the receiver waits for (acquire, with a deadline), so no cluster barrier; once with
//    st.async, each value stored into the receiver's shared memory completing 4 bytes of the
//    transaction count of the receiver's mbarrier, which the receiver arms and waits for (a
//    deadline too): one-way signalling with the data, no barrier and no flag.
// Every step depends on the one before (the values carry the previous sum), rounds form a chain,
// and every block checks the exact expected sum every round.
// usage: cluster_bench [rounds] [shared KB per block]
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <cstdlib>

#include "bench/event_timer.h"
#include "core/async_copy.cuh"
#include "core/error.h"
#include "core/memory_order.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 256;
constexpr int kMaxVec = 2048;  // floats of one exchanged vector, at most

enum Mode {
  barrier_only = 0,
  allgather = 1,
  grid_partials = 2,
  skeleton = 3,
  sums_barrier = 4,
  sums_flags = 5,
  sums_async = 6
};
const char* kModeNames[] = {"cluster barrier",
                            "cluster all-gather",
                            "grid hand-off of K partials",
                            "layer skeleton (2 grid + 3 cluster)",
                            "slot sums, cluster barrier",
                            "slot sums, flags",
                            "slot sums, st.async + mbarrier"};
constexpr int kModes = 7;
constexpr int kMaxCluster = 16;
constexpr int kMaxSlots = 64;

struct Args {
  int rounds = 0, n = 0, hidden = 0;
  float* partials = nullptr;  // [2][clusters][hidden]
  std::uint32_t* counter = nullptr;
  int* errors = nullptr;
};

__device__ float block_sum(float v, float* red) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float s = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) s += red[w];
  return s;
}

// Every block writes `value` into its slice of an n-float vector in every block of the cluster
// (buffer `buf`), the cluster meets, each block sums its copy.
__device__ float cluster_allgather(cg::cluster_group& cluster, float* buf, int n, float value, float* red) {
  const int c = static_cast<int>(cluster.num_blocks()), r = static_cast<int>(cluster.block_rank());
  const int lo = n * r / c, hi = n * (r + 1) / c, len = hi - lo;
  // Thread t writes element lo + t % len of block t / len (all blocks' copies in one pass).
  for (int i = threadIdx.x; i < len * c; i += kThreads) {
    float* dst = cluster.map_shared_rank(buf, i / len);
    dst[lo + i % len] = value;
  }
  cluster.sync();
  float s = 0.0f;
  for (int j = threadIdx.x; j < n; j += kThreads) s += buf[j];
  return block_sum(s, red);
}

// Block 0 of the cluster writes n floats into every block's buffer, the cluster meets.
__device__ float cluster_broadcast(cg::cluster_group& cluster, float* buf, int n, float value, float* red) {
  const int c = static_cast<int>(cluster.num_blocks());
  if (cluster.block_rank() == 0)
    for (int i = threadIdx.x; i < n * c; i += kThreads) cluster.map_shared_rank(buf, i / n)[i % n] = value;
  cluster.sync();
  float s = 0.0f;
  for (int j = threadIdx.x; j < n; j += kThreads) s += buf[j];
  return block_sum(s, red);
}

// Every block writes its rows of its cluster's partial vector, one release-add; every block
// acquires the counter and sums all partials.
__device__ float grid_handoff(const Args& a, int round2, float value, float* red) {
  const int blocks = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
  cg::cluster_group cluster = cg::this_cluster();
  const int c = static_cast<int>(cluster.num_blocks()), r = static_cast<int>(cluster.block_rank());
  const int clusters = blocks / c, k = b / c;
  float* part = a.partials + static_cast<std::int64_t>(round2 & 1) * clusters * a.hidden;
  const int lo = a.hidden * r / c, hi = a.hidden * (r + 1) / c;
  for (int j = lo + static_cast<int>(threadIdx.x); j < hi; j += kThreads) part[k * a.hidden + j] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    core::red_add_release(a.counter, 1);
    const std::uint32_t want = static_cast<std::uint32_t>(blocks) * static_cast<std::uint32_t>(round2 + 1);
    while (core::ld_acquire_u32(a.counter) < want) {
    }
  }
  __syncthreads();
  float s = 0.0f;
  for (int j = threadIdx.x * 4; j < a.hidden; j += kThreads * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q = 0; q < clusters; ++q) {
      const float4 w = __ldcg(reinterpret_cast<const float4*>(part + q * a.hidden + j));
      acc.x += w.x;
      acc.y += w.y;
      acc.z += w.z;
      acc.w += w.w;
    }
    s += acc.x + acc.y + acc.z + acc.w;
  }
  return block_sum(s, red);
}

// Every block's n partial sums (each `value`) into slot [rank] of every block's buffer; then, after
// the cluster barrier or once every sender's flag has reached `round` + 1, thread j < n sums slot
// j over the ranks in rank order. Returns the block's total of the n sums. Flags: a sender's
// threads store the values, the block meets, thread 0 stores the flag into each receiver with
// release at cluster scope; a receiver's thread 0 acquires its own flags (a deadline of 1 s
// counts an error instead of hanging). Two buffers by round parity: a sender reaches round r + 2
// only after every receiver has sent round r + 1, that is after it has summed round r.
template <bool Flags>
__device__ float slot_sums(cg::cluster_group& cluster, float (&buf)[2][kMaxCluster][kMaxSlots], std::uint32_t* flags,
                           int round, int n, float value, float* red, int* errors) {
  const int c = static_cast<int>(cluster.num_blocks()), r = static_cast<int>(cluster.block_rank());
  float(*mine)[kMaxSlots] = buf[round & 1];
  for (int i = threadIdx.x; i < n * c; i += kThreads) cluster.map_shared_rank(&mine[r][0], i / n)[i % n] = value;
  if constexpr (Flags) {
    __syncthreads();
    if (threadIdx.x == 0) {
      const auto want = static_cast<std::uint32_t>(round + 1);
      for (int peer = 0; peer < c; ++peer) {
        std::uint32_t* remote = cluster.map_shared_rank(flags + r, peer);
        asm volatile("st.release.cluster.u32 [%0], %1;" ::"l"(remote), "r"(want) : "memory");
      }
      const std::uint64_t start = core::globaltimer();
      for (int peer = 0; peer < c; ++peer) {
        std::uint32_t seen = 0;
        do {
          asm volatile("ld.acquire.cluster.u32 %0, [%1];" : "=r"(seen) : "l"(flags + peer) : "memory");
        } while (seen < want && core::globaltimer() - start < 1000000000ull);
        if (seen < want) atomicAdd(errors, 1);
      }
    }
    __syncthreads();
  } else {
    cluster.sync();
  }
  float s = 0.0f;
  if (threadIdx.x < n) {
    for (int k = 0; k < c; ++k) s += mine[k][threadIdx.x];
  }
  return block_sum(s, red);
}

// The same exchange by st.async: every value goes into slot [rank] of each receiver's buffer and
// completes 4 bytes of the receiver's mbarrier of that parity; each block's thread 0 arms its own
// mbarrier for the n * c bytes of the round (a sender's bytes may land before, the count then goes
// below zero until the arming), every thread waits for the phase (acquire at cluster scope; a
// deadline of 1 s counts an error). Mbarrier p serves rounds p, p + 2, ...: phase parity (round / 2) & 1.
__device__ float slot_sums_async(cg::cluster_group& cluster, float (&buf)[2][kMaxCluster][kMaxSlots],
                                 std::uint64_t* bars, int round, int n, float value, float* red, int* errors) {
  const int c = static_cast<int>(cluster.num_blocks()), r = static_cast<int>(cluster.block_rank());
  float(*mine)[kMaxSlots] = buf[round & 1];
  std::uint64_t* bar = bars + (round & 1);
  if (threadIdx.x == 0) core::mbar_arrive_expect_tx(bar, static_cast<std::uint32_t>(n * c * 4));
  for (int i = threadIdx.x; i < n * c; i += kThreads)
    core::st_async_cluster(&mine[r][i % n], __float_as_uint(value), bar, static_cast<std::uint32_t>(i / n));
  const std::uint32_t parity = static_cast<std::uint32_t>(round >> 1) & 1u;
  const std::uint64_t start = core::globaltimer();
  for (;;) {
    if (core::mbar_test_cluster(bar, parity)) break;
    if (core::globaltimer() - start > 1000000000ull) {
      if (threadIdx.x == 0) atomicAdd(errors, 1);
      break;
    }
  }
  float s = 0.0f;
  if (threadIdx.x < n) {
    for (int k = 0; k < c; ++k) s += mine[k][threadIdx.x];
  }
  return block_sum(s, red);
}

template <int M>
__global__ void __launch_bounds__(kThreads, 1) exchange(Args a) {
  __shared__ float red[kThreads / 32];
  __shared__ __align__(16) float buf[2][kMaxVec];
  __shared__ float sums[2][kMaxCluster][kMaxSlots];
  __shared__ std::uint32_t flags[kMaxCluster];
  __shared__ std::uint64_t bars[2];
  cg::cluster_group cluster = cg::this_cluster();
  if constexpr (M == sums_flags) {
    if (threadIdx.x < kMaxCluster) flags[threadIdx.x] = 0;
    cluster.sync();  // every block's flags are zero before any peer stores one
  }
  if constexpr (M == sums_async) {
    if (threadIdx.x < 2) core::mbar_init(&bars[threadIdx.x], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    cluster.sync();  // every block's mbarriers exist before any peer completes bytes on them
  }
  const int clusters = static_cast<int>(gridDim.x / cluster.num_blocks());
  float sum = 0.0f;
  int grid_rounds = 0;
  for (int r = 0; r < a.rounds; ++r) {
    const float value = static_cast<float>(r % 7 + 1) + 0.0f * sum;
    float want = 0.0f;
    if constexpr (M == barrier_only) {
      cluster.sync();
      sum = value;
      want = value;
    } else if constexpr (M == allgather) {
      sum = cluster_allgather(cluster, buf[r & 1], a.n, value, red);
      want = value * static_cast<float>(a.n);
    } else if constexpr (M == grid_partials) {
      sum = grid_handoff(a, grid_rounds++, value, red);
      want = value * static_cast<float>(a.hidden) * static_cast<float>(clusters);
    } else if constexpr (M == skeleton) {
      // qkv rows of a kv head (n), attention output of its heads (n / 2), activation slice (n * 3 / 4).
      float s = grid_handoff(a, grid_rounds++, value, red);
      const float v1 = s / (static_cast<float>(a.hidden) * static_cast<float>(clusters));
      s = cluster_allgather(cluster, buf[0], a.n, v1, red);
      const float v2 = s / static_cast<float>(a.n);
      s = cluster_broadcast(cluster, buf[1], a.n / 2, v2, red);
      const float v3 = s / static_cast<float>(a.n / 2);
      s = grid_handoff(a, grid_rounds++, v3, red);
      const float v4 = s / (static_cast<float>(a.hidden) * static_cast<float>(clusters));
      sum = cluster_allgather(cluster, buf[0] + kMaxVec / 2, a.n * 3 / 4, v4, red);
      want = value * static_cast<float>(a.n * 3 / 4);
      cluster.sync();  // buf[0] is rewritten next round
    } else if constexpr (M == sums_async) {
      sum = slot_sums_async(cluster, sums, bars, r, a.n, value, red, a.errors);
      want = value * static_cast<float>(a.n) * static_cast<float>(cluster.num_blocks());
    } else {
      sum = slot_sums<M == sums_flags>(cluster, sums, flags, r, a.n, value, red, a.errors);
      want = value * static_cast<float>(a.n) * static_cast<float>(cluster.num_blocks());
    }
    if (threadIdx.x == 0 && sum != want) atomicAdd(a.errors, 1);
  }
  if constexpr (M == sums_flags || M == sums_async)
    cluster.sync();  // no block leaves while a peer may still store into it
}

using Kernel = void (*)(Args);
const Kernel kKernels[] = {exchange<barrier_only>, exchange<allgather>,  exchange<grid_partials>, exchange<skeleton>,
                           exchange<sums_barrier>, exchange<sums_flags>, exchange<sums_async>};

cudaLaunchConfig_t config_for(int blocks, int cluster, int smem, cudaLaunchAttribute* attrs, bool cooperative) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<std::size_t>(smem);
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeCooperative;
  attrs[1].val.cooperative = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = cooperative ? 2 : 1;
  return cfg;
}

// Microseconds per round, or a negative value when the launch was refused.
double run(int mode, int clusters, int cluster, int smem, const Args& base, int n, int* errors_out) {
  Args a = base;
  a.n = n;
  CUDA_CHECK(cudaMemset(a.counter, 0, 128));
  CUDA_CHECK(cudaMemset(a.errors, 0, 4));
  cudaLaunchAttribute attrs[2];
  cudaLaunchConfig_t cfg = config_for(clusters * cluster, cluster, smem, attrs, true);
  const float ms = bench::launch_ms([&] { return cudaLaunchKernelEx(&cfg, kKernels[mode], a); });
  if (ms < 0.0f) {
    std::printf("    a cooperative launch of %d clusters of %d was refused\n", clusters, cluster);
    return -1.0;
  }
  CUDA_CHECK(cudaMemcpy(errors_out, a.errors, 4, cudaMemcpyDeviceToHost));
  return 1000.0 * ms / a.rounds;
}

}  // namespace

int bench_main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 4000;
  const int smem_kb = argc > 2 ? std::atoi(argv[2]) : 200;
  if (rounds < 1 || smem_kb < 0 || smem_kb > 227) {
    std::fprintf(stderr, "usage: cluster_bench [rounds (default 4000)] [shared KB per block, 0-227 (default 200)]\n");
    return 2;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "cluster_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, dynamic shared memory %d KB a block, %d threads\n", prop.name,
              prop.multiProcessorCount, smem_kb, kThreads);
  const int smem = smem_kb * 1024;
  for (Kernel k : kKernels) {
    CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  const int cluster_sizes[] = {2, 4, 8, 12, 16};
  for (int c : cluster_sizes) {
    cudaLaunchAttribute attrs[2];
    for (int coop = 0; coop < 2; ++coop) {
      cudaLaunchConfig_t cfg = config_for(c * 8, c, smem, attrs, coop != 0);
      int clusters = -1;
      const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kKernels[0], &cfg);
      std::printf("cluster %2d%s: max active clusters %d (%s)\n", c, coop ? " cooperative" : "            ",
                  e == cudaSuccess ? clusters : -1, cudaGetErrorString(e));
      if (e != cudaSuccess) (void)cudaGetLastError();
    }
  }

  Args base;
  base.rounds = rounds;
  base.hidden = 1024;
  CUDA_CHECK(cudaMalloc(&base.partials, sizeof(float) * 2 * 32 * 4096));
  CUDA_CHECK(cudaMalloc(&base.counter, 128));
  CUDA_CHECK(cudaMalloc(&base.errors, 4));
  struct Shape {
    int clusters, cluster;
  };
  const Shape shapes[] = {{8, 16}, {16, 8}, {7, 16}, {32, 4}, {15, 8}, {30, 4}, {64, 2}};
  for (const Shape s : shapes) {
    std::printf("%d clusters of %d (%d blocks):\n", s.clusters, s.cluster, s.clusters * s.cluster);
    for (int mode = 0; mode < kModes; ++mode) {
      if (s.cluster > kMaxCluster) continue;
      const int sizes_allgather[] = {256, 512, 1024, 2048};
      const int sizes_slots[] = {8, 16, 64};
      const bool slots = mode == sums_barrier || mode == sums_flags || mode == sums_async;
      const int* sizes = mode == allgather ? sizes_allgather : slots ? sizes_slots : nullptr;
      const int nsizes = mode == allgather ? 4 : slots ? 3 : 1;
      for (int i = 0; i < nsizes; ++i) {
        const int n = sizes ? sizes[i] : 512;
        int errors = 0;
        run(mode, s.clusters, s.cluster, smem, base, n, &errors);  // warm-up
        double best = 1e30, times[3];
        for (double& t : times) {
          t = run(mode, s.clusters, s.cluster, smem, base, n, &errors);
          if (t < best) best = t;
        }
        if (best < 0) break;
        std::printf("  %-38s n %5d: %.3f us a round (runs %.3f %.3f %.3f), errors %d\n", kModeNames[mode], n, best,
                    times[0], times[1], times[2], errors);
      }
    }
  }
  CUDA_CHECK(cudaFree(base.partials));
  CUDA_CHECK(cudaFree(base.counter));
  CUDA_CHECK(cudaFree(base.errors));
  return 0;
}

int main(int argc, char** argv) {
  try {
    return bench_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", "cluster_bench", e.what());
    return 1;
  }
}
