// CUDA kernels of causal grouped-query attention, flash-style: the seq x seq score matrix never
// exists in memory. bf16 operands on the tensor cores (mma.sync m16n8k16 fed by ldmatrix from
// XOR-swizzled shared memory, tiles prefetched with cp.async while the previous one is used), fp32
// accumulation and fp32 softmax statistics; head dims 64 and 128; any seq (partial tiles are
// zero-filled on load and never stored).
//
// Forward: a block owns a tile of queries of one (batch, head); each warp owns 16 query rows per
// m-tile and runs the online softmax over key tiles up to the diagonal, turning the score
// accumulators into the A operand of the P V product without leaving registers.
//
// Backward, deterministic (each output element is summed by one thread in a fixed order; no
// atomics), two launches (the variants not named "fused" launch the two sides separately):
//   prepare: D = rowsum(dout * out) and lse * log2(e) per query row, into the workspace;
//   then one grid holding the key-side blocks followed by the query-side blocks (independent given
//   D and lse, so query blocks fill the key side's tail), launched on sm_90+ as a programmatic
//   dependent of prepare;
//   key side: a block owns a tile of keys of one kv head and loops over the query tiles of every q
//     head of its GQA group, accumulating dK and dV in registers. It computes transposed scores
//     S^T = K Q^T, so that P^T and dS^T come out in the A-operand layout of dV += P^T dO and
//     dK += dS^T Q. For head_dim 128 two warps share a set of keys: one makes P^T and dV, the other
//     dP^T, dS^T and dK, P^T passing between them through shared memory, which nearly halves the
//     shared-memory reads per tensor-core instruction;
//   query side: a block owns a tile of queries and accumulates dQ += dS K over key tiles up to the
//     diagonal (recomputing S and dP = dO V^T).
// Every kernel is a template over its tile shape; the variant tables at the end list the shapes
// compiled, in order of measured speed. On Hopper, in builds with sm_90a code, the same algorithm
// runs first on warpgroup products (attention_hopper.cuh); these mma.sync kernels serve every
// other GPU.
#include "models/ops/attention.h"

#include <cuda.h>  // CUtensorMap and its encoder's signature (the encoder comes through the runtime)
#include <cuda_bf16.h>

#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "core/async_copy.cuh"
#include "core/error.h"
#include "models/ops/mma_bf16.cuh"
#include "models/ops/op_checks.h"
#include "models/ops/wgmma.cuh"

namespace models::ops {
namespace {

using gpu::mma_bf16;
using gpu::pack_bf16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------------
// Device primitives

__device__ __forceinline__ std::uint32_t shared_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16-byte asynchronous global -> shared copy; writes zeros (and reads nothing) when !valid.
__device__ __forceinline__ void copy_16_async(std::uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_4_async(std::uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void wait_all_copies() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Named barriers for a subset of the block's warps (id 0 is __syncthreads'): `arrive` signals that
// this thread's earlier shared-memory writes are done, `sync` waits for `threads` arrivals.
__device__ __forceinline__ void barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void load_matrix_x4(std::uint32_t (&r)[4], std::uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void load_matrix_x4_transposed(std::uint32_t (&r)[4], std::uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Accumulator tiles c[2t], c[2t+1] (16 rows x 16 columns of one 16x16 block) as an A operand:
// the m16n8k16 C layout of two adjacent n-tiles is the A layout of one k-step.
__device__ __forceinline__ void accumulators_to_operand(std::uint32_t (&a)[4], const float (&left)[4],
                                                        const float (&right)[4]) {
  a[0] = pack_bf16(left[0], left[1]);
  a[1] = pack_bf16(left[2], left[3]);
  a[2] = pack_bf16(right[0], right[1]);
  a[3] = pack_bf16(right[2], right[3]);
}

// Byte offset of 8-element chunk `chunk` of row `row` in a [rows][kHeadDim] bf16 tile whose chunk
// index is XORed with the row's low three bits: the eight rows one ldmatrix phase reads fall in
// eight different bank groups, for plain and transposed loads alike.
template <int kHeadDim>
__device__ __forceinline__ std::uint32_t tile_offset(int row, int chunk) {
  return static_cast<std::uint32_t>(row * kHeadDim * 2 + ((chunk ^ (row & 7)) << 4));
}

// Per-lane ldmatrix addressing into a swizzled [rows][kHeadDim] tile for one operand shape. A lane
// points at row row0 + lane_row and chunk 2 * pair + lane_chunk; with row0 a multiple of 8, the
// swizzle turns that into a fixed row part plus one of four chunk parts (the XOR touches only the
// low three chunk bits), so every address is a per-lane base plus a compile-time immediate.
template <int kHeadDim>
struct SwizzledLane {
  static constexpr int kRowBytes = kHeadDim * 2;
  std::uint32_t row_part;
  std::uint32_t chunk_part[4];
  __device__ SwizzledLane(int lane_row, int lane_chunk) : row_part(static_cast<std::uint32_t>(lane_row * kRowBytes)) {
    const int x = lane_chunk ^ (lane_row & 7);
#pragma unroll
    for (int j = 0; j < 4; ++j) chunk_part[j] = static_cast<std::uint32_t>(((2 * j) ^ x) << 4);
  }
  __device__ std::uint32_t operator()(int row0, int pair) const {
    return static_cast<std::uint32_t>(row0 * kRowBytes) + row_part + (pair >> 2) * 128 + chunk_part[pair & 3];
  }
};

// The three operand shapes: A (16 rows x 16 k, tile rows are A rows); B for two n-tiles (tile rows
// are the n index, k contiguous); B for two n-tiles from a tile whose rows are the k index
// (transposed load).
template <int kHeadDim>
struct LaneOperands {
  SwizzledLane<kHeadDim> a, b, t;
  __device__ explicit LaneOperands(int lane)
      : a(lane & 15, lane >> 4),
        b((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1),
        t((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4) {}
};

// Starts copies of rows [first_row, first_row + kRows) of one head (row r at head + r * stride)
// into a swizzled tile; rows at or past `seq` are zero-filled without reading memory. Each thread
// copies one chunk column, a pass of kThreads / (kHeadDim / 8) rows at a time; the pass loop is
// kept rolled so that its per-pass addresses do not occupy registers for the whole kernel.
template <int kRows, int kHeadDim, int kThreads>
__device__ __forceinline__ void load_rows_async(std::uint32_t tile, const std::uint16_t* head, std::int64_t stride,
                                                int first_row, int seq) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kRowsPerPass = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRowsPerPass % 8 == 0 && kRows % kRowsPerPass == 0,
                "tile copy must split into whole passes that keep the swizzle phase");
  const int row = static_cast<int>(threadIdx.x) / kChunks, chunk = static_cast<int>(threadIdx.x) % kChunks;
  std::uint32_t dst = tile + tile_offset<kHeadDim>(row, chunk);
  const std::uint16_t* src = head + (first_row + row) * stride + chunk * 8;
  const std::int64_t pass_stride = kRowsPerPass * stride;
  int rows_left = seq - first_row - row;
#pragma unroll 1
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const bool valid = rows_left > 0;
    copy_16_async(dst, valid ? src : head, valid);
    dst += kRowsPerPass * kHeadDim * 2;
    src += pass_stride;
    rows_left -= kRowsPerPass;
  }
}

// Starts copies of values [first, first + kCount) of a per-row fp32 vector; past `seq`: zeros.
template <int kCount, int kThreads>
__device__ __forceinline__ void load_floats_async(std::uint32_t dst, const float* src, int first, int seq) {
  for (int i = static_cast<int>(threadIdx.x); i < kCount; i += kThreads) {
    const bool valid = first + i < seq;
    copy_4_async(dst + 4 * i, src + (valid ? first + i : 0), valid);
  }
}

// Writes the 16 x kHeadDim accumulator rows of one warp (already scaled) as bf16 through its own
// rows of a swizzled shared tile, then to global memory with 16-byte stores; rows past `seq` are
// skipped. `rows_global` points at tile row 0 in global memory, `stride` between tokens.
template <int kHeadDim>
__device__ __forceinline__ void store_warp_rows(const float (&acc)[kHeadDim / 8][4], std::uint16_t* tile, int tile_row0,
                                                std::uint16_t* rows_global, std::int64_t stride, int first_row, int seq,
                                                int lane) {
  constexpr int kDTiles = kHeadDim / 8;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  __syncwarp();
  auto* tile_bytes = reinterpret_cast<unsigned char*>(tile);
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = tile_row0 + quad_row + 8 * half;
      *reinterpret_cast<std::uint32_t*>(tile_bytes + tile_offset<kHeadDim>(row, dt) + 2 * quad_col) =
          pack_bf16(acc[dt][2 * half], acc[dt][2 * half + 1]);
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = lane; i < 16 * kDTiles; i += 32) {
    const int r = i / kDTiles, chunk = i % kDTiles;
    if (first_row + tile_row0 + r < seq) {
      const uint4 value = *reinterpret_cast<const uint4*>(tile_bytes + tile_offset<kHeadDim>(tile_row0 + r, chunk));
      *reinterpret_cast<uint4*>(rows_global + (tile_row0 + r) * stride + chunk * 8) = value;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Forward

struct ForwardArgs {
  const std::uint16_t* q;
  const std::uint16_t* k;
  const std::uint16_t* v;
  std::int64_t q_stride, k_stride, v_stride;
  std::uint16_t* out;
  float* lse;
  int seq, q_heads, group;
  float scale_log2;  // softmax scale * log2(e): scores go straight to exp2
};

template <int kHeadDim, int kBlockM, int kBlockN, int kWarps>
constexpr std::size_t forward_smem_bytes() {
  return static_cast<std::size_t>(kBlockM + 2 * kBlockN) * kHeadDim * 2;
}

// grid (query tiles, q_heads, batch), heaviest (last) query tiles first.
template <int kHeadDim, int kBlockM, int kBlockN, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) attention_forward_kernel(const ForwardArgs args) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kMTiles = kBlockM / (16 * kWarps);
  constexpr int kNTiles = kBlockN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  static_assert(kMTiles >= 1 && kMTiles * 16 * kWarps == kBlockM, "rows split into 16-row warp tiles");
  static_assert(kBlockN % 16 == 0, "key tile is a whole number of k-steps");

  extern __shared__ __align__(128) unsigned char smem[];
  const std::uint32_t q_tile = shared_address(smem);
  const std::uint32_t k_tile = q_tile + kBlockM * kHeadDim * 2;
  const std::uint32_t v_tile = k_tile + kBlockN * kHeadDim * 2;

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  const LaneOperands<kHeadDim> ops(lane);
  const int seq = args.seq;
  const int q_start = (static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x)) * kBlockM;
  const int head = static_cast<int>(blockIdx.y), kv_head = head / args.group;
  const std::int64_t batch = blockIdx.z, batch_row = batch * seq;
  const std::uint16_t* q_head = args.q + batch_row * args.q_stride + head * kHeadDim;
  const std::uint16_t* k_head = args.k + batch_row * args.k_stride + kv_head * kHeadDim;
  const std::uint16_t* v_head = args.v + batch_row * args.v_stride + kv_head * kHeadDim;

  load_rows_async<kBlockM, kHeadDim, kThreads>(q_tile, q_head, args.q_stride, q_start, seq);
  load_rows_async<kBlockN, kHeadDim, kThreads>(k_tile, k_head, args.k_stride, 0, seq);
  commit_copies();

  const int warp_row0 = warp * 16 * kMTiles;  // this warp's first row within the tile
  const int warp_first_row = q_start + warp_row0;
  const int warp_last_row = warp_first_row + 16 * kMTiles - 1;
  const int key_blocks = (min(q_start + kBlockM, seq) - 1) / kBlockN + 1;

  float acc[kMTiles][kDTiles][4];
  float row_max[kMTiles][2], row_sum[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][dt][i] = 0.0f;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_max[mt][half] = -INFINITY;
      row_sum[mt][half] = 0.0f;
    }
  }

