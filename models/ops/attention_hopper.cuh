// The Hopper (sm_90a) kernels of attention.cu: the same causal GQA forward and deterministic
// two-sided backward, with every product a warpgroup wgmma (models/ops/wgmma.cuh) reading its
// shared-memory operands through descriptors, and the tiles loaded by TMA (core/async_copy.cuh)
// from a warpgroup of their own (FlashAttention-3's structure). Included by attention.cu only,
// inside its namespace, after its primitives (named barriers, fast_exp2) and argument structs.
//
// Tiles: [rows, head_dim] bf16 as head_dim / 64 swizzled 64-column tiles one after the other, each
// 1024-byte aligned (WarpgroupTile). A product reads a tile K-major (Q K^T: rows are M or N, columns
// the head_dim sum) or MN-major (P V: rows are the key sum, columns the head_dim outputs), so V, Q
// and dO never need a transposed copy.
//
// Loading: a third warpgroup only loads, into a ring of stages; each stage has a full barrier (its
// bytes landed) and an empty barrier (every computing warp is done with it). The two computing
// warpgroups then wait only for their own data, never for each other or for a block-wide barrier,
// so one's softmax runs under the other's products. setmaxnreg moves the loading warpgroup's
// registers to them. The maps read 2D token rows (batch * seq rows of heads * head_dim bf16) in
// 64 x 64 boxes with the 128-byte swizzle, so a landed box is the tile layout. Rows past a
// sequence's end hold the next sequence's tokens (zeros past the batch): keys there are masked as
// future keys, query rows there are not stored, and the backward's key side masks queries at or
// past seq explicitly.
//
// Forward: a block owns 128 query rows of one (batch, head), a warpgroup 64 of them; over key tiles
// up to the diagonal: S = Q K^T (A and B from shared memory), the online softmax on the
// accumulators, O += P V with P from registers, that product one block behind so that it runs
// under the next block's softmax; optionally the two warpgroups take turns issuing their products.
// Backward, the same two sides as attention.cu's, in one grid: key side (128 keys of one kv head a
// block, 64 a warpgroup, over 64-query tiles of every q head of the group): S^T = K Q^T and
// dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q with P^T and dS^T from registers; query side
// (128 queries a block, 64 a warpgroup, over 64-key tiles): S and dP again, dQ += dS K. No atomics:
// reruns are bit-identical.
#pragma once

namespace hopper {

constexpr int kThreads = 256;  // two warpgroups
constexpr int kWarpgroupRows = 64;

// A [kRows, kHeadDim] bf16 tile in shared memory: kHeadDim / 64 swizzled 64-column tiles, each
// kRows x 128 bytes.
template <int kRows, int kHeadDim>
struct WarpgroupTile {
  static_assert(kRows % 64 == 0 && kHeadDim % 64 == 0, "whole 64-row and 64-column tiles");
  static constexpr std::uint32_t kColumnTileBytes = kRows * 128;
  static constexpr std::uint32_t kBytes = kColumnTileBytes * (kHeadDim / 64);

  // Byte offset of element (row, column).
  static __device__ __forceinline__ std::uint32_t offset(int row, int column) {
    return static_cast<std::uint32_t>(column / 64) * kColumnTileBytes +
           gpu::swizzled_offset(static_cast<std::uint32_t>(row), static_cast<std::uint32_t>(column % 64));
  }
  // Rows from row0 (a multiple of 8) as the M or N of a product summing over head_dim: k16 step ks.
  static __device__ __forceinline__ std::uint64_t k_major(std::uint32_t tile, int row0, int ks) {
    return gpu::swizzled_tile_descriptor(tile + (ks / 4) * kColumnTileBytes + row0 * 128 + (ks % 4) * 32);
  }
  // Rows [row0, row0 + 16) as the k16 step of a product summing over rows, N = head_dim.
  static __device__ __forceinline__ std::uint64_t mn_major(std::uint32_t tile, int row0) {
    return gpu::swizzled_mn_major_descriptor(tile + row0 * 128, kColumnTileBytes);
  }
};

// The A fragment of k16 step kk from accumulators of the same rows (columns 16 kk .. 16 kk + 15).
template <int kCount>
__device__ __forceinline__ void accumulators_to_fragment(std::uint32_t (&a)[4], const float (&acc)[kCount], int kk) {
  a[0] = pack_bf16(acc[8 * kk + 0], acc[8 * kk + 1]);
  a[1] = pack_bf16(acc[8 * kk + 2], acc[8 * kk + 3]);
  a[2] = pack_bf16(acc[8 * kk + 4], acc[8 * kk + 5]);
  a[3] = pack_bf16(acc[8 * kk + 6], acc[8 * kk + 7]);
}

template <int kCount>
__device__ __forceinline__ void set_zero(float (&values)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) values[i] = 0.0f;
}

