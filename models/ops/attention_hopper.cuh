// The Hopper (sm_90a) tile bodies of attention.cu: the same causal GQA forward and deterministic
// two-sided backward, with every product a warpgroup wgmma (models/ops/wgmma.cuh) reading its
// shared-memory operands through descriptors instead of ldmatrix into registers, so a block of two
// warpgroups keeps 64 x N x 16 products in flight per instruction where mma.sync issues 16 x 8 x 16
// per warp. Included by attention.cu only, inside its namespace, after its primitives (cp.async
// copies, named barriers, fast_exp2) and argument structs.
//
// Tiles: [rows, head_dim] bf16 as head_dim / 64 swizzled 64-column tiles one after the other, each
// 1024-byte aligned (WarpgroupTile). A product reads a tile K-major (Q K^T: rows are M or N, columns
// the head_dim sum) or MN-major (P V: rows are the key sum, columns the head_dim outputs), so V, Q
// and dO never need a transposed copy.
//
// Forward: a block owns 128 query rows of one (batch, head), a warpgroup 64 of them; over key tiles
// up to the diagonal (loaded a block ahead by cp.async): S = Q K^T (wgmma, A and B from shared
// memory), the online softmax on the accumulators, O += P V with P from registers, that product
// one block behind so that it runs under the next block's softmax.
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

// Starts copies of rows [first_row, first_row + kRows) of one head (row r at head + r * stride)
// into a WarpgroupTile; rows at or past `seq` are zero-filled without reading memory.
template <int kRows, int kHeadDim>
__device__ __forceinline__ void load_tile_async(std::uint32_t tile, const std::uint16_t* head, std::int64_t stride,
                                                int first_row, int seq) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks a row
  constexpr int kRowsPerPass = kThreads / kChunks;
  static_assert(kRowsPerPass % 8 == 0 && kRows % kRowsPerPass == 0, "passes keep the swizzle phase");
  const int row = static_cast<int>(threadIdx.x) / kChunks, chunk = static_cast<int>(threadIdx.x) % kChunks;
  std::uint32_t dst = tile + static_cast<std::uint32_t>(chunk / 8) * (kRows * 128) +
                      static_cast<std::uint32_t>(row * 128 + (((chunk % 8) ^ (row & 7)) << 4));
  const std::uint16_t* src = head + (first_row + row) * stride + chunk * 8;
  int rows_left = seq - first_row - row;
#pragma unroll 1
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const bool valid = rows_left > 0;
    copy_16_async(dst, valid ? src : head, valid);
    dst += kRowsPerPass * 128;
    src += kRowsPerPass * stride;
    rows_left -= kRowsPerPass;
  }
}

// Copies landed and are visible to the tensor cores' reads, for every thread of the block.
__device__ __forceinline__ void tiles_ready() {
  wait_all_copies();
  gpu::fence_shared_for_wgmma();
  __syncthreads();
}

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

// ---------------------------------------------------------------------------------------------
// Forward

template <int kHeadDim, int kBlockN>
struct ForwardTiles {
  static constexpr int kBlockM = 2 * kWarpgroupRows;
  using QTile = WarpgroupTile<kBlockM, kHeadDim>;
  using KeyTile = WarpgroupTile<kBlockN, kHeadDim>;
  // K in two stages, V in three: P V of block j - 1 still reads its V while block j + 1 loads.
  static constexpr std::size_t kSmemBytes = 1024 + QTile::kBytes + 5 * KeyTile::kBytes;
};