  for (int block = 0; block < key_blocks; ++block) {
    const int key0 = block * kBlockN;
    wait_all_copies();  // K of this block (and Q) landed
    __syncthreads();    // ... for every thread; every warp is done with the previous V
    load_rows_async<kBlockN, kHeadDim, kThreads>(v_tile, v_head, args.v_stride, key0, seq);
    commit_copies();

    // A warp whose rows all precede this key tile has nothing to add.
    const bool active = key0 <= warp_last_row;
    float s[kMTiles][kNTiles][4];
    if (active) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[mt][nt][i] = 0.0f;
        }
      }
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        std::uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          load_matrix_x4(a[mt], q_tile + ops.a(warp_row0 + mt * 16, ks));
        }
#pragma unroll
        for (int np = 0; np < kBlockN / 16; ++np) {
          std::uint32_t b[4];
          load_matrix_x4(b, k_tile + ops.b(np * 16, ks));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(s[mt][2 * np], a[mt], b[0], b[1]);
            mma_bf16(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }

      if (key0 + kBlockN - 1 > warp_first_row) {  // the tile crosses the diagonal: mask key > query
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int row = warp_first_row + mt * 16 + quad_row + 8 * (i >> 1);
              const int key = key0 + nt * 8 + quad_col + (i & 1);
              if (key > row) s[mt][nt][i] = -INFINITY;
            }
          }
        }
      }

      // Online softmax: each row lives in one quad (4 lanes), 2 rows per m-tile per lane.
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float tile_max = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
          }
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
          tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
          const float new_max = fmaxf(row_max[mt][half], tile_max * args.scale_log2);
          // A row with every key so far masked keeps max -inf; its probabilities are all 0.
          const float shift = new_max == -INFINITY ? 0.0f : new_max;
          const float rescale = fast_exp2(row_max[mt][half] - shift);
          row_max[mt][half] = new_max;
          float sum = row_sum[mt][half] * rescale;
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            acc[mt][dt][2 * half] *= rescale;
            acc[mt][dt][2 * half + 1] *= rescale;
          }
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float p = fast_exp2(fmaf(s[mt][nt][2 * half + e], args.scale_log2, -shift));
              s[mt][nt][2 * half + e] = p;
              sum += p;
            }
          }
          row_sum[mt][half] = sum;
        }
      }
    }

    wait_all_copies();  // V of this block landed
    __syncthreads();    // ... for every thread; every warp is done with this K
    if (block + 1 < key_blocks) {
      load_rows_async<kBlockN, kHeadDim, kThreads>(k_tile, k_head, args.k_stride, key0 + kBlockN, seq);
      commit_copies();
    }

    if (active) {
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        std::uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) accumulators_to_operand(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < kHeadDim / 16; ++dp) {
          std::uint32_t b[4];
          load_matrix_x4_transposed(b, v_tile + ops.t(kk * 16, dp));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(acc[mt][2 * dp], a[mt], b[0], b[1]);
            mma_bf16(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  // Normalise, write lse and the output rows (through this warp's own rows of the Q tile).
  const std::int64_t lse_row0 = (batch * args.q_heads + head) * seq;
  std::uint16_t* out_tile = args.out + ((batch_row + q_start) * args.q_heads + head) * kHeadDim;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = row_sum[mt][half];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float inverse = 1.0f / sum;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        acc[mt][dt][2 * half] *= inverse;
        acc[mt][dt][2 * half + 1] *= inverse;
      }
      const int row = warp_first_row + mt * 16 + quad_row + 8 * half;
      if (lane % 4 == 0 && row < seq) args.lse[lse_row0 + row] = (row_max[mt][half] + log2f(sum)) * kLn2;
    }
    store_warp_rows<kHeadDim>(acc[mt], reinterpret_cast<std::uint16_t*>(smem), warp_row0 + mt * 16, out_tile,
                              static_cast<std::int64_t>(args.q_heads) * kHeadDim, q_start, seq, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward

struct BackwardArgs {
  const std::uint16_t* q;
  const std::uint16_t* k;
  const std::uint16_t* v;
  std::int64_t q_stride, k_stride, v_stride;
  const std::uint16_t* dout;  // dense [batch, seq, q_heads, head_dim]
  const float* lse_log2;      // [batch, q_heads, seq], lse * log2(e)
  const float* delta;         // [batch, q_heads, seq], rowsum(dout * out)
  std::uint16_t* dq;
  std::uint16_t* dk;
  std::uint16_t* dv;
  std::int64_t dq_stride, dk_stride, dv_stride;
  int seq, q_heads, group;
  float scale_log2, scale;
};

// One thread per 8-element chunk of a (batch, head, token) row, rows in [batch, q_heads, seq]
// order so that the per-row results are written contiguously.
template <int kHeadDim>
__global__ void __launch_bounds__(256)
    attention_backward_prepare_kernel(const std::uint16_t* __restrict__ out, const std::uint16_t* __restrict__ dout,
                                      const float* __restrict__ lse, float* __restrict__ lse_log2,
                                      float* __restrict__ delta, std::int64_t rows, int seq, int q_heads) {
  constexpr int kLanes = kHeadDim / 8;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The backward kernel launched after this one waits for the whole grid anyway (griddepcontrol.wait).
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t row = thread / kLanes;
  const int chunk = static_cast<int>(thread % kLanes);
  float sum = 0.0f;
  if (row < rows) {
    const std::int64_t t = row % seq, bh = row / seq;
    const std::int64_t b = bh / q_heads, h = bh % q_heads;
    const std::int64_t at = ((b * seq + t) * q_heads + h) * kHeadDim + chunk * 8;
    const uint4 o = *reinterpret_cast<const uint4*>(out + at);
    const uint4 d = *reinterpret_cast<const uint4*>(dout + at);
    const auto* o2 = reinterpret_cast<const __nv_bfloat162*>(&o);
    const auto* d2 = reinterpret_cast<const __nv_bfloat162*>(&d);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 of = __bfloat1622float2(o2[i]), df = __bfloat1622float2(d2[i]);
      sum = fmaf(of.x, df.x, sum);
      sum = fmaf(of.y, df.y, sum);
    }
  }
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (row < rows && chunk == 0) {
    delta[row] = sum;
    lse_log2[row] = lse[row] * kLog2e;
  }
}

// The key side's walk over queries: a block of keys from key_start takes, for each q head of its
// kv head's group in turn, the query tiles of kBlockM rows from the one holding key_start to the
// end (earlier queries precede every key). Step `step` covers q head head(step) and the tile
// starting at row q_start(step).
template <int kBlockM>
struct KeySteps {
  int first_head, first_tile, tiles_per_head, count;
  __device__ __forceinline__ KeySteps(int key_start, int seq, int kv_head, int group)
      : first_head(kv_head * group),
        first_tile(key_start / kBlockM),
        tiles_per_head((seq + kBlockM - 1) / kBlockM - key_start / kBlockM),
        count(tiles_per_head * group) {}
  __device__ __forceinline__ int head(int step) const { return first_head + step / tiles_per_head; }
  __device__ __forceinline__ int q_start(int step) const { return (first_tile + step % tiles_per_head) * kBlockM; }
};

template <int kHeadDim, int kBlockM, int kWarps, int kMTiles>
constexpr std::size_t backward_key_smem_bytes() {
  return static_cast<std::size_t>(2 * 16 * kMTiles * kWarps + 4 * kBlockM) * kHeadDim * 2 +
         2 * 2 * kBlockM * sizeof(float);
}