// Writes a warpgroup's [64, kHeadDim] accumulators (already scaled) as bf16 rows: through its own
// rows [row0, row0 + 64) of `tile` (no product reads them any more), then to global row r at
// rows_global + r * stride with 16-byte stores; rows with first_row + r >= seq are skipped.
template <int kRows, int kHeadDim>
__device__ __forceinline__ void store_warpgroup_rows(const float (&acc)[kHeadDim / 2], unsigned char* tile, int row0,
                                                     std::uint16_t* rows_global, std::int64_t stride, int first_row,
                                                     int seq) {
  using Tile = WarpgroupTile<kRows, kHeadDim>;
  const int thread = static_cast<int>(threadIdx.x) % 128, warp = thread / 32, lane = thread % 32;
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = row0 + 16 * warp + lane / 4 + 8 * i, column = 8 * j + 2 * (lane % 4);
      *reinterpret_cast<std::uint32_t*>(tile + Tile::offset(row, column)) =
          pack_bf16(acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1]);
    }
  }
  barrier_sync(1 + static_cast<int>(threadIdx.x) / 128, 128);  // this warpgroup's rows are written
  constexpr int kChunks = kHeadDim / 8;
#pragma unroll 4
  for (int c = thread; c < kWarpgroupRows * kChunks; c += 128) {
    const int r = c / kChunks, chunk = c % kChunks;
    if (first_row + r < seq) {
      *reinterpret_cast<uint4*>(rows_global + r * stride + chunk * 8) =
          *reinterpret_cast<const uint4*>(tile + Tile::offset(row0 + r, chunk * 8));
    }
  }
}

// The 1024-byte aligned start of the dynamic shared memory (kernels ask for 1024 bytes more).
__device__ __forceinline__ std::uint32_t aligned_shared_base(unsigned char* smem, unsigned char** generic) {
  const std::uint32_t address = shared_address(smem);
  const std::uint32_t base = (address + 1023u) & ~1023u;
  *generic = smem + (base - address);
  return base;
}

// The loading warpgroup, and the registers setmaxnreg leaves it and gives the two computing ones
// (3 x 128 threads launch with 168 each: 2 x 128 x consumer + 128 x producer <= 65536).
constexpr int kProducerThreads = 128;
constexpr int kLoadingThreads = kThreads + kProducerThreads;
constexpr int kForwardProducerRegisters = 40, kForwardConsumerRegisters = 232;
constexpr int kBackwardProducerRegisters = 24, kBackwardConsumerRegisters = 240;
constexpr int kBoxRows = 64;  // token rows a TMA box copies

// A warpgroup's register budget per thread, lowered or raised (a multiple of 8 in [24, 256]): the
// loading warpgroup gives registers to the computing ones. Every thread of the warpgroup calls it.
template <int kRegisters>
__device__ __forceinline__ void lower_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void raise_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// This thread's warpgroup through a shuffle, so that the compiler sees it uniform over each warp
// (a branch it takes as divergent would serialise the wgmma instructions behind it).
__device__ __forceinline__ int warpgroup_role() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
}

// Starts TMA copies of token rows [row0, row0 + kRows) and columns [column0, column0 + kHeadDim)
// of `map` into a WarpgroupTile, completing their bytes on `barrier`.
template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_tile_tma(std::uint32_t tile, const CUtensorMap* map, std::uint32_t barrier,
                                              int column0, int row0) {
  using Tile = WarpgroupTile<kRows, kHeadDim>;
#pragma unroll
  for (int h = 0; h < kHeadDim / 64; ++h) {
#pragma unroll
    for (int r = 0; r < kRows / kBoxRows; ++r) {
      core::tensor_copy_2d(tile + h * Tile::kColumnTileBytes + r * kBoxRows * 128, map, barrier, column0 + 64 * h,
                           row0 + r * kBoxRows);
    }
  }
}