// grid (query tiles, q_heads, batch), heaviest (last) query tiles first. Key block j's S = Q K^T is
// issued before block j - 1's O += P V, so the softmax of block j runs while the tensor cores do
// P V of block j - 1; O is rescaled to block j's row maxima once that product has landed.
template <int kHeadDim, int kBlockN>
__global__ void __launch_bounds__(kThreads, 1) attention_forward_wgmma_kernel(const ForwardArgs args) {
  using Tiles = ForwardTiles<kHeadDim, kBlockN>;
  using QTile = typename Tiles::QTile;
  using KeyTile = typename Tiles::KeyTile;
  constexpr int kBlockM = Tiles::kBlockM;

  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* q_generic = nullptr;
  const std::uint32_t q_tile = aligned_shared_base(smem, &q_generic);
  const std::uint32_t k_tiles = q_tile + QTile::kBytes;         // 2 stages
  const std::uint32_t v_tiles = k_tiles + 2 * KeyTile::kBytes;  // 3 stages

  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  const int warp = static_cast<int>(threadIdx.x) % 128 / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int seq = args.seq;
  const int q_start = (static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x)) * kBlockM;
  const int head = static_cast<int>(blockIdx.y), kv_head = head / args.group;
  const std::int64_t batch = blockIdx.z, batch_row = batch * seq;
  const std::uint16_t* k_head = args.k + batch_row * args.k_stride + kv_head * kHeadDim;
  const std::uint16_t* v_head = args.v + batch_row * args.v_stride + kv_head * kHeadDim;

  load_tile_async<kBlockM, kHeadDim>(q_tile, args.q + batch_row * args.q_stride + head * kHeadDim, args.q_stride,
                                     q_start, seq);
  load_tile_async<kBlockN, kHeadDim>(k_tiles, k_head, args.k_stride, 0, seq);
  load_tile_async<kBlockN, kHeadDim>(v_tiles, v_head, args.v_stride, 0, seq);
  commit_copies();

  const int row0 = warpgroup * kWarpgroupRows;  // this warpgroup's first row within the tile
  const int first_row = q_start + row0;
  const int thread_row = first_row + 16 * warp + lane / 4;  // this thread's rows: + 0 and + 8
  const int thread_column = 2 * (lane % 4);
  const int key_blocks = (min(q_start + kBlockM, seq) - 1) / kBlockN + 1;
  // Both warpgroups take every key block, also one whose keys all follow the first warpgroup's rows
  // (kBlockN < kBlockM): its P is 0, and no product sits on a branch that depends on the warpgroup
  // (ptxas would serialise the wgmma instructions).
  auto v_tile = [&](int j) { return v_tiles + static_cast<std::uint32_t>(j % 3) * KeyTile::kBytes; };

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

  for (int block = 0; block < key_blocks; ++block) {
    tiles_ready();  // block's K and V; every warpgroup is done with K of block - 1 and V of block - 2
    if (block + 1 < key_blocks) {
      load_tile_async<kBlockN, kHeadDim>(k_tiles + ((block + 1) & 1) * KeyTile::kBytes, k_head, args.k_stride,
                                         (block + 1) * kBlockN, seq);
      load_tile_async<kBlockN, kHeadDim>(v_tile(block + 1), v_head, args.v_stride, (block + 1) * kBlockN, seq);
      commit_copies();
    }
    const int key0 = block * kBlockN;
    const std::uint32_t k_tile = k_tiles + (block & 1) * KeyTile::kBytes;

    float s[kBlockN / 2];  // the first product overwrites it
    gpu::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      gpu::wgmma_ss<kBlockN>(s, QTile::k_major(q_tile, row0, ks), KeyTile::k_major(k_tile, 0, ks), ks > 0);
    }
    gpu::wgmma_commit();
    if (block > 0) {
      issue_pv(block - 1);
    } else {
      gpu::wgmma_commit();  // an empty group, so that the waits below count alike
    }
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

    // Online softmax: a row lives in one quad (4 lanes), 2 rows a thread.
    float rescale[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) tile_max = fmaxf(tile_max, fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max[i], tile_max * args.scale_log2);
      // A row with every key so far masked keeps max -inf; its probabilities are all 0.
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

    gpu::wgmma_wait<0>();  // P V of the previous block landed: O and P are free
    gpu::keep_in_registers(o);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) gpu::keep_in_registers(p[kk]);
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

  // Normalise, write lse and the output rows (through this warpgroup's rows of the Q tile).
  const std::int64_t lse_row0 = (batch * args.q_heads + head) * seq;
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
}

// ---------------------------------------------------------------------------------------------
// Backward

// The key side's tiles: K and V of 128 keys; Q in three stages (dK += dS^T Q of step n - 1 still
// reads its Q while step n + 1 loads), dO in two, lse and D of 64 queries in two.
template <int kHeadDim>
struct KeySideTiles {
  static constexpr int kBlockN = 2 * kWarpgroupRows, kBlockM = 64, kQStages = 3, kStages = 2;
  using KeyTile = WarpgroupTile<kBlockN, kHeadDim>;
  using RowTile = WarpgroupTile<kBlockM, kHeadDim>;
  static constexpr std::size_t kSmemBytes =
      1024 + 2 * KeyTile::kBytes + (kQStages + kStages) * RowTile::kBytes + 2 * kStages * kBlockM * sizeof(float);
};