// Key side: grid (key tiles of 16 * kMTiles * kWarps keys, kv_heads, batch); every warp owns
// kMTiles m-tiles of 16 keys (more m-tiles: each Q / dO fragment read from shared memory feeds
// more tensor-core work, at the price of dK and dV registers). Query tiles of kBlockM rows are
// double-buffered; each is consumed in slices of kSliceM queries.
template <int kHeadDim, int kBlockM, int kSliceM, int kWarps, int kMTiles>
__device__ __forceinline__ void backward_key_block(const BackwardArgs& args, int block_x, int block_y, int block_z) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kBlockN = 16 * kMTiles * kWarps;
  constexpr int kSTiles = kSliceM / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr std::uint32_t kRowTileBytes = kBlockM * kHeadDim * 2;
  static_assert(kBlockM % kSliceM == 0 && kSliceM % 16 == 0, "query slices are whole k-steps");

  extern __shared__ __align__(128) unsigned char smem[];
  const std::uint32_t k_tile = shared_address(smem);
  const std::uint32_t v_tile = k_tile + kBlockN * kHeadDim * 2;
  const std::uint32_t q_tiles = v_tile + kBlockN * kHeadDim * 2;   // 2 stages
  const std::uint32_t do_tiles = q_tiles + 2 * kRowTileBytes;      // 2 stages
  const std::uint32_t lse_vectors = do_tiles + 2 * kRowTileBytes;  // 2 stages of kBlockM floats
  const std::uint32_t delta_vectors = lse_vectors + 2 * kBlockM * 4;
  const float* lse_shared = reinterpret_cast<const float*>(smem + (lse_vectors - k_tile));
  const float* delta_shared = reinterpret_cast<const float*>(smem + (delta_vectors - k_tile));

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  const LaneOperands<kHeadDim> ops(lane);
  const int seq = args.seq;
  const int key_start = block_x * kBlockN;
  const int kv_head = block_y;
  const std::int64_t batch = block_z, batch_row = batch * seq;
  const std::int64_t dout_stride = static_cast<std::int64_t>(args.q_heads) * kHeadDim;

  const KeySteps<kBlockM> walk(key_start, seq, kv_head, args.group);
  const int steps = walk.count;

  auto load_step = [&](int step, int stage) {
    const int head = walk.head(step);
    const int q_start = walk.q_start(step);
    const std::uint16_t* q_head = args.q + batch_row * args.q_stride + head * kHeadDim;
    const std::uint16_t* do_head = args.dout + batch_row * dout_stride + head * kHeadDim;
    const std::int64_t vector_row0 = (batch * args.q_heads + head) * seq;
    load_rows_async<kBlockM, kHeadDim, kThreads>(q_tiles + stage * kRowTileBytes, q_head, args.q_stride, q_start, seq);
    load_rows_async<kBlockM, kHeadDim, kThreads>(do_tiles + stage * kRowTileBytes, do_head, dout_stride, q_start, seq);
    load_floats_async<kBlockM, kThreads>(lse_vectors + stage * kBlockM * 4, args.lse_log2 + vector_row0, q_start, seq);
    load_floats_async<kBlockM, kThreads>(delta_vectors + stage * kBlockM * 4, args.delta + vector_row0, q_start, seq);
  };

  const std::uint16_t* k_head = args.k + batch_row * args.k_stride + kv_head * kHeadDim;
  const std::uint16_t* v_head = args.v + batch_row * args.v_stride + kv_head * kHeadDim;
  load_rows_async<kBlockN, kHeadDim, kThreads>(k_tile, k_head, args.k_stride, key_start, seq);
  load_rows_async<kBlockN, kHeadDim, kThreads>(v_tile, v_head, args.v_stride, key_start, seq);
  load_step(0, 0);
  commit_copies();

  const int key_row0 = warp * 16 * kMTiles;  // this warp's first key within the tile
  const int warp_first_key = key_start + key_row0;

  float dk[kMTiles][kDTiles][4], dv[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dk[mt][dt][i] = dv[mt][dt][i] = 0.0f;
    }
  }

  for (int step = 0; step < steps; ++step) {
    wait_all_copies();  // this step's tiles landed
    __syncthreads();    // ... for every thread; every warp is done with the other stage
    if (step + 1 < steps) {
      load_step(step + 1, (step + 1) & 1);
      commit_copies();
    }
    const int stage = step & 1;
    const std::uint32_t q_tile = q_tiles + stage * kRowTileBytes;
    const std::uint32_t do_tile = do_tiles + stage * kRowTileBytes;
    const float* lse_stage = lse_shared + stage * kBlockM;
    const float* delta_stage = delta_shared + stage * kBlockM;
    const int q_start = walk.q_start(step);

#pragma unroll
    for (int slice = 0; slice < kBlockM / kSliceM; ++slice) {
      const int slice_row0 = slice * kSliceM;
      const int slice_start = q_start + slice_row0;
      // Every query of the slice precedes every key of the warp: P = 0.
      if (warp_first_key > slice_start + kSliceM - 1) continue;

      // S^T = K Q^T and dP^T = V dO^T for the warp's keys x kSliceM queries.
      float st[kMTiles][kSTiles][4], dpt[kMTiles][kSTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) st[mt][nt][i] = dpt[mt][nt][i] = 0.0f;
        }
      }
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        std::uint32_t a_k[kMTiles][4], a_v[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          load_matrix_x4(a_k[mt], k_tile + ops.a(key_row0 + mt * 16, ks));
          load_matrix_x4(a_v[mt], v_tile + ops.a(key_row0 + mt * 16, ks));
        }
#pragma unroll
        for (int np = 0; np < kSliceM / 16; ++np) {
          std::uint32_t b[4];
          load_matrix_x4(b, q_tile + ops.b(slice_row0 + np * 16, ks));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(st[mt][2 * np], a_k[mt], b[0], b[1]);
            mma_bf16(st[mt][2 * np + 1], a_k[mt], b[2], b[3]);
          }
          load_matrix_x4(b, do_tile + ops.b(slice_row0 + np * 16, ks));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(dpt[mt][2 * np], a_v[mt], b[0], b[1]);
            mma_bf16(dpt[mt][2 * np + 1], a_v[mt], b[2], b[3]);
          }
        }
      }

      // P^T = exp2(S^T scale log2e - lse log2e), zero where key > query; dS^T = P^T (dP^T - D).
      const bool crosses_diagonal = warp_first_key + 16 * kMTiles - 1 > slice_start;
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) {
        const float2 lse2 = *reinterpret_cast<const float2*>(lse_stage + slice_row0 + nt * 8 + quad_col);
        const float2 delta2 = *reinterpret_cast<const float2*>(delta_stage + slice_row0 + nt * 8 + quad_col);
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float lse_q = (i & 1) ? lse2.y : lse2.x;
            const float delta_q = (i & 1) ? delta2.y : delta2.x;
            float p = fast_exp2(fmaf(st[mt][nt][i], args.scale_log2, -lse_q));
            if (crosses_diagonal) {
              const int key = warp_first_key + mt * 16 + quad_row + 8 * (i >> 1);
              const int query = slice_start + nt * 8 + quad_col + (i & 1);
              if (key > query) p = 0.0f;
            }
            st[mt][nt][i] = p;
            dpt[mt][nt][i] = p * (dpt[mt][nt][i] - delta_q);
          }
        }
      }

      // dV += P^T dO and dK += dS^T Q over the slice's queries.
#pragma unroll
      for (int kk = 0; kk < kSliceM / 16; ++kk) {
        std::uint32_t a_p[kMTiles][4], a_ds[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          accumulators_to_operand(a_p[mt], st[mt][2 * kk], st[mt][2 * kk + 1]);
          accumulators_to_operand(a_ds[mt], dpt[mt][2 * kk], dpt[mt][2 * kk + 1]);
        }
#pragma unroll
        for (int dp = 0; dp < kHeadDim / 16; ++dp) {
          std::uint32_t b[4];
          load_matrix_x4_transposed(b, do_tile + ops.t(slice_row0 + kk * 16, dp));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(dv[mt][2 * dp], a_p[mt], b[0], b[1]);
            mma_bf16(dv[mt][2 * dp + 1], a_p[mt], b[2], b[3]);
          }
          load_matrix_x4_transposed(b, q_tile + ops.t(slice_row0 + kk * 16, dp));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(dk[mt][2 * dp], a_ds[mt], b[0], b[1]);
            mma_bf16(dk[mt][2 * dp + 1], a_ds[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  // dK = scale * sum dS^T Q. Each warp writes through its own rows of the K and V tiles.
  const std::int64_t key_row_global = batch_row + key_start;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dk[mt][dt][i] *= args.scale;
    }
    store_warp_rows<kHeadDim>(dk[mt], reinterpret_cast<std::uint16_t*>(smem), key_row0 + mt * 16,
                              args.dk + key_row_global * args.dk_stride + kv_head * kHeadDim, args.dk_stride, key_start,
                              seq, lane);
    store_warp_rows<kHeadDim>(dv[mt], reinterpret_cast<std::uint16_t*>(smem + kBlockN * kHeadDim * 2),
                              key_row0 + mt * 16, args.dv + key_row_global * args.dv_stride + kv_head * kHeadDim,
                              args.dv_stride, key_start, seq, lane);
  }
}

template <int kHeadDim, int kBlockM, int kSliceM, int kPairs, int kMTiles>
constexpr std::size_t backward_key_pairs_smem_bytes() {
  constexpr int kBlockN = 16 * kMTiles * kPairs;
  return static_cast<std::size_t>(2 * kBlockN + 4 * kBlockM) * kHeadDim * 2 + 2 * 2 * kBlockM * sizeof(float) +
         static_cast<std::size_t>(kBlockM / kSliceM) * kPairs * 16 * kMTiles * (kSliceM + 8) * 2;
}