// A ring of kStages stages after `base`: stage s's full barrier at base + 8 (1 + s), its empty
// barrier at base + 8 (1 + kStages + s); base itself is the barrier of the tiles loaded once.
template <int kStages>
struct StageBarriers {
  std::uint32_t base;
  static constexpr std::size_t kBytes = 8 * (1 + 2 * kStages);
  __device__ __forceinline__ std::uint32_t once() const { return base; }
  __device__ __forceinline__ std::uint32_t full(int use) const {
    return base + 8u * static_cast<std::uint32_t>(1 + use % kStages);
  }
  __device__ __forceinline__ std::uint32_t empty(int use) const {
    return base + 8u * static_cast<std::uint32_t>(1 + kStages + use % kStages);
  }
  // Thread 0 initialises them before the block's __syncthreads: the full barriers wait for
  // `full_arrivals` arrivals and their bytes, the empty ones for one arrival per computing warp.
  __device__ __forceinline__ void init(int full_arrivals) const {
    if (threadIdx.x == 0) {
      core::mbar_init(once(), 1);
      for (int stage = 0; stage < kStages; ++stage) {
        core::mbar_init(full(stage), static_cast<std::uint32_t>(full_arrivals));
        core::mbar_init(empty(stage), kThreads / 32);
      }
      core::fence_mbarrier_init();
    }
  }
  // The loader, before refilling the stage of use `use`: the computing warps released use - kStages.
  __device__ __forceinline__ void wait_empty(int use) const {
    if (use >= kStages) core::mbar_wait(empty(use), static_cast<std::uint32_t>(use / kStages - 1) & 1u);
  }
  __device__ __forceinline__ void wait_full(int use) const {
    core::mbar_wait(full(use), static_cast<std::uint32_t>(use / kStages) & 1u);
  }
  // A computing warp is done with the stage of use `use` (its products landed, its lanes' reads of
  // it done): one arrival per warp.
  __device__ __forceinline__ void release(int use) const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) core::mbar_arrive(empty(use));
  }
};