// Key side: grid (key tiles of 128, kv_heads, batch), lowest (heaviest) key tiles first.
template <int kHeadDim>
__device__ __forceinline__ void backward_key_block(const BackwardArgs& args, int block_x, int block_y, int block_z) {
  using Tiles = KeySideTiles<kHeadDim>;
  constexpr int kBlockN = Tiles::kBlockN, kBlockM = Tiles::kBlockM;
  using KeyTile = typename Tiles::KeyTile;
  using RowTile = typename Tiles::RowTile;

  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* generic = nullptr;
  const std::uint32_t k_tile = aligned_shared_base(smem, &generic);
  const std::uint32_t v_tile = k_tile + KeyTile::kBytes;
  const std::uint32_t q_tiles = v_tile + KeyTile::kBytes;
  const std::uint32_t do_tiles = q_tiles + Tiles::kQStages * RowTile::kBytes;
  const std::uint32_t lse_vectors = do_tiles + Tiles::kStages * RowTile::kBytes;
  const std::uint32_t delta_vectors = lse_vectors + Tiles::kStages * kBlockM * 4;
  const float* lse_shared = reinterpret_cast<const float*>(generic + (lse_vectors - k_tile));
  const float* delta_shared = reinterpret_cast<const float*>(generic + (delta_vectors - k_tile));

  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  const int warp = static_cast<int>(threadIdx.x) % 128 / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int seq = args.seq;
  const int key_start = block_x * kBlockN;
  const int kv_head = block_y;
  const std::int64_t batch = block_z, batch_row = batch * seq;
  const std::int64_t dout_stride = static_cast<std::int64_t>(args.q_heads) * kHeadDim;

  const KeySteps<kBlockM> walk(key_start, seq, kv_head, args.group);
  const int steps = walk.count;

  auto q_tile = [&](int step) {
    return q_tiles + static_cast<std::uint32_t>(step % Tiles::kQStages) * RowTile::kBytes;
  };
  auto load_step = [&](int step) {
    const int stage = step & 1;
    const int head = walk.head(step);
    const int q_start = walk.q_start(step);
    const std::int64_t vector_row0 = (batch * args.q_heads + head) * seq;
    load_tile_async<kBlockM, kHeadDim>(q_tile(step), args.q + batch_row * args.q_stride + head * kHeadDim,
                                       args.q_stride, q_start, seq);
    load_tile_async<kBlockM, kHeadDim>(do_tiles + stage * RowTile::kBytes,
                                       args.dout + batch_row * dout_stride + head * kHeadDim, dout_stride, q_start,
                                       seq);
    load_floats_async<kBlockM, kThreads>(lse_vectors + stage * kBlockM * 4, args.lse_log2 + vector_row0, q_start, seq);
    load_floats_async<kBlockM, kThreads>(delta_vectors + stage * kBlockM * 4, args.delta + vector_row0, q_start, seq);
  };

  load_tile_async<kBlockN, kHeadDim>(k_tile, args.k + batch_row * args.k_stride + kv_head * kHeadDim, args.k_stride,
                                     key_start, seq);
  load_tile_async<kBlockN, kHeadDim>(v_tile, args.v + batch_row * args.v_stride + kv_head * kHeadDim, args.v_stride,
                                     key_start, seq);
  load_step(0);
  commit_copies();

  const int key_row0 = warpgroup * kWarpgroupRows;  // this warpgroup's first key within the tile
  const int first_key = key_start + key_row0;
  const int thread_key = first_key + 16 * warp + lane / 4;  // this thread's keys: + 0 and + 8
  const int thread_column = 2 * (lane % 4);

  float dk[kHeadDim / 2], dv[kHeadDim / 2];
  set_zero(dk);
  set_zero(dv);
  std::uint32_t a_ds[kBlockM / 16][4];  // dS^T of the step whose dK product may still run

  for (int step = 0; step < steps; ++step) {
    const int stage = step & 1;
    tiles_ready();  // this step's tiles; every warpgroup is done with step - 1's dO, step - 2's Q
    if (step + 1 < steps) {
      load_step(step + 1);
      commit_copies();
    }
    const int q_start = walk.q_start(step);
    if (first_key > q_start + kBlockM - 1) {  // every query precedes every key: P = 0
      gpu::wgmma_wait<0>();                   // the previous step's dK product
      continue;
    }
    const std::uint32_t q_step = q_tile(step);
    const std::uint32_t do_tile = do_tiles + stage * RowTile::kBytes;
    const float* lse_stage = lse_shared + stage * kBlockM;
    const float* delta_stage = delta_shared + stage * kBlockM;

    // S^T = K Q^T and dP^T = V dO^T for the warpgroup's 64 keys x 64 queries (the first k-step of
    // each overwrites its accumulators).
    float st[kBlockM / 2], dpt[kBlockM / 2];
    gpu::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      gpu::wgmma_ss<kBlockM>(st, KeyTile::k_major(k_tile, key_row0, ks), RowTile::k_major(q_step, 0, ks), ks > 0);
    }
    gpu::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      gpu::wgmma_ss<kBlockM>(dpt, KeyTile::k_major(v_tile, key_row0, ks), RowTile::k_major(do_tile, 0, ks), ks > 0);
    }
    gpu::wgmma_commit();

    // P^T = exp2(S^T scale log2e - lse log2e), zero where key > query, while dP^T is computed (the
    // previous step's dK product, issued before S^T, has landed).
    gpu::wgmma_wait<1>();
    gpu::keep_in_registers(st);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) gpu::keep_in_registers(a_ds[kk]);
    const bool crosses_diagonal = first_key + kWarpgroupRows - 1 > q_start;
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
      const float2 lse2 = *reinterpret_cast<const float2*>(lse_stage + 8 * j + thread_column);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p = fast_exp2(fmaf(st[4 * j + e], args.scale_log2, -((e & 1) ? lse2.y : lse2.x)));
        if (crosses_diagonal) {
          const int key = thread_key + 8 * (e >> 1), query = q_start + 8 * j + thread_column + (e & 1);
          if (key > query) p = 0.0f;
        }
        st[4 * j + e] = p;
      }
    }
    // dV += P^T dO, while dS^T = P^T (dP^T - D) is formed.
    std::uint32_t a_p[kBlockM / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) accumulators_to_fragment(a_p[kk], st, kk);
    gpu::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      gpu::wgmma_rs_mn<kHeadDim>(dv, a_p[kk], RowTile::mn_major(do_tile, 16 * kk), true);
    }
    gpu::wgmma_commit();
    gpu::wgmma_wait<1>();
    gpu::keep_in_registers(dpt);
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j) {
      const float2 delta2 = *reinterpret_cast<const float2*>(delta_stage + 8 * j + thread_column);
#pragma unroll
      for (int e = 0; e < 4; ++e) dpt[4 * j + e] = st[4 * j + e] * (dpt[4 * j + e] - ((e & 1) ? delta2.y : delta2.x));
    }
    // dK += dS^T Q, left running under the next step's S^T and dP^T.
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) accumulators_to_fragment(a_ds[kk], dpt, kk);
    gpu::wgmma_fence();
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

    // dK = scale * sum dS^T Q. Each warpgroup writes through its own rows of the K and V tiles.