// Key side with warp pairs: grid (key tiles of 16 * kMTiles * kPairs keys, kv_heads, batch). Both
// warps of a pair own the same 16 * kMTiles keys. The first computes S^T = K Q^T, turns it into
// P^T, hands P^T (bf16, as rounded for its own product) to its partner through shared memory and
// accumulates dV += P^T dO; the second computes dP^T = V dO^T, forms dS^T = P^T (dP^T - D) and
// accumulates dK += dS^T Q. Each warp holds a single accumulator (dV or dK) for 16 * kMTiles keys
// in the registers that hold both for half as many keys in the plain key kernel, so each Q or dO
// fragment it reads feeds twice the tensor-core work, and no product is computed twice.
template <int kHeadDim, int kBlockM, int kSliceM, int kPairs, int kMTiles>
__device__ __forceinline__ void backward_key_pairs_block(const BackwardArgs& args, int block_x, int block_y,
                                                         int block_z) {
  constexpr int kThreads = kPairs * 64;
  constexpr int kBlockN = 16 * kMTiles * kPairs;
  constexpr int kSlices = kBlockM / kSliceM;
  constexpr int kSTiles = kSliceM / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr int kExchangeWordsPerRow = (kSliceM + 8) / 2;  // padded: the 8 rows of a store hit 8 bank groups
  constexpr int kExchangeWords = 16 * kMTiles * kExchangeWordsPerRow;
  constexpr std::uint32_t kRowTileBytes = kBlockM * kHeadDim * 2;
  static_assert(kBlockM % kSliceM == 0 && kSliceM % 16 == 0, "query slices are whole k-steps");
  static_assert(kPairs * kSlices <= 15, "one named barrier per pair and slice");

  extern __shared__ __align__(128) unsigned char smem[];
  const std::uint32_t k_tile = shared_address(smem);
  const std::uint32_t v_tile = k_tile + kBlockN * kHeadDim * 2;
  const std::uint32_t q_tiles = v_tile + kBlockN * kHeadDim * 2;   // 2 stages
  const std::uint32_t do_tiles = q_tiles + 2 * kRowTileBytes;      // 2 stages
  const std::uint32_t lse_vectors = do_tiles + 2 * kRowTileBytes;  // 2 stages of kBlockM floats
  const std::uint32_t delta_vectors = lse_vectors + 2 * kBlockM * 4;
  const std::uint32_t exchange_tiles = delta_vectors + 2 * kBlockM * 4;  // [kPairs][kSlices]
  const float* lse_shared = reinterpret_cast<const float*>(smem + (lse_vectors - k_tile));
  const float* delta_shared = reinterpret_cast<const float*>(smem + (delta_vectors - k_tile));

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int pair = warp / 2;
  const bool makes_p = warp % 2 == 0;  // else: makes dS
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  const LaneOperands<kHeadDim> ops(lane);
  const int seq = args.seq;
  const int key_start = block_x * kBlockN;
  const int kv_head = block_y;
  const std::int64_t batch = block_z, batch_row = batch * seq;
  const std::int64_t dout_stride = static_cast<std::int64_t>(args.q_heads) * kHeadDim;
  std::uint32_t* exchange =
      reinterpret_cast<std::uint32_t*>(smem + (exchange_tiles - k_tile)) + pair * kSlices * kExchangeWords;

  const KeySteps<kBlockM> walk(key_start, seq, kv_head, args.group);
  const int steps = walk.count;

  auto load_step = [&](int step, int stage) {
    const int head = walk.head(step);
    const int q_start = walk.q_start(step);
    const std::uint16_t* q_head = args.q + batch_row * args.q_stride + head * kHeadDim;
    const std::uint16_t* do_head = args.dout + batch_row * dout_stride + head * kHeadDim;
    const std::int64_t vector_row0 = (batch * args.q_heads + head) * seq;
    load_rows_async<kBlockM, kHeadDim, kThreads>(q_tiles + stage * kRowTileBytes, q_head, args.q_stride, q_start, seq);
    load_rows_async<kBlockM, kHeadDim, kThreads>(do_tiles + stage * kRowTileBytes, do_head, dout_stride, q_start, seq);
    load_floats_async<kBlockM, kThreads>(lse_vectors + stage * kBlockM * 4, args.lse_log2 + vector_row0, q_start, seq);
    load_floats_async<kBlockM, kThreads>(delta_vectors + stage * kBlockM * 4, args.delta + vector_row0, q_start, seq);
  };

  const std::uint16_t* k_head = args.k + batch_row * args.k_stride + kv_head * kHeadDim;
  const std::uint16_t* v_head = args.v + batch_row * args.v_stride + kv_head * kHeadDim;
  load_rows_async<kBlockN, kHeadDim, kThreads>(k_tile, k_head, args.k_stride, key_start, seq);
  load_rows_async<kBlockN, kHeadDim, kThreads>(v_tile, v_head, args.v_stride, key_start, seq);
  load_step(0, 0);
  commit_copies();

  const int key_row0 = pair * 16 * kMTiles;  // the pair's first key within the tile
  const int pair_first_key = key_start + key_row0;
  // The first warp multiplies K by Q and then P^T by dO; the second V by dO and then dS^T by Q.
  const std::uint32_t a_tile = makes_p ? k_tile : v_tile;

  float acc[kMTiles][kDTiles][4];  // dV (first warp) or dK (second warp)
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][dt][i] = 0.0f;
    }
  }

  for (int step = 0; step < steps; ++step) {
    wait_all_copies();  // this step's tiles landed
    __syncthreads();    // ... for every thread; every warp is done with the other stage and the exchange
    if (step + 1 < steps) {
      load_step(step + 1, (step + 1) & 1);
      commit_copies();
    }
    const int stage = step & 1;
    const std::uint32_t q_tile = q_tiles + stage * kRowTileBytes;
    const std::uint32_t do_tile = do_tiles + stage * kRowTileBytes;
    const std::uint32_t b_tile = makes_p ? q_tile : do_tile;
    const std::uint32_t t_tile = makes_p ? do_tile : q_tile;
    const float* lse_stage = lse_shared + stage * kBlockM;
    const float* delta_stage = delta_shared + stage * kBlockM;
    const int q_start = walk.q_start(step);

#pragma unroll
    for (int slice = 0; slice < kSlices; ++slice) {
      const int slice_row0 = slice * kSliceM;
      const int slice_start = q_start + slice_row0;
      // Every query of the slice precedes every key of the pair: P = 0 (both warps skip alike).
      if (pair_first_key > slice_start + kSliceM - 1) continue;
      std::uint32_t* slice_exchange = exchange + slice * kExchangeWords;
      const int barrier_id = 1 + pair * kSlices + slice;

      // S^T = K Q^T (first warp) or dP^T = V dO^T (second warp), keys x kSliceM queries.
      float s[kMTiles][kSTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[mt][nt][i] = 0.0f;
        }
      }
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        std::uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) load_matrix_x4(a[mt], a_tile + ops.a(key_row0 + mt * 16, ks));
#pragma unroll
        for (int np = 0; np < kSliceM / 16; ++np) {
          std::uint32_t b[4];
          load_matrix_x4(b, b_tile + ops.b(slice_row0 + np * 16, ks));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(s[mt][2 * np], a[mt], b[0], b[1]);
            mma_bf16(s[mt][2 * np + 1], a[mt], b[2], b[3]);
          }
        }
      }

      if (makes_p) {
        // P^T = exp2(S^T scale log2e - lse log2e), zero where key > query; hand it over as bf16.
        const bool crosses_diagonal = pair_first_key + 16 * kMTiles - 1 > slice_start;
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt) {
          const float2 lse2 = *reinterpret_cast<const float2*>(lse_stage + slice_row0 + nt * 8 + quad_col);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              float p = fast_exp2(fmaf(s[mt][nt][i], args.scale_log2, -((i & 1) ? lse2.y : lse2.x)));
              if (crosses_diagonal) {
                const int key = pair_first_key + mt * 16 + quad_row + 8 * (i >> 1);
                const int query = slice_start + nt * 8 + quad_col + (i & 1);
                if (key > query) p = 0.0f;
              }
              s[mt][nt][i] = p;
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              slice_exchange[(mt * 16 + quad_row + 8 * half) * kExchangeWordsPerRow + nt * 4 + lane % 4] =
                  pack_bf16(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]);
            }
          }
        }
        barrier_arrive(barrier_id, 64);
      } else {
        // dS^T = P^T (dP^T - D) with the partner's P^T.
        barrier_sync(barrier_id, 64);
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt) {
          const float2 delta2 = *reinterpret_cast<const float2*>(delta_stage + slice_row0 + nt * 8 + quad_col);
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const std::uint32_t word =
                  slice_exchange[(mt * 16 + quad_row + 8 * half) * kExchangeWordsPerRow + nt * 4 + lane % 4];
              const float p_lo = gpu::low_of(word), p_hi = gpu::high_of(word);
              s[mt][nt][2 * half] = p_lo * (s[mt][nt][2 * half] - delta2.x);
              s[mt][nt][2 * half + 1] = p_hi * (s[mt][nt][2 * half + 1] - delta2.y);
            }
          }
        }
      }

      // dV += P^T dO (first warp) or dK += dS^T Q (second warp) over the slice's queries.
#pragma unroll
      for (int kk = 0; kk < kSliceM / 16; ++kk) {
        std::uint32_t a[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) accumulators_to_operand(a[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < kHeadDim / 16; ++dp) {
          std::uint32_t b[4];
          load_matrix_x4_transposed(b, t_tile + ops.t(slice_row0 + kk * 16, dp));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(acc[mt][2 * dp], a[mt], b[0], b[1]);
            mma_bf16(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  // The partner may still read this warp's K or V rows: wait for every warp before staging.
  __syncthreads();
  const float out_scale = makes_p ? 1.0f : args.scale;  // dK = scale * sum dS^T Q
  const std::int64_t key_row_global = batch_row + key_start;
  std::uint16_t* grad = makes_p ? args.dv : args.dk;
  const std::int64_t grad_stride = makes_p ? args.dv_stride : args.dk_stride;
  unsigned char* staging = smem + (makes_p ? kBlockN * kHeadDim * 2 : 0);  // V rows for dV, K rows for dK
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][dt][i] *= out_scale;
    }
    store_warp_rows<kHeadDim>(acc[mt], reinterpret_cast<std::uint16_t*>(staging), key_row0 + mt * 16,
                              grad + key_row_global * grad_stride + kv_head * kHeadDim, grad_stride, key_start, seq,
                              lane);
  }
}