// The loading thread's copies of K then V of key blocks [0, key_blocks) (token rows row0 +
// kBlockN j, columns from `column`) into the ring's stages, stage_tile(j) the K tile of block j's
// stage with its V tile right after: the forward and the backward's query side walk the same keys.
template <int kBlockN, int kHeadDim, int kStages, typename StageTile>
__device__ __forceinline__ void load_key_blocks(const StageBarriers<kStages>& barriers, StageTile stage_tile,
                                                const CUtensorMap* k, const CUtensorMap* v, int column, int row0,
                                                int key_blocks) {
  using KeyTile = WarpgroupTile<kBlockN, kHeadDim>;
  for (int block = 0; block < key_blocks; ++block) {
    barriers.wait_empty(block);
    core::mbar_arrive_expect_tx(barriers.full(block), 2 * KeyTile::kBytes);
    load_tile_tma<kBlockN, kHeadDim>(stage_tile(block), k, barriers.full(block), column, row0 + block * kBlockN);
    load_tile_tma<kBlockN, kHeadDim>(stage_tile(block) + KeyTile::kBytes, v, barriers.full(block), column,
                                     row0 + block * kBlockN);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: K and V in a ring of 3 stages.

struct ForwardMaps {
  ForwardArgs args;
  CUtensorMap q, k, v;
};

template <int kHeadDim, int kBlockN_>
struct ForwardTiles {
  static constexpr int kBlockM = 2 * kWarpgroupRows, kBlockN = kBlockN_, kStages = 3;
  using QTile = WarpgroupTile<kBlockM, kHeadDim>;
  using KeyTile = WarpgroupTile<kBlockN, kHeadDim>;
  static constexpr std::uint32_t kStageBytes = 2 * KeyTile::kBytes;  // K, then V
  static constexpr std::uint32_t kBarrierOffset = QTile::kBytes + kStages * kStageBytes;
  static constexpr std::size_t kSmemBytes = 1024 + kBarrierOffset + StageBarriers<kStages>::kBytes;
};

// kPingpong: the two warpgroups take turns issuing their products (named barrier 3 + w is
// warpgroup w's turn; each hands the turn over once its products are issued), so that one's
// softmax runs while the other's products keep the tensor cores busy.
template <int kHeadDim, int kBlockN_, bool kPingpong>
__global__ void __launch_bounds__(kLoadingThreads, 1)
    attention_forward_wgmma_kernel(const __grid_constant__ ForwardMaps maps) {
#ifdef LLMTRAIN_WGMMA  // TMA, mbarrier transactions, setmaxnreg and wgmma need sm_90a
  using Tiles = ForwardTiles<kHeadDim, kBlockN_>;
  using QTile = typename Tiles::QTile;
  using KeyTile = typename Tiles::KeyTile;
  constexpr int kBlockM = Tiles::kBlockM, kBlockN = Tiles::kBlockN;
  const ForwardArgs& args = maps.args;

  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* q_generic = nullptr;
  const std::uint32_t q_tile = aligned_shared_base(smem, &q_generic);
  auto k_tile = [&](int block) {
    return q_tile + QTile::kBytes + static_cast<std::uint32_t>(block % Tiles::kStages) * Tiles::kStageBytes;
  };
  auto v_tile = [&](int block) { return k_tile(block) + KeyTile::kBytes; };
  const StageBarriers<Tiles::kStages> barriers{q_tile + Tiles::kBarrierOffset};
  barriers.init(1);
  __syncthreads();

  const int seq = args.seq;
  const int q_start = (static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x)) * kBlockM;
  const int head = static_cast<int>(blockIdx.y), kv_head = head / args.group;
  const int batch = static_cast<int>(blockIdx.z);
  const int key_blocks = (min(q_start + kBlockM, seq) - 1) / kBlockN + 1;

  const int role = warpgroup_role();
  if (role == kThreads / 128) {  // the loading warpgroup: its first thread issues every copy
    lower_registers<kForwardProducerRegisters>();
    if (threadIdx.x == kThreads) {
      const int row0 = batch * seq;  // the sequence's first token row
      core::mbar_arrive_expect_tx(barriers.once(), QTile::kBytes);
      load_tile_tma<kBlockM, kHeadDim>(q_tile, &maps.q, barriers.once(), head * kHeadDim, row0 + q_start);
      load_key_blocks<kBlockN, kHeadDim>(barriers, k_tile, &maps.k, &maps.v, kv_head * kHeadDim, row0, key_blocks);
    }
    return;
  }
  raise_registers<kForwardConsumerRegisters>();

  const int warpgroup = role;
  const int warp = static_cast<int>(threadIdx.x) % 128 / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int row0 = warpgroup * kWarpgroupRows;  // this warpgroup's first row within the tile
  const int first_row = q_start + row0;
  const int thread_row = first_row + 16 * warp + lane / 4;  // this thread's rows: + 0 and + 8
  const int thread_column = 2 * (lane % 4);

  float o[kHeadDim / 2];
  set_zero(o);
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  std::uint32_t p[kBlockN / 16][4];  // P of the previous block, the A operand of its P V

  auto issue_pv = [&](int j) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      gpu::wgmma_rs_mn<kHeadDim>(o, p[kk], KeyTile::mn_major(v_tile(j), 16 * kk), true);
    }
    gpu::wgmma_commit();
  };

  constexpr int kTurnBarrier = 3, kTurnThreads = 2 * 128;  // barriers 1 and 2: store_warpgroup_rows
  if constexpr (kPingpong) {
    if (warpgroup == 1) barrier_arrive(kTurnBarrier, kTurnThreads);  // warpgroup 0 goes first
  }
  core::mbar_wait(barriers.once(), 0);
  for (int block = 0; block < key_blocks; ++block) {
    barriers.wait_full(block);
    const int key0 = block * kBlockN;

    float s[kBlockN / 2];  // the first product overwrites it
    if constexpr (kPingpong) barrier_sync(kTurnBarrier + warpgroup, kTurnThreads);
    gpu::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      gpu::wgmma_ss<kBlockN>(s, QTile::k_major(q_tile, row0, ks), KeyTile::k_major(k_tile(block), 0, ks), ks > 0);
    }
    gpu::wgmma_commit();
    if (block > 0) {
      issue_pv(block - 1);
    } else {
      gpu::wgmma_commit();  // an empty group, so that the waits below count alike
    }
    // The other warpgroup's turn (the last hand-over of warpgroup 1 is left unmatched at exit).
    if constexpr (kPingpong) barrier_arrive(kTurnBarrier + 1 - warpgroup, kTurnThreads);
    gpu::wgmma_wait<1>();  // S landed; P V of the previous block may still run
    gpu::keep_in_registers(s);

    if (key0 + kBlockN - 1 > first_row) {  // the tile crosses the diagonal: mask key > query
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = thread_row + 8 * (e >> 1), key = key0 + 8 * j + thread_column + (e & 1);
          if (key > row) s[4 * j + e] = -INFINITY;
        }
      }
    }

    float rescale[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) tile_max = fmaxf(tile_max, fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max[i], tile_max * args.scale_log2);
      const float shift = new_max == -INFINITY ? 0.0f : new_max;
      rescale[i] = fast_exp2(row_max[i] - shift);
      row_max[i] = new_max;
      float sum = row_sum[i] * rescale[i];
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float probability = fast_exp2(fmaf(s[4 * j + 2 * i + c], args.scale_log2, -shift));
          s[4 * j + 2 * i + c] = probability;
          sum += probability;
        }
      }
      row_sum[i] = sum;
    }

    gpu::wgmma_wait<0>();  // P V of the previous block landed: O, P and its stage are free
    gpu::keep_in_registers(o);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) gpu::keep_in_registers(p[kk]);
    if (block > 0) barriers.release(block - 1);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        o[4 * j + 2 * i] *= rescale[i];
        o[4 * j + 2 * i + 1] *= rescale[i];
      }
    }
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) accumulators_to_fragment(p[kk], s, kk);
  }
  gpu::wgmma_fence();
  issue_pv(key_blocks - 1);
  gpu::wgmma_wait<0>();
  gpu::keep_in_registers(o);
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) gpu::keep_in_registers(p[kk]);

  const std::int64_t batch_row = static_cast<std::int64_t>(batch) * seq;
  const std::int64_t lse_row0 = (static_cast<std::int64_t>(batch) * args.q_heads + head) * seq;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float sum = row_sum[i];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inverse = 1.0f / sum;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      o[4 * j + 2 * i] *= inverse;
      o[4 * j + 2 * i + 1] *= inverse;
    }
    const int row = thread_row + 8 * i;
    if (lane % 4 == 0 && row < seq) args.lse[lse_row0 + row] = (row_max[i] + log2f(sum)) * kLn2;
  }
  const std::int64_t out_stride = static_cast<std::int64_t>(args.q_heads) * kHeadDim;
  store_warpgroup_rows<kBlockM, kHeadDim>(o, q_generic, row0,
                                          args.out + (batch_row + first_row) * out_stride + head * kHeadDim, out_stride,
                                          first_row, seq);