#pragma unroll
  for (int i = 0; i < kHeadDim / 2; ++i) dk[i] *= args.scale;
  const std::int64_t key_row_global = batch_row + first_key;
  store_warpgroup_rows<kBlockN, kHeadDim>(dk, generic, key_row0,
                                          args.dk + key_row_global * args.dk_stride + kv_head * kHeadDim,
                                          args.dk_stride, first_key, seq);
  store_warpgroup_rows<kBlockN, kHeadDim>(dv, generic + KeyTile::kBytes, key_row0,
                                          args.dv + key_row_global * args.dv_stride + kv_head * kHeadDim,
                                          args.dv_stride, first_key, seq);
}

// The query side's tiles: Q and dO of 128 queries; K in three stages (dQ += dS K of block j - 1
// still reads its K while block j + 1 loads), V in two.
template <int kHeadDim>
struct QuerySideTiles {
  static constexpr int kBlockM = 2 * kWarpgroupRows, kBlockN = 64, kKStages = 3, kStages = 2;
  using RowTile = WarpgroupTile<kBlockM, kHeadDim>;
  using KeyTile = WarpgroupTile<kBlockN, kHeadDim>;
  static constexpr std::size_t kSmemBytes = 1024 + 2 * RowTile::kBytes + (kKStages + kStages) * KeyTile::kBytes;
};