template <int kHeadDim, int kBlockN, int kWarps, int kMTiles>
constexpr std::size_t backward_query_smem_bytes() {
  return static_cast<std::size_t>(2 * 16 * kMTiles * kWarps + 4 * kBlockN) * kHeadDim * 2;
}

// Query side: grid (query tiles of 16 * kMTiles * kWarps rows, q_heads, batch), heaviest tiles
// first; every warp owns kMTiles m-tiles of 16 query rows. K and V tiles of kBlockN keys are
// double-buffered; each is consumed in sub-tiles of kSubN keys (fewer score registers).
template <int kHeadDim, int kBlockN, int kSubN, int kWarps, int kMTiles>
__device__ __forceinline__ void backward_query_block(const BackwardArgs& args, int block_x, int block_y, int block_z,
                                                     int grid_x) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kBlockM = 16 * kMTiles * kWarps;
  constexpr int kNTiles = kSubN / 8;
  constexpr int kDTiles = kHeadDim / 8;
  constexpr std::uint32_t kKeyTileBytes = kBlockN * kHeadDim * 2;
  static_assert(kBlockN % kSubN == 0 && kSubN % 16 == 0, "key sub-tiles are whole k-steps");

  extern __shared__ __align__(128) unsigned char smem[];
  const std::uint32_t q_tile = shared_address(smem);
  const std::uint32_t do_tile = q_tile + kBlockM * kHeadDim * 2;
  const std::uint32_t k_tiles = do_tile + kBlockM * kHeadDim * 2;  // 2 stages
  const std::uint32_t v_tiles = k_tiles + 2 * kKeyTileBytes;       // 2 stages

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int quad_row = lane / 4, quad_col = 2 * (lane % 4);
  const LaneOperands<kHeadDim> ops(lane);
  const int seq = args.seq;
  const int q_start = (grid_x - 1 - block_x) * kBlockM;
  const int head = block_y, kv_head = head / args.group;
  const std::int64_t batch = block_z, batch_row = batch * seq;
  const std::int64_t dout_stride = static_cast<std::int64_t>(args.q_heads) * kHeadDim;
  const std::uint16_t* k_head = args.k + batch_row * args.k_stride + kv_head * kHeadDim;
  const std::uint16_t* v_head = args.v + batch_row * args.v_stride + kv_head * kHeadDim;

  load_rows_async<kBlockM, kHeadDim, kThreads>(q_tile, args.q + batch_row * args.q_stride + head * kHeadDim,
                                               args.q_stride, q_start, seq);
  load_rows_async<kBlockM, kHeadDim, kThreads>(do_tile, args.dout + batch_row * dout_stride + head * kHeadDim,
                                               dout_stride, q_start, seq);
  load_rows_async<kBlockN, kHeadDim, kThreads>(k_tiles, k_head, args.k_stride, 0, seq);
  load_rows_async<kBlockN, kHeadDim, kThreads>(v_tiles, v_head, args.v_stride, 0, seq);
  commit_copies();

  const int warp_row0 = warp * 16 * kMTiles;
  const int warp_first_row = q_start + warp_row0;
  const int warp_last_row = warp_first_row + 16 * kMTiles - 1;
  const std::int64_t vector_row0 = (batch * args.q_heads + head) * seq;
  float lse_row[kMTiles][2], delta_row[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_first_row + mt * 16 + quad_row + 8 * half;
      lse_row[mt][half] = row < seq ? args.lse_log2[vector_row0 + row] : 0.0f;
      delta_row[mt][half] = row < seq ? args.delta[vector_row0 + row] : 0.0f;
    }
  }
  const int key_blocks = (min(q_start + kBlockM, seq) - 1) / kBlockN + 1;

  float dq[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dq[mt][dt][i] = 0.0f;
    }
  }

  for (int block = 0; block < key_blocks; ++block) {
    wait_all_copies();  // this block's K and V landed
    __syncthreads();    // ... for every thread; every warp is done with the other stage
    if (block + 1 < key_blocks) {
      const int next = (block + 1) & 1;
      load_rows_async<kBlockN, kHeadDim, kThreads>(k_tiles + next * kKeyTileBytes, k_head, args.k_stride,
                                                   (block + 1) * kBlockN, seq);
      load_rows_async<kBlockN, kHeadDim, kThreads>(v_tiles + next * kKeyTileBytes, v_head, args.v_stride,
                                                   (block + 1) * kBlockN, seq);
      commit_copies();
    }
    const std::uint32_t k_tile = k_tiles + (block & 1) * kKeyTileBytes;
    const std::uint32_t v_tile = v_tiles + (block & 1) * kKeyTileBytes;

#pragma unroll
    for (int sub = 0; sub < kBlockN / kSubN; ++sub) {
      const int sub_row0 = sub * kSubN;
      const int key0 = block * kBlockN + sub_row0;
      if (key0 > warp_last_row) continue;  // every key of the sub-tile follows every row of the warp

      // S = Q K^T and dP = dO V^T for the warp's rows x kSubN keys.
      float s[kMTiles][kNTiles][4], dp[kMTiles][kNTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) s[mt][nt][i] = dp[mt][nt][i] = 0.0f;
        }
      }
#pragma unroll
      for (int ks = 0; ks < kHeadDim / 16; ++ks) {
        std::uint32_t a_q[kMTiles][4], a_do[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          load_matrix_x4(a_q[mt], q_tile + ops.a(warp_row0 + mt * 16, ks));
          load_matrix_x4(a_do[mt], do_tile + ops.a(warp_row0 + mt * 16, ks));
        }
#pragma unroll
        for (int np = 0; np < kSubN / 16; ++np) {
          std::uint32_t b[4];
          load_matrix_x4(b, k_tile + ops.b(sub_row0 + np * 16, ks));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(s[mt][2 * np], a_q[mt], b[0], b[1]);
            mma_bf16(s[mt][2 * np + 1], a_q[mt], b[2], b[3]);
          }
          load_matrix_x4(b, v_tile + ops.b(sub_row0 + np * 16, ks));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(dp[mt][2 * np], a_do[mt], b[0], b[1]);
            mma_bf16(dp[mt][2 * np + 1], a_do[mt], b[2], b[3]);
          }
        }
      }

      // dS = P (dP - D), P = exp2(S scale log2e - lse log2e) and 0 where key > query.
      const bool crosses_diagonal = key0 + kSubN - 1 > warp_first_row;
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            float p = fast_exp2(fmaf(s[mt][nt][i], args.scale_log2, -lse_row[mt][i >> 1]));
            if (crosses_diagonal) {
              const int row = warp_first_row + mt * 16 + quad_row + 8 * (i >> 1);
              const int key = key0 + nt * 8 + quad_col + (i & 1);
              if (key > row) p = 0.0f;
            }
            dp[mt][nt][i] = p * (dp[mt][nt][i] - delta_row[mt][i >> 1]);
          }
        }
      }

      // dQ += dS K.
#pragma unroll
      for (int kk = 0; kk < kSubN / 16; ++kk) {
        std::uint32_t a_ds[kMTiles][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) accumulators_to_operand(a_ds[mt], dp[mt][2 * kk], dp[mt][2 * kk + 1]);
#pragma unroll
        for (int d2 = 0; d2 < kHeadDim / 16; ++d2) {
          std::uint32_t b[4];
          load_matrix_x4_transposed(b, k_tile + ops.t(sub_row0 + kk * 16, d2));
#pragma unroll
          for (int mt = 0; mt < kMTiles; ++mt) {
            mma_bf16(dq[mt][2 * d2], a_ds[mt], b[0], b[1]);
            mma_bf16(dq[mt][2 * d2 + 1], a_ds[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  std::uint16_t* dq_tile = args.dq + (batch_row + q_start) * args.dq_stride + head * kHeadDim;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dq[mt][dt][i] *= args.scale;
    }
    store_warp_rows<kHeadDim>(dq[mt], reinterpret_cast<std::uint16_t*>(smem), warp_row0 + mt * 16, dq_tile,
                              args.dq_stride, q_start, seq, lane);
  }
}

// The same algorithm on Hopper's warpgroup products (sm_90a), its tiles loaded by TMA.
#include "models/ops/attention_hopper.cuh"

// ---------------------------------------------------------------------------------------------
// Launchers and tile variants

template <typename Args>
void launch(void (*kernel)(Args), dim3 grid, int threads, std::size_t smem_bytes, const Args& args, cudaStream_t stream,
            const char* name) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  kernel<<<grid, threads, smem_bytes, stream>>>(args);
  CUDA_CHECK_LAUNCH(name);
}

template <int kHeadDim, int kBlockM, int kBlockN, int kWarps>
struct Forward {
  static constexpr std::size_t kSmemBytes = forward_smem_bytes<kHeadDim, kBlockM, kBlockN, kWarps>();
  static void run(const ForwardArgs& args, int batch, cudaStream_t stream) {
    const dim3 grid((args.seq + kBlockM - 1) / kBlockM, args.q_heads, batch);
    launch(attention_forward_kernel<kHeadDim, kBlockM, kBlockN, kWarps>, grid, kWarps * 32, kSmemBytes, args, stream,
           "attention_forward_kernel");
  }
};

// The current device's compute capability major version, cached per device.
int device_major_version() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};  // 0: unknown
  if (device >= kMaxDevices) return 0;
  if (cached[device] == 0)
    CUDA_CHECK(cudaDeviceGetAttribute(&cached[device], cudaDevAttrComputeCapabilityMajor, device));
  return cached[device];
}

// Whether the wgmma kernels can run: the build has sm_90a code (CMake defines
// LLMTRAIN_SM90A_KERNELS when CMAKE_CUDA_ARCHITECTURES lists 90a) and the current device is a
// Hopper GPU (compute capability 9.x).
bool hopper_kernels_available() {
#ifdef LLMTRAIN_SM90A_KERNELS
  return device_major_version() == 9;
#else
  return false;
#endif
}