#else
  gpu::wgmma_trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// Backward: the two sides, their step tiles in rings of 3 stages.

struct BackwardMaps {
  BackwardArgs args;
  CUtensorMap q, k, v, dout;
};

// Key side: K and V of 128 keys loaded once; a stage holds Q and dO of 64 queries and their lse
// and D (written by the loading warpgroup's second warp; zeros past seq). Released once the dK
// product that read its Q has landed (during the next step).
template <int kHeadDim>
struct KeySideTiles {
  static constexpr int kBlockN = 2 * kWarpgroupRows, kBlockM = 64, kStages = 3;
  using KeyTile = WarpgroupTile<kBlockN, kHeadDim>;
  using RowTile = WarpgroupTile<kBlockM, kHeadDim>;
  static constexpr std::uint32_t kStageBytes = 2 * RowTile::kBytes;  // Q, then dO
  static constexpr std::uint32_t kStagesOffset = 2 * KeyTile::kBytes;
  static constexpr std::uint32_t kVectorsOffset = kStagesOffset + kStages * kStageBytes;  // lse, D a stage
  static constexpr std::uint32_t kBarrierOffset = kVectorsOffset + kStages * 2 * kBlockM * sizeof(float);
  static constexpr std::size_t kSmemBytes = 1024 + kBarrierOffset + StageBarriers<kStages>::kBytes;
};