// Query side: grid (query tiles of 128, q_heads, batch), heaviest (last) tiles first.
template <int kHeadDim>
__device__ __forceinline__ void backward_query_block(const BackwardArgs& args, int block_x, int block_y, int block_z,
                                                     int grid_x) {
  using Tiles = QuerySideTiles<kHeadDim>;
  constexpr int kBlockM = Tiles::kBlockM, kBlockN = Tiles::kBlockN;
  using RowTile = typename Tiles::RowTile;
  using KeyTile = typename Tiles::KeyTile;

  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* generic = nullptr;
  const std::uint32_t q_tile = aligned_shared_base(smem, &generic);
  const std::uint32_t do_tile = q_tile + RowTile::kBytes;
  const std::uint32_t k_tiles = do_tile + RowTile::kBytes;
  const std::uint32_t v_tiles = k_tiles + Tiles::kKStages * KeyTile::kBytes;
  auto k_tile = [&](int j) { return k_tiles + static_cast<std::uint32_t>(j % Tiles::kKStages) * KeyTile::kBytes; };

  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  const int warp = static_cast<int>(threadIdx.x) % 128 / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int seq = args.seq;
  const int q_start = (grid_x - 1 - block_x) * kBlockM;
  const int head = block_y, kv_head = head / args.group;
  const std::int64_t batch = block_z, batch_row = batch * seq;
  const std::int64_t dout_stride = static_cast<std::int64_t>(args.q_heads) * kHeadDim;
  const std::uint16_t* k_head = args.k + batch_row * args.k_stride + kv_head * kHeadDim;
  const std::uint16_t* v_head = args.v + batch_row * args.v_stride + kv_head * kHeadDim;

  load_tile_async<kBlockM, kHeadDim>(q_tile, args.q + batch_row * args.q_stride + head * kHeadDim, args.q_stride,
                                     q_start, seq);
  load_tile_async<kBlockM, kHeadDim>(do_tile, args.dout + batch_row * dout_stride + head * kHeadDim, dout_stride,
                                     q_start, seq);
  load_tile_async<kBlockN, kHeadDim>(k_tiles, k_head, args.k_stride, 0, seq);
  load_tile_async<kBlockN, kHeadDim>(v_tiles, v_head, args.v_stride, 0, seq);
  commit_copies();

  const int row0 = warpgroup * kWarpgroupRows;
  const int first_row = q_start + row0;
  const int thread_row = first_row + 16 * warp + lane / 4;  // this thread's rows: + 0 and + 8
  const int thread_column = 2 * (lane % 4);
  const std::int64_t vector_row0 = (batch * args.q_heads + head) * seq;
  float lse_row[2], delta_row[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = thread_row + 8 * i;
    lse_row[i] = row < seq ? args.lse_log2[vector_row0 + row] : 0.0f;
    delta_row[i] = row < seq ? args.delta[vector_row0 + row] : 0.0f;
  }
  const int key_blocks = (min(q_start + kBlockM, seq) - 1) / kBlockN + 1;

  float dq[kHeadDim / 2];
  set_zero(dq);
  std::uint32_t a_ds[kBlockN / 16][4];  // dS of the block whose dQ product may still run

  for (int block = 0; block < key_blocks; ++block) {
    const int stage = block & 1;
    tiles_ready();  // this block's K and V; every warpgroup is done with V of block - 1, K of block - 2
    if (block + 1 < key_blocks) {
      load_tile_async<kBlockN, kHeadDim>(k_tile(block + 1), k_head, args.k_stride, (block + 1) * kBlockN, seq);
      load_tile_async<kBlockN, kHeadDim>(v_tiles + (stage ^ 1) * KeyTile::kBytes, v_head, args.v_stride,
                                         (block + 1) * kBlockN, seq);
      commit_copies();
    }
    const int key0 = block * kBlockN;
    if (key0 > first_row + kWarpgroupRows - 1) {  // every key follows every row of the warpgroup
      gpu::wgmma_wait<0>();                       // the previous block's dQ product
      continue;
    }
    const std::uint32_t v_tile = v_tiles + stage * KeyTile::kBytes;

    // S = Q K^T and dP = dO V^T for the warpgroup's 64 rows x 64 keys (the first k-step of each
    // overwrites its accumulators).
    float s[kBlockN / 2], dp[kBlockN / 2];
    gpu::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      gpu::wgmma_ss<kBlockN>(s, RowTile::k_major(q_tile, row0, ks), KeyTile::k_major(k_tile(block), 0, ks), ks > 0);
    }
    gpu::wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      gpu::wgmma_ss<kBlockN>(dp, RowTile::k_major(do_tile, row0, ks), KeyTile::k_major(v_tile, 0, ks), ks > 0);
    }
    gpu::wgmma_commit();

    // P = exp2(S scale log2e - lse log2e) and 0 where key > query, while dP is computed (and the
    // previous block's dQ product has landed: it was issued before S).
    gpu::wgmma_wait<1>();
    gpu::keep_in_registers(s);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) gpu::keep_in_registers(a_ds[kk]);
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
    // dS = P (dP - D).
    gpu::wgmma_wait<0>();
    gpu::keep_in_registers(dp);
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - delta_row[e >> 1]);
    }

    // dQ += dS K, left running under the next block's S and dP.
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
  store_warpgroup_rows<kBlockM, kHeadDim>(dq, generic, row0,
                                          args.dq + (batch_row + first_row) * args.dq_stride + head * kHeadDim,
                                          args.dq_stride, first_row, seq);
}

}  // namespace hopper