bool always_available() { return true; }

// The driver's cuTensorMapEncodeTiled, taken through the runtime (the build links no libcuda).
using TensorMapEncoder = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                      const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult status{};
    CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &status));
    if (status != cudaDriverEntryPointSuccess || function == nullptr) {
      checks::fail("attention", "the CUDA driver has no cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<TensorMapEncoder>(function);
  }();
  return encoder;
}

// A 2D map of `rows` token rows of `columns` bf16 (row r at data + r * stride elements) read in
// boxes of 64 columns x hopper::kBoxRows rows with the 128-byte swizzle (wgmma.cuh's tile layout);
// rows past `rows` read as zeros.
CUtensorMap token_rows_map(const std::uint16_t* data, std::int64_t rows, std::int64_t columns, std::int64_t stride) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(columns), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(hopper::kBoxRows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result =
      tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<std::uint16_t*>(data), dims, strides,
                           box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    checks::fail("attention", "cuTensorMapEncodeTiled failed with code " + std::to_string(static_cast<int>(result)));
  }
  return map;
}

template <int kHeadDim, int kBlockN, bool kPingpong>
struct HopperForward {
  using Tiles = hopper::ForwardTiles<kHeadDim, kBlockN>;
  static constexpr std::size_t kSmemBytes = Tiles::kSmemBytes;
  static void run(const ForwardArgs& args, int batch, cudaStream_t stream) {
    const std::int64_t rows = static_cast<std::int64_t>(batch) * args.seq;
    const std::int64_t kv_columns = static_cast<std::int64_t>(args.q_heads / args.group) * kHeadDim;
    hopper::ForwardMaps maps{};
    maps.args = args;
    maps.q = token_rows_map(args.q, rows, static_cast<std::int64_t>(args.q_heads) * kHeadDim, args.q_stride);
    maps.k = token_rows_map(args.k, rows, kv_columns, args.k_stride);
    maps.v = token_rows_map(args.v, rows, kv_columns, args.v_stride);
    const dim3 grid((args.seq + Tiles::kBlockM - 1) / Tiles::kBlockM, args.q_heads, batch);
    launch(hopper::attention_forward_wgmma_kernel<kHeadDim, kBlockN, kPingpong>, grid, hopper::kLoadingThreads,
           kSmemBytes, maps, stream, "attention_forward_wgmma_kernel");
  }
};

// Waits, on sm_90+, until the grid this one was launched as a programmatic dependent of (the
// prepare kernel) has finished and its writes are visible; a no-op otherwise.
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// One side of the backward as a standalone kernel: grid Side::grid, blocks as Side::block.
template <typename Side>
__global__ void __launch_bounds__(Side::kThreads) attention_backward_side_kernel(const BackwardArgs args) {
  Side::block(args, static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z),
              static_cast<int>(gridDim.x));
}

// Both sides in one grid: the first key_blocks blocks are the key side's (in its grid order,
// heaviest first), the rest the query side's, so query blocks fill the key side's tail and no
// second launch waits for the first to drain. Each block's work and summation order are those of
// the standalone kernels, so results are bit-identical to them.
template <typename Key, typename Query>
__global__ void __launch_bounds__(Key::kThreads)
    attention_backward_fused_kernel(const BackwardArgs args, int key_x, int key_y, int key_blocks, int query_x,
                                    int query_y) {
  wait_for_prerequisite_grid();
  const int index = static_cast<int>(blockIdx.x);
  if (index < key_blocks) {
    Key::block(args, index % key_x, (index / key_x) % key_y, index / (key_x * key_y), key_x);
  } else {
    const int q = index - key_blocks;
    Query::block(args, q % query_x, (q / query_x) % query_y, q / (query_x * query_y), query_x);
  }
}

// Key side, one warp per kMTiles x 16 keys holding dK and dV, over query tiles of kBlockM rows in
// slices of kSliceM.
template <int kHeadDim, int kWarps, int kMTiles, int kBlockM, int kSliceM>
struct KeySide {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeys = 16 * kMTiles * kWarps;
  static constexpr std::size_t kSmemBytes = backward_key_smem_bytes<kHeadDim, kBlockM, kWarps, kMTiles>();
  static dim3 grid(const BackwardArgs& args, int batch) {
    return dim3((args.seq + kKeys - 1) / kKeys, args.q_heads / args.group, batch);
  }
  static __device__ __forceinline__ void block(const BackwardArgs& args, int x, int y, int z, int) {
    backward_key_block<kHeadDim, kBlockM, kSliceM, kWarps, kMTiles>(args, x, y, z);
  }
  static void run(const BackwardArgs& args, int batch, cudaStream_t stream) {
    launch(attention_backward_side_kernel<KeySide>, grid(args, batch), kThreads, kSmemBytes, args, stream,
           "attention_backward_key_kernel");
  }
};

// Key side, one warp pair per kMTiles x 16 keys (one warp holds dV, the other dK).
template <int kHeadDim, int kPairs, int kMTiles, int kBlockM, int kSliceM>
struct KeyPairsSide {
  static constexpr int kThreads = kPairs * 64;
  static constexpr int kKeys = 16 * kMTiles * kPairs;
  static constexpr std::size_t kSmemBytes =
      backward_key_pairs_smem_bytes<kHeadDim, kBlockM, kSliceM, kPairs, kMTiles>();
  static dim3 grid(const BackwardArgs& args, int batch) {
    return dim3((args.seq + kKeys - 1) / kKeys, args.q_heads / args.group, batch);
  }
  static __device__ __forceinline__ void block(const BackwardArgs& args, int x, int y, int z, int) {
    backward_key_pairs_block<kHeadDim, kBlockM, kSliceM, kPairs, kMTiles>(args, x, y, z);
  }
  static void run(const BackwardArgs& args, int batch, cudaStream_t stream) {
    launch(attention_backward_side_kernel<KeyPairsSide>, grid(args, batch), kThreads, kSmemBytes, args, stream,
           "attention_backward_key_pairs_kernel");
  }
};

// Query side, one warp per kMTiles x 16 rows, over key tiles of kBlockN in sub-tiles of kSubN.
template <int kHeadDim, int kWarps, int kMTiles, int kBlockN, int kSubN>
struct QuerySide {
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = 16 * kMTiles * kWarps;
  static constexpr std::size_t kSmemBytes = backward_query_smem_bytes<kHeadDim, kBlockN, kWarps, kMTiles>();
  static dim3 grid(const BackwardArgs& args, int batch) {
    return dim3((args.seq + kRows - 1) / kRows, args.q_heads, batch);
  }
  static __device__ __forceinline__ void block(const BackwardArgs& args, int x, int y, int z, int grid_x) {
    backward_query_block<kHeadDim, kBlockN, kSubN, kWarps, kMTiles>(args, x, y, z, grid_x);
  }
  static void run(const BackwardArgs& args, int batch, cudaStream_t stream) {
    launch(attention_backward_side_kernel<QuerySide>, grid(args, batch), kThreads, kSmemBytes, args, stream,
           "attention_backward_query_kernel");
  }
};

// Two launches: the key side, then the query side.
template <typename Key, typename Query>
struct Backward {
  static constexpr std::size_t kSmemBytes = Key::kSmemBytes > Query::kSmemBytes ? Key::kSmemBytes : Query::kSmemBytes;
  static void run(const BackwardArgs& args, int batch, cudaStream_t stream) {
    Key::run(args, batch, stream);
    Query::run(args, batch, stream);
  }
};

// Whether the current device can launch a kernel as a programmatic dependent of the previous one
// in its stream (compute capability 9.0+).
bool programmatic_launch_supported() { return device_major_version() >= 9; }

// Launches `kernel` over `blocks` blocks as a programmatic dependent of the prepare kernel where
// the device supports it, so that its blocks start as the prepare grid drains (they wait for it
// with wait_for_prerequisite_grid before reading lse and D).
template <typename... Params, typename... Args>
void launch_after_prepare(void (*kernel)(Params...), int blocks, int threads, std::size_t smem_bytes,
                          cudaStream_t stream, const char* name, const Args&... args) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_launch_supported()) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
  CUDA_CHECK_LAUNCH(name);
}

// One launch of both sides (attention_backward_fused_kernel) after the prepare kernel.
template <typename Key, typename Query>
struct FusedBackward {
  static_assert(Key::kThreads == Query::kThreads, "both sides run in blocks of one size");
  static constexpr std::size_t kSmemBytes = Key::kSmemBytes > Query::kSmemBytes ? Key::kSmemBytes : Query::kSmemBytes;
  static void run(const BackwardArgs& args, int batch, cudaStream_t stream) {
    const dim3 key = Key::grid(args, batch), query = Query::grid(args, batch);
    const int key_blocks = static_cast<int>(key.x * key.y * key.z);
    const int query_blocks = static_cast<int>(query.x * query.y * query.z);
    launch_after_prepare(attention_backward_fused_kernel<Key, Query>, key_blocks + query_blocks, Key::kThreads,
                         kSmemBytes, stream, "attention_backward_fused_kernel", args, static_cast<int>(key.x),
                         static_cast<int>(key.y), key_blocks, static_cast<int>(query.x), static_cast<int>(query.y));
  }
};

// The Hopper sides (attention_hopper.cuh) in one grid, ordered as
// attention_backward_fused_kernel's: key blocks (128 keys of one kv head), then query blocks (128
// queries of one q head).
template <int kHeadDim>
__global__ void __launch_bounds__(hopper::kLoadingThreads, 1)
    attention_backward_wgmma_kernel(const __grid_constant__ hopper::BackwardMaps maps, int key_x, int key_y,
                                    int key_blocks, int query_x, int query_y) {
#ifdef LLMTRAIN_WGMMA  // TMA, mbarrier transactions, setmaxnreg and wgmma need sm_90a
  wait_for_prerequisite_grid();
  const int index = static_cast<int>(blockIdx.x);
  if (index < key_blocks) {
    hopper::backward_key_block<kHeadDim>(maps, index % key_x, (index / key_x) % key_y, index / (key_x * key_y));
  } else {
    const int q = index - key_blocks;
    hopper::backward_query_block<kHeadDim>(maps, q % query_x, (q / query_x) % query_y, q / (query_x * query_y),
                                           query_x);
  }
#else
  gpu::wgmma_trap();
#endif
}