template <int kHeadDim>
__device__ __forceinline__ void backward_key_block(const BackwardMaps& maps, int block_x, int block_y, int block_z) {
  using Tiles = KeySideTiles<kHeadDim>;
  constexpr int kBlockN = Tiles::kBlockN, kBlockM = Tiles::kBlockM;
  using KeyTile = typename Tiles::KeyTile;
  using RowTile = typename Tiles::RowTile;
  const BackwardArgs& args = maps.args;

  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* generic = nullptr;
  const std::uint32_t k_tile = aligned_shared_base(smem, &generic);
  const std::uint32_t v_tile = k_tile + KeyTile::kBytes;
  auto q_tile = [&](int step) {
    return k_tile + Tiles::kStagesOffset + static_cast<std::uint32_t>(step % Tiles::kStages) * Tiles::kStageBytes;
  };
  auto do_tile = [&](int step) { return q_tile(step) + RowTile::kBytes; };
  auto vectors = [&](int step) {  // lse of the step's queries, then their D
    return reinterpret_cast<float*>(generic + Tiles::kVectorsOffset) + (step % Tiles::kStages) * 2 * kBlockM;
  };
  const StageBarriers<Tiles::kStages> barriers{k_tile + Tiles::kBarrierOffset};
  barriers.init(1 + 32);  // the copies' thread, and the 32 lanes that write lse and D
  __syncthreads();

  const int seq = args.seq;
  const int key_start = block_x * kBlockN;
  const int kv_head = block_y;
  const int batch = block_z;
  const KeySteps<kBlockM> walk(key_start, seq, kv_head, args.group);
  const int steps = walk.count;
  const int lane = static_cast<int>(threadIdx.x) % 32;

  const int role = warpgroup_role();
  if (role == kThreads / 128) {
    lower_registers<kBackwardProducerRegisters>();
    const int loader_warp = __shfl_sync(0xffffffffu, (static_cast<int>(threadIdx.x) - kThreads) / 32, 0);
    const int row0 = batch * seq;  // the sequence's first token row
    if (loader_warp == 0) {
      if (lane == 0) {
        core::mbar_arrive_expect_tx(barriers.once(), 2 * KeyTile::kBytes);
        load_tile_tma<kBlockN, kHeadDim>(k_tile, &maps.k, barriers.once(), kv_head * kHeadDim, row0 + key_start);
        load_tile_tma<kBlockN, kHeadDim>(v_tile, &maps.v, barriers.once(), kv_head * kHeadDim, row0 + key_start);
        for (int step = 0; step < steps; ++step) {
          barriers.wait_empty(step);
          core::mbar_arrive_expect_tx(barriers.full(step), Tiles::kStageBytes);
          const int column = walk.head(step) * kHeadDim, row = row0 + walk.q_start(step);
          load_tile_tma<kBlockM, kHeadDim>(q_tile(step), &maps.q, barriers.full(step), column, row);
          load_tile_tma<kBlockM, kHeadDim>(do_tile(step), &maps.dout, barriers.full(step), column, row);
        }
      }
    } else if (loader_warp == 1) {
      for (int step = 0; step < steps; ++step) {
        barriers.wait_empty(step);
        const std::int64_t vector_row0 = (static_cast<std::int64_t>(batch) * args.q_heads + walk.head(step)) * seq;
        const int q_start = walk.q_start(step);
        float* lse_delta = vectors(step);
        for (int i = lane; i < kBlockM; i += 32) {
          const bool valid = q_start + i < seq;
          lse_delta[i] = valid ? args.lse_log2[vector_row0 + q_start + i] : 0.0f;
          lse_delta[kBlockM + i] = valid ? args.delta[vector_row0 + q_start + i] : 0.0f;
        }
        core::mbar_arrive(barriers.full(step));
      }
    }
    return;
  }
  raise_registers<kBackwardConsumerRegisters>();

  const int warpgroup = role;
  const int warp = static_cast<int>(threadIdx.x) % 128 / 32;
  const int key_row0 = warpgroup * kWarpgroupRows;  // this warpgroup's first key within the tile
  const int first_key = key_start + key_row0;
  const int thread_key = first_key + 16 * warp + lane / 4;  // this thread's keys: + 0 and + 8
  const int thread_column = 2 * (lane % 4);

  float dk[kHeadDim / 2], dv[kHeadDim / 2];
  set_zero(dk);
  set_zero(dv);
  std::uint32_t a_ds[kBlockM / 16][4];  // dS^T of the step whose dK product may still run

  core::mbar_wait(barriers.once(), 0);
  for (int step = 0; step < steps; ++step) {
    // Every warp waits for every stage, also one it skips: a stage is refilled only after all
    // eight warps released it, and a warp must not release a stage whose copies are in flight.
    barriers.wait_full(step);
    const int q_start = walk.q_start(step);
    if (first_key > q_start + kBlockM - 1) {  // every query precedes every key: P = 0
      gpu::wgmma_wait<0>();                   // the previous step's dK product
      if (step > 0) barriers.release(step - 1);
      continue;
    }
    const std::uint32_t q_step = q_tile(step), do_step = do_tile(step);
    const float* lse_stage = vectors(step);
    const float* delta_stage = lse_stage + kBlockM;

    float st[kBlockM / 2], dpt[kBlockM / 2];
    gpu::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      gpu::wgmma_ss<kBlockM>(st, KeyTile::k_major(k_tile, key_row0, ks), RowTile::k_major(q_step, 0, ks), ks > 0);
    }
    gpu::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      gpu::wgmma_ss<kBlockM>(dpt, KeyTile::k_major(v_tile, key_row0, ks), RowTile::k_major(do_step, 0, ks), ks > 0);
    }
    gpu::wgmma_commit();

    // S^T, dP^T and the previous step's dK product landed: that step's stage is free. Both scores
    // are formed before either product that reads them is issued, so that P^T and dS^T are never
    // live as accumulators and as fragments together (with both, 240 registers are too few and
    // ptxas serialises the products); the other warpgroup's products fill the tensor cores.
    gpu::wgmma_wait<0>();
    gpu::keep_in_registers(st);
    gpu::keep_in_registers(dpt);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) gpu::keep_in_registers(a_ds[kk]);
    if (step > 0) barriers.release(step - 1);
    // Masked: key > query, and queries at or past seq (the next sequence's rows, lse and D 0).
    const bool masked = first_key + kWarpgroupRows - 1 > q_start || q_start + kBlockM > seq;
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
      const float2 lse2 = *reinterpret_cast<const float2*>(lse_stage + 8 * j + thread_column);
      const float2 delta2 = *reinterpret_cast<const float2*>(delta_stage + 8 * j + thread_column);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = fast_exp2(fmaf(st[4 * j + e], args.scale_log2, -((e & 1) ? lse2.y : lse2.x)));
        if (masked) {
          const int key = thread_key + 8 * (e >> 1), query = q_start + 8 * j + thread_column + (e & 1);
          if (key > query || query >= seq) p = 0.0f;
        }
        st[4 * j + e] = p;
        dpt[4 * j + e] = p * (dpt[4 * j + e] - ((e & 1) ? delta2.y : delta2.x));
      }
    }
    // dV += P^T dO, then dK += dS^T Q, the latter left running under the next step's scores.
    std::uint32_t a_p[kBlockM / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      accumulators_to_fragment(a_p[kk], st, kk);
      accumulators_to_fragment(a_ds[kk], dpt, kk);
    }
    gpu::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      gpu::wgmma_rs_mn<kHeadDim>(dv, a_p[kk], RowTile::mn_major(do_step, 16 * kk), true);
    }
    gpu::wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      gpu::wgmma_rs_mn<kHeadDim>(dk, a_ds[kk], RowTile::mn_major(q_step, 16 * kk), true);
    }
    gpu::wgmma_commit();
    gpu::wgmma_wait<1>();  // dV landed
    gpu::keep_in_registers(dv);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) gpu::keep_in_registers(a_p[kk]);
  }
  gpu::wgmma_wait<0>();
  gpu::keep_in_registers(dk);
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk) gpu::keep_in_registers(a_ds[kk]);

