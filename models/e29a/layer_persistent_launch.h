// What the host side of the persistent E29a kernels (layer_persistent.cu) and the kernels' files
// (layer_persistent_kernels.cuh, instantiated per slot capacity by layer_persistent_n*.cu) share:
// the block shape, a block's shared-memory layout, the launch geometry and the launchers.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "models/e29a/layer_persistent.h"

namespace models::e29a::kernels::persistent {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileRows = 16;                     // rows of a warp pass (an mma's 16 rows)
constexpr int kGroup = 8;                         // sequences of a warp pass (an mma's 8 columns)
constexpr int kStep = 16;                         // features of an mma k-step
constexpr int kTileSums = kTileRows * kGroup;     // sums a warp pass finishes (the rows phase's reduce slots)
constexpr int kMaxTiles = 8;                      // at most 128 rows a block
constexpr int kMaxFeatures = 4;                   // features a thread owns in the sequence phase: D <= 1024
constexpr int kMaxDim = kMaxFeatures * kThreads;  // the widest layer the kernels take
constexpr int kMaxCluster = 4;                    // blocks one sequence spreads over (a thread-block cluster)
constexpr int kMaxBatchParts = 2;                 // blocks a row block's rows phase spreads over

// The sequence phase's shared scratch (SeqShared in layer_persistent_kernels.cuh), in floats: the
// cluster exchange's two mbarriers (kExchangeWords), every warp's lane sums of up to 4 x max_n
// values (max_n is 8 at least, so one whole chunk of 32), their block sums [4][max_n], two
// attentions' weights and score gradients [2][max_n] each, and the exchange's two alternating
// inboxes: every rank's block sums [kMaxCluster][4 max_n] and its verdict [kMaxCluster].
constexpr int kExchangeWords = 4;
constexpr int seq_warp_stride(int max_n) { return 4 * max_n; }
constexpr std::size_t seq_shared_floats(int max_n) {
  return static_cast<std::size_t>(kExchangeWords + kWarps * seq_warp_stride(max_n) + 8 * max_n +
                                  2 * kMaxCluster * (seq_warp_stride(max_n) + 1));
}

// A block's rows of the stacked matrix it keeps in shared memory: rows [0, split) take the first
// input vector, rows from split the second (split = D forward; the backward pads it to whole
// tiles so no tile takes both); a row holds ld columns, D rounded up to whole mma k-steps.
//
// The rows phase's work is split over row blocks of rows_per_block rows and, within a row block,
// over `batch_parts` blocks, each multiplying the rows by its part of the batch: with 2 parts a
// block keeps twice the rows and reads half of the state a step (the grid's reads from L2 halve).
//
// A sequence's features are split over `cluster` blocks (a thread-block cluster; 1: one block),
// which exchange their slot sums through distributed shared memory.
struct Layout {
  int rows_per_block = 0, tiles = 0, ld = 0, split = 0, cluster = 1, batch_parts = 1, row_blocks = 0;
  std::size_t weight_bytes = 0, reduce_bytes = 0, step_bytes = 0;
};

struct Device {
  int sms = 0, smem_optin = 0, cooperative = 0;
};

enum class Direction { forward, backward };

inline const char* direction_name(Direction direction) {
  return direction == Direction::forward ? "forward" : "backward";
}

struct Geometry {
  int grid = 0;
  Layout l;
  std::size_t tape_bytes = 0, smem = 0;
};

// Which instance of a kernel takes a launch: `full` where D is 1024 and N the slot capacity (D and
// N constants: the sequence phase's passes without loop exits), `vec` where D % 8 == 0 (the rows
// phase's 16-byte loads of h), else `scalar`.
enum class Variant { scalar, vec, full };
constexpr Variant variant_of(int dim, int slots, int max_n) {
  if (dim == kMaxDim && slots == max_n) return Variant::full;
  return dim % 8 == 0 ? Variant::vec : Variant::scalar;
}
// Launches the kernel of slot capacity MaxN (8, 16, 32 or 64; layer_persistent_n<MaxN>.cu) on
// `stream`, the instance variant_of picks.
template <int MaxN>
void launch(const PersistentForwardArgs& args, const Device& dev, const Geometry& g, cudaStream_t stream);
template <int MaxN>
void launch(const PersistentBackwardArgs& args, const Device& dev, const Geometry& g, cudaStream_t stream);
// How many clusters of g.l.cluster blocks can be resident at once, of the kernel `launch` takes
// for this direction and shape.
template <int MaxN>
int resident_clusters(Direction direction, int dim, int slots, const Geometry& g);

}  // namespace models::e29a::kernels::persistent