template <int kHeadDim>
struct HopperBackward {
  using KeyTiles = hopper::KeySideTiles<kHeadDim>;
  using QueryTiles = hopper::QuerySideTiles<kHeadDim>;
  static constexpr std::size_t kSmemBytes =
      KeyTiles::kSmemBytes > QueryTiles::kSmemBytes ? KeyTiles::kSmemBytes : QueryTiles::kSmemBytes;
  static void run(const BackwardArgs& args, int batch, cudaStream_t stream) {
    const std::int64_t rows = static_cast<std::int64_t>(batch) * args.seq;
    const std::int64_t q_columns = static_cast<std::int64_t>(args.q_heads) * kHeadDim;
    const std::int64_t kv_columns = static_cast<std::int64_t>(args.q_heads / args.group) * kHeadDim;
    hopper::BackwardMaps maps{};
    maps.args = args;
    maps.q = token_rows_map(args.q, rows, q_columns, args.q_stride);
    maps.k = token_rows_map(args.k, rows, kv_columns, args.k_stride);
    maps.v = token_rows_map(args.v, rows, kv_columns, args.v_stride);
    maps.dout = token_rows_map(args.dout, rows, q_columns, q_columns);
    const int key_x = (args.seq + KeyTiles::kBlockN - 1) / KeyTiles::kBlockN, key_y = args.q_heads / args.group;
    const int query_x = (args.seq + QueryTiles::kBlockM - 1) / QueryTiles::kBlockM, query_y = args.q_heads;
    const int key_blocks = key_x * key_y * batch, query_blocks = query_x * query_y * batch;
    launch_after_prepare(attention_backward_wgmma_kernel<kHeadDim>, key_blocks + query_blocks, hopper::kLoadingThreads,
                         kSmemBytes, stream, "attention_backward_wgmma_kernel", maps, key_x, key_y, key_blocks, query_x,
                         query_y);
  }
};

struct ForwardVariant {
  const char* name;
  void (*run)(const ForwardArgs&, int, cudaStream_t);
  std::size_t smem_bytes;
  bool (*available)();  // whether the build and the current device can run it
};

struct BackwardVariant {
  const char* name;
  void (*run)(const BackwardArgs&, int, cudaStream_t);
  std::size_t smem_bytes;
  bool (*available)();
};

template <typename Config>
constexpr ForwardVariant forward_variant(const char* name, bool (*available)() = always_available) {
  return {name, &Config::run, Config::kSmemBytes, available};
}

template <typename Config>
constexpr BackwardVariant backward_variant(const char* name, bool (*available)() = always_available) {
  return {name, &Config::run, Config::kSmemBytes, available};
}

// In order of preference (measured on an H200); the automatic choice is the first that fits the
// device's shared memory per block. Names: m = query rows and n = keys per block (a/b: loaded a at
// a time, used b at a time), w = warps x rows per warp, "pairs" = warp pairs x keys per pair.
constexpr ForwardVariant kForward64[] = {
    forward_variant<HopperForward<64, 128, true>>("wgmma m128 n128 wg2x64 (tma loads, pingpong)",
                                                  hopper_kernels_available),
    forward_variant<HopperForward<64, 128, false>>("wgmma m128 n128 wg2x64 (tma loads)", hopper_kernels_available),
    forward_variant<Forward<64, 128, 128, 4>>("m128 n128 w4x32"),
    forward_variant<Forward<64, 128, 64, 4>>("m128 n64 w4x32"),
    forward_variant<Forward<64, 64, 64, 4>>("m64 n64 w4x16"),
    forward_variant<Forward<64, 128, 64, 8>>("m128 n64 w8x16"),
};
constexpr ForwardVariant kForward128[] = {
    forward_variant<HopperForward<128, 128, true>>("wgmma m128 n128 wg2x64 (tma loads, pingpong)",
                                                   hopper_kernels_available),
    forward_variant<HopperForward<128, 128, false>>("wgmma m128 n128 wg2x64 (tma loads)", hopper_kernels_available),
    forward_variant<Forward<128, 128, 64, 4>>("m128 n64 w4x32"),
    forward_variant<Forward<128, 64, 64, 4>>("m64 n64 w4x16"),
    forward_variant<Forward<128, 128, 64, 8>>("m128 n64 w8x16"),
    forward_variant<Forward<128, 128, 32, 4>>("m128 n32 w4x32"),
};
constexpr BackwardVariant kBackward64[] = {
    backward_variant<HopperBackward<64>>("wgmma fused key n128 m64 wg2x64 | query m128 n64 wg2x64 (tma loads)",
                                         hopper_kernels_available),
    backward_variant<FusedBackward<KeySide<64, 4, 2, 128, 32>, QuerySide<64, 4, 2, 128, 32>>>(
        "fused key n128 m128/32 w4x32 | query m128 n128/32 w4x32"),
    backward_variant<Backward<KeySide<64, 4, 2, 128, 32>, QuerySide<64, 4, 2, 128, 32>>>(
        "key n128 m128/32 w4x32 | query m128 n128/32 w4x32"),
    backward_variant<Backward<KeySide<64, 4, 2, 64, 32>, QuerySide<64, 4, 2, 64, 32>>>(
        "key n128 m64/32 w4x32 | query m128 n64/32 w4x32"),
    backward_variant<Backward<KeyPairsSide<64, 2, 4, 64, 32>, QuerySide<64, 4, 2, 128, 32>>>(
        "key n128 m64/32 pairs2x64 | query m128 n128/32 w4x32"),
    backward_variant<Backward<KeySide<64, 4, 1, 128, 64>, QuerySide<64, 4, 1, 128, 128>>>(
        "key n64 m128/64 w4x16 | query m64 n128 w4x16"),
};
constexpr BackwardVariant kBackward128[] = {
    backward_variant<HopperBackward<128>>("wgmma fused key n128 m64 wg2x64 | query m128 n64 wg2x64 (tma loads)",
                                          hopper_kernels_available),
    backward_variant<FusedBackward<KeyPairsSide<128, 2, 2, 64, 64>, QuerySide<128, 4, 2, 32, 32>>>(
        "fused key n64 m64 pairs2x32 | query m128 n32 w4x32 (> 99 KB smem)"),
    backward_variant<FusedBackward<KeyPairsSide<128, 2, 2, 64, 32>, QuerySide<128, 4, 2, 32, 32>>>(
        "fused key n64 m64/32 pairs2x32 | query m128 n32 w4x32 (> 99 KB smem)"),
    backward_variant<Backward<KeyPairsSide<128, 2, 2, 64, 64>, QuerySide<128, 4, 2, 32, 32>>>(
        "key n64 m64 pairs2x32 | query m128 n32 w4x32 (> 99 KB smem)"),
    backward_variant<Backward<KeyPairsSide<128, 2, 2, 64, 32>, QuerySide<128, 4, 2, 32, 32>>>(
        "key n64 m64/32 pairs2x32 | query m128 n32 w4x32 (> 99 KB smem)"),
    backward_variant<FusedBackward<KeySide<128, 4, 1, 64, 64>, QuerySide<128, 4, 2, 32, 32>>>(
        "fused key n64 m64 w4x16 | query m128 n32 w4x32"),
    backward_variant<Backward<KeySide<128, 4, 1, 64, 64>, QuerySide<128, 4, 2, 32, 32>>>(
        "key n64 m64 w4x16 | query m128 n32 w4x32"),
    backward_variant<Backward<KeySide<128, 4, 1, 64, 64>, QuerySide<128, 4, 1, 64, 64>>>(
        "key n64 m64 w4x16 | query m64 n64 w4x16"),
};

// ---------------------------------------------------------------------------------------------
// Argument checks

std::int64_t dense_stride(const AttentionShape& s, std::int64_t heads) { return heads * s.head_dim; }

void check_shape(std::string_view op, const AttentionShape& s) {
  checks::require_non_negative(op, "batch", s.batch);
  checks::require_non_negative(op, "seq", s.seq);
  checks::require_positive(op, "q_heads", s.q_heads);
  checks::require_positive(op, "kv_heads", s.kv_heads);
  if (s.q_heads % s.kv_heads != 0) {
    checks::fail(op, "q_heads (" + std::to_string(s.q_heads) + ") must be a multiple of kv_heads (" +
                         std::to_string(s.kv_heads) + ")");
  }
  if (s.head_dim != 64 && s.head_dim != 128) {
    checks::fail(op, "head_dim must be 64 or 128 on the GPU, got " + std::to_string(s.head_dim));
  }
  if (s.seq > std::numeric_limits<int>::max() / 2 || s.batch > 65535 || s.q_heads > 65535) {
    checks::fail(op, "shape too large (seq < 2^30, batch and q_heads <= 65535)");
  }
}

void check_aligned(std::string_view op, std::string_view name, const void* p) {
  if (p == nullptr) checks::fail(op, std::string(name) + " is null");
  if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) checks::fail(op, std::string(name) + " must be 16-byte aligned");
}

template <typename Word>
void check_strided(std::string_view op, std::string_view name, TokenStrided<Word> t, std::int64_t min_stride) {
  check_aligned(op, name, t.data);
  if (t.token_stride % 8 != 0 || t.token_stride < min_stride) {
    checks::fail(op, std::string(name) + " token_stride must be a multiple of 8 and at least " +
                         std::to_string(min_stride) + ", got " + std::to_string(t.token_stride));
  }
}