#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dk[i] *= args.scale;
  const std::int64_t key_row_global = static_cast<std::int64_t>(batch) * seq + first_key;
  store_warpgroup_rows<kBlockN, kHeadDim>(dk, generic, key_row0,
                                          args.dk + key_row_global * args.dk_stride + kv_head * kHeadDim,
                                          args.dk_stride, first_key, seq);
  store_warpgroup_rows<kBlockN, kHeadDim>(dv, generic + KeyTile::kBytes, key_row0,
                                          args.dv + key_row_global * args.dv_stride + kv_head * kHeadDim,
                                          args.dv_stride, first_key, seq);
}

// Query side: Q and dO of 128 queries loaded once; a stage holds K and V of 64 keys, released
// once the dQ product that read its K has landed (during the next block).
template <int kHeadDim>
struct QuerySideTiles {
  static constexpr int kBlockM = 2 * kWarpgroupRows, kBlockN = 64, kStages = 3;
  using RowTile = WarpgroupTile<kBlockM, kHeadDim>;
  using KeyTile = WarpgroupTile<kBlockN, kHeadDim>;
  static constexpr std::uint32_t kStageBytes = 2 * KeyTile::kBytes;  // K, then V
  static constexpr std::uint32_t kBarrierOffset = 2 * RowTile::kBytes + kStages * kStageBytes;
  static constexpr std::size_t kSmemBytes = 1024 + kBarrierOffset + StageBarriers<kStages>::kBytes;
};