// The bytes a token-strided [batch, seq, heads, head_dim] view spans.
template <typename Word>
checks::Region strided_region(std::string_view name, TokenStrided<Word> t, const AttentionShape& s,
                              std::int64_t heads) {
  const std::int64_t tokens = s.batch * s.seq;
  const std::int64_t elements = tokens == 0 ? 0 : (tokens - 1) * t.token_stride + heads * s.head_dim;
  return {name, t.data, static_cast<std::size_t>(elements) * 2};
}

void require_no_overlap(std::string_view op, std::initializer_list<checks::Region> outputs,
                        std::initializer_list<checks::Region> inputs) {
  for (const auto& out : outputs) {
    for (const auto& in : inputs) {
      if (checks::overlap(out, in)) {
        checks::fail(op, std::string(out.name) + " overlaps the input " + std::string(in.name));
      }
    }
  }
}

std::span<const ForwardVariant> forward_variants(std::int64_t head_dim) {
  if (head_dim == 64) return kForward64;
  if (head_dim == 128) return kForward128;
  return {};
}

std::span<const BackwardVariant> backward_variants(std::int64_t head_dim) {
  if (head_dim == 64) return kBackward64;
  if (head_dim == 128) return kBackward128;
  return {};
}

int variant_count(std::int64_t head_dim, bool backward) {
  return static_cast<int>(backward ? backward_variants(head_dim).size() : forward_variants(head_dim).size());
}

void check_variant(std::string_view op, std::int64_t head_dim, bool backward, int variant) {
  if (variant < -1 || variant >= variant_count(head_dim, backward) || variant_count(head_dim, backward) == 0) {
    checks::fail(op, "no tile variant " + std::to_string(variant) + " for head_dim " + std::to_string(head_dim));
  }
}

std::size_t variant_smem_bytes(std::int64_t head_dim, bool backward, int variant) {
  return backward ? backward_variants(head_dim)[variant].smem_bytes : forward_variants(head_dim)[variant].smem_bytes;
}

bool variant_available(std::int64_t head_dim, bool backward, int variant) {
  return backward ? backward_variants(head_dim)[variant].available() : forward_variants(head_dim)[variant].available();
}

// `variant`, or for -1 the first variant the current device can run whose shared memory fits a block.
int resolve_variant(std::string_view op, std::int64_t head_dim, bool backward, int variant) {
  if (variant >= 0) return variant;
  int device = 0, limit = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  for (int i = 0; i < variant_count(head_dim, backward); ++i) {
    if (variant_smem_bytes(head_dim, backward, i) <= static_cast<std::size_t>(limit) &&
        variant_available(head_dim, backward, i)) {
      return i;
    }
  }
  checks::fail(op, "no tile variant fits the " + std::to_string(limit) + " bytes of shared memory per block");
}

}  // namespace

int attention_cuda_variant_count(std::int64_t head_dim, bool backward) { return variant_count(head_dim, backward); }

const char* attention_cuda_variant_name(std::int64_t head_dim, bool backward, int variant) {
  check_variant("attention_cuda_variant_name", head_dim, backward, variant);
  variant = resolve_variant("attention_cuda_variant_name", head_dim, backward, variant);
  return backward ? backward_variants(head_dim)[variant].name : forward_variants(head_dim)[variant].name;
}

bool attention_cuda_variant_available(std::int64_t head_dim, bool backward, int variant) {
  check_variant("attention_cuda_variant_available", head_dim, backward, variant);
  variant = resolve_variant("attention_cuda_variant_available", head_dim, backward, variant);
  return variant_available(head_dim, backward, variant);
}

std::size_t attention_cuda_variant_smem_bytes(std::int64_t head_dim, bool backward, int variant) {
  check_variant("attention_cuda_variant_smem_bytes", head_dim, backward, variant);
  variant = resolve_variant("attention_cuda_variant_smem_bytes", head_dim, backward, variant);
  return variant_smem_bytes(head_dim, backward, variant);
}

void attention_forward_cuda(const AttentionShape& shape, AttentionInput q, AttentionInput k, AttentionInput v,
                            std::uint16_t* out, float* lse, cudaStream_t stream, int variant) {
  constexpr std::string_view op = "attention_forward_cuda";
  check_shape(op, shape);
  check_variant(op, shape.head_dim, false, variant);
  if (shape.batch == 0 || shape.seq == 0) return;
  check_strided(op, "q", q, dense_stride(shape, shape.q_heads));
  check_strided(op, "k", k, dense_stride(shape, shape.kv_heads));
  check_strided(op, "v", v, dense_stride(shape, shape.kv_heads));
  check_aligned(op, "out", out);
  check_aligned(op, "lse", lse);
  const std::int64_t rows = shape.batch * shape.seq * shape.q_heads;
  require_no_overlap(op,
                     {{"out", out, static_cast<std::size_t>(rows * shape.head_dim) * 2},
                      {"lse", lse, static_cast<std::size_t>(rows) * sizeof(float)}},
                     {strided_region("q", q, shape, shape.q_heads), strided_region("k", k, shape, shape.kv_heads),
                      strided_region("v", v, shape, shape.kv_heads)});

  ForwardArgs args{};
  args.q = q.data;
  args.k = k.data;
  args.v = v.data;
  args.q_stride = q.token_stride;
  args.k_stride = k.token_stride;
  args.v_stride = v.token_stride;
  args.out = out;
  args.lse = lse;
  args.seq = static_cast<int>(shape.seq);
  args.q_heads = static_cast<int>(shape.q_heads);
  args.group = static_cast<int>(shape.q_heads / shape.kv_heads);
  args.scale_log2 = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(shape.head_dim)));
  const int chosen = resolve_variant(op, shape.head_dim, false, variant);
  forward_variants(shape.head_dim)[chosen].run(args, static_cast<int>(shape.batch), stream);
}

std::size_t attention_backward_workspace_bytes(const AttentionShape& shape) {
  // lse * log2(e) and D, one float each per (batch, q head, token).
  return 2 * static_cast<std::size_t>(shape.batch * shape.q_heads * shape.seq) * sizeof(float);
}

void attention_backward_cuda(const AttentionShape& shape, AttentionInput q, AttentionInput k, AttentionInput v,
                             const std::uint16_t* out, const float* lse, const std::uint16_t* dout,
                             AttentionGradient dq, AttentionGradient dk, AttentionGradient dv, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream, int variant) {
  constexpr std::string_view op = "attention_backward_cuda";
  check_shape(op, shape);
  check_variant(op, shape.head_dim, true, variant);
  if (shape.batch == 0 || shape.seq == 0) return;
  check_strided(op, "q", q, dense_stride(shape, shape.q_heads));
  check_strided(op, "k", k, dense_stride(shape, shape.kv_heads));
  check_strided(op, "v", v, dense_stride(shape, shape.kv_heads));
  check_strided(op, "dq", dq, dense_stride(shape, shape.q_heads));
  check_strided(op, "dk", dk, dense_stride(shape, shape.kv_heads));
  check_strided(op, "dv", dv, dense_stride(shape, shape.kv_heads));
  check_aligned(op, "out", out);
  check_aligned(op, "lse", lse);
  check_aligned(op, "dout", dout);
  check_aligned(op, "workspace", workspace);
  const std::size_t needed = attention_backward_workspace_bytes(shape);
  if (workspace_bytes < needed) {
    checks::fail(op, "workspace holds " + std::to_string(workspace_bytes) + " bytes, needs " + std::to_string(needed));
  }
  const std::int64_t rows = shape.batch * shape.seq * shape.q_heads;
  const std::size_t dense_bytes = static_cast<std::size_t>(rows * shape.head_dim) * 2;
  require_no_overlap(op,
                     {strided_region("dq", dq, shape, shape.q_heads),
                      strided_region("dk", dk, shape, shape.kv_heads),
                      strided_region("dv", dv, shape, shape.kv_heads),
                      {"workspace", workspace, needed}},
                     {strided_region("q", q, shape, shape.q_heads),
                      strided_region("k", k, shape, shape.kv_heads),
                      strided_region("v", v, shape, shape.kv_heads),
                      {"out", out, dense_bytes},
                      {"lse", lse, static_cast<std::size_t>(rows) * sizeof(float)},
                      {"dout", dout, dense_bytes}});

  auto* lse_log2 = static_cast<float*>(workspace);
  float* delta = lse_log2 + rows;
  const int lanes = static_cast<int>(shape.head_dim / 8);
  const std::int64_t prepare_threads = rows * lanes;
  const auto prepare_blocks = static_cast<unsigned>((prepare_threads + 255) / 256);
  if (shape.head_dim == 64) {
    attention_backward_prepare_kernel<64><<<prepare_blocks, 256, 0, stream>>>(
        out, dout, lse, lse_log2, delta, rows, static_cast<int>(shape.seq), static_cast<int>(shape.q_heads));
  } else {
    attention_backward_prepare_kernel<128><<<prepare_blocks, 256, 0, stream>>>(
        out, dout, lse, lse_log2, delta, rows, static_cast<int>(shape.seq), static_cast<int>(shape.q_heads));
  }
  CUDA_CHECK_LAUNCH("attention_backward_prepare_kernel");

  BackwardArgs args{};
  args.q = q.data;
  args.k = k.data;
  args.v = v.data;
  args.q_stride = q.token_stride;
  args.k_stride = k.token_stride;
  args.v_stride = v.token_stride;
  args.dout = dout;
  args.lse_log2 = lse_log2;
  args.delta = delta;
  args.dq = dq.data;
  args.dk = dk.data;
  args.dv = dv.data;
  args.dq_stride = dq.token_stride;
  args.dk_stride = dk.token_stride;
  args.dv_stride = dv.token_stride;
  args.seq = static_cast<int>(shape.seq);
  args.q_heads = static_cast<int>(shape.q_heads);
  args.group = static_cast<int>(shape.q_heads / shape.kv_heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(shape.head_dim));
  args.scale = static_cast<float>(scale);
  args.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const int chosen = resolve_variant(op, shape.head_dim, true, variant);
  backward_variants(shape.head_dim)[chosen].run(args, static_cast<int>(shape.batch), stream);
}

}  // namespace models::ops