template <int kHeadDim>
__device__ __forceinline__ void backward_query_block(const BackwardMaps& maps, int block_x, int block_y, int block_z,
                                                     int grid_x) {
  using Tiles = QuerySideTiles<kHeadDim>;
  constexpr int kBlockM = Tiles::kBlockM, kBlockN = Tiles::kBlockN;
  using RowTile = typename Tiles::RowTile;
  using KeyTile = typename Tiles::KeyTile;
  const BackwardArgs& args = maps.args;

  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* generic = nullptr;
  const std::uint32_t q_tile = aligned_shared_base(smem, &generic);
  const std::uint32_t do_tile = q_tile + RowTile::kBytes;
  auto k_tile = [&](int block) {
    return q_tile + 2 * RowTile::kBytes + static_cast<std::uint32_t>(block % Tiles::kStages) * Tiles::kStageBytes;
  };
  auto v_tile = [&](int block) { return k_tile(block) + KeyTile::kBytes; };
  const StageBarriers<Tiles::kStages> barriers{q_tile + Tiles::kBarrierOffset};
  barriers.init(1);
  __syncthreads();

  const int seq = args.seq;
  const int q_start = (grid_x - 1 - block_x) * kBlockM;
  const int head = block_y, kv_head = head / args.group;
  const int batch = block_z;
  const int key_blocks = (min(q_start + kBlockM, seq) - 1) / kBlockN + 1;
  const int lane = static_cast<int>(threadIdx.x) % 32;

  const int role = warpgroup_role();
  if (role == kThreads / 128) {
    lower_registers<kBackwardProducerRegisters>();
    if (threadIdx.x == kThreads) {
      const int row0 = batch * seq;
      core::mbar_arrive_expect_tx(barriers.once(), 2 * RowTile::kBytes);
      load_tile_tma<kBlockM, kHeadDim>(q_tile, &maps.q, barriers.once(), head * kHeadDim, row0 + q_start);
      load_tile_tma<kBlockM, kHeadDim>(do_tile, &maps.dout, barriers.once(), head * kHeadDim, row0 + q_start);
      load_key_blocks<kBlockN, kHeadDim>(barriers, k_tile, &maps.k, &maps.v, kv_head * kHeadDim, row0, key_blocks);
    }
    return;
  }
  raise_registers<kBackwardConsumerRegisters>();

  const int warpgroup = role;
  const int warp = static_cast<int>(threadIdx.x) % 128 / 32;
  const int row0 = warpgroup * kWarpgroupRows;
  const int first_row = q_start + row0;
  const int thread_row = first_row + 16 * warp + lane / 4;  // this thread's rows: + 0 and + 8
  const int thread_column = 2 * (lane % 4);
  const std::int64_t vector_row0 = (static_cast<std::int64_t>(batch) * args.q_heads + head) * seq;
  float lse_row[2], delta_row[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = thread_row + 8 * i;
    lse_row[i] = row < seq ? args.lse_log2[vector_row0 + row] : 0.0f;
    delta_row[i] = row < seq ? args.delta[vector_row0 + row] : 0.0f;
  }

  float dq[kHeadDim / 2];
  set_zero(dq);
  std::uint32_t a_ds[kBlockN / 16][4];  // dS of the block whose dQ product may still run

  core::mbar_wait(barriers.once(), 0);
  for (int block = 0; block < key_blocks; ++block) {
    barriers.wait_full(block);  // also by a warp that skips it (see the key side)
    const int key0 = block * kBlockN;
    if (key0 > first_row + kWarpgroupRows - 1) {  // every key follows every row of the warpgroup
      gpu::wgmma_wait<0>();                       // the previous block's dQ product
      if (block > 0) barriers.release(block - 1);
      continue;
    }

    float s[kBlockN / 2], dp[kBlockN / 2];
    gpu::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      gpu::wgmma_ss<kBlockN>(s, RowTile::k_major(q_tile, row0, ks), KeyTile::k_major(k_tile(block), 0, ks), ks > 0);
    }
    gpu::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      gpu::wgmma_ss<kBlockN>(dp, RowTile::k_major(do_tile, row0, ks), KeyTile::k_major(v_tile(block), 0, ks), ks > 0);
    }
    gpu::wgmma_commit();

    gpu::wgmma_wait<1>();  // S, and the previous block's dQ product: its stage is free
    gpu::keep_in_registers(s);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) gpu::keep_in_registers(a_ds[kk]);
    if (block > 0) barriers.release(block - 1);
    const bool crosses_diagonal = key0 + kBlockN - 1 > first_row;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = fast_exp2(fmaf(s[4 * j + e], args.scale_log2, -lse_row[e >> 1]));
        if (crosses_diagonal) {
          const int row = thread_row + 8 * (e >> 1), key = key0 + 8 * j + thread_column + (e & 1);
          if (key > row) p = 0.0f;
        }
        s[4 * j + e] = p;
      }
    }
    gpu::wgmma_wait<0>();
    gpu::keep_in_registers(dp);
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - delta_row[e >> 1]);
    }
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) accumulators_to_fragment(a_ds[kk], dp, kk);
    gpu::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      gpu::wgmma_rs_mn<kHeadDim>(dq, a_ds[kk], KeyTile::mn_major(k_tile(block), 16 * kk), true);
    }
    gpu::wgmma_commit();
  }
  gpu::wgmma_wait<0>();
  gpu::keep_in_registers(dq);
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) gpu::keep_in_registers(a_ds[kk]);

#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dq[i] *= args.scale;
  store_warpgroup_rows<kBlockM, kHeadDim>(
      dq, generic, row0,
      args.dq + (static_cast<std::int64_t>(batch) * seq + first_row) * args.dq_stride + head * kHeadDim, args.dq_stride,
      first_row, seq);
}

}  // namespace hopper
