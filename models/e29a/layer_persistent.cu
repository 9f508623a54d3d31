// The host side of the persistent E29a kernels (layer_persistent.h): which shapes they take, the
// launch geometry, and the launch of the slot capacity's kernel (layer_persistent_n*.cu).
#include "models/e29a/layer_persistent.h"

#include <algorithm>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "models/e29a/layer_kernels.h"
#include "models/e29a/layer_persistent_launch.h"

namespace models::e29a::kernels {
namespace {

using namespace persistent;

Device current_device() {
  int id = 0;
  CUDA_CHECK(cudaGetDevice(&id));
  Device d;
  CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, id));
  CUDA_CHECK(cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, id));
  CUDA_CHECK(cudaDeviceGetAttribute(&d.cooperative, cudaDevAttrCooperativeLaunch, id));
  return d;
}

int slot_capacity(int slots) { return slots <= 8 ? 8 : slots <= 16 ? 16 : slots <= 32 ? 32 : 64; }

std::size_t align16(std::size_t bytes) { return (bytes + 15) / 16 * 16; }

// Dynamic shared memory a block may take: the opt-in limit less the kernel's static words.
std::size_t smem_limit(const Device& dev) { return static_cast<std::size_t>(dev.smem_optin) - 64; }

// Blocks: enough for 16 rows each and one per sequence, at most one per SM; the rows over
// grid / parts row blocks. Forward: the 2D rows of [W_h ; W_write] split evenly, and the tape on
// chip. Backward: [W_h^T ; W_write^T] with each half padded to whole tiles and whole tiles a row
// block, and two tapes on chip (dL/dH and the replay's running tape).
Geometry plain_geometry(Direction direction, const Device& dev, int dim, int slots, std::int64_t batch, int blocks,
                        int parts) {
  Geometry g;
  const bool backward = direction == Direction::backward;
  g.l.split = backward ? (dim + kTileRows - 1) / kTileRows * kTileRows : dim;
  const int tiles_needed = (2 * g.l.split + kTileRows - 1) / kTileRows;
  g.grid = static_cast<int>(std::min<std::int64_t>(dev.sms, std::max<std::int64_t>({tiles_needed, batch, blocks, 1})));
  g.l.batch_parts = parts;
  g.l.row_blocks = std::max(1, g.grid / parts);
  if (backward) {
    g.l.tiles = (tiles_needed + g.l.row_blocks - 1) / g.l.row_blocks;
    g.l.rows_per_block = g.l.tiles * kTileRows;
  } else {
    g.l.rows_per_block = (2 * dim + g.l.row_blocks - 1) / g.l.row_blocks;
    g.l.tiles = (g.l.rows_per_block + kTileRows - 1) / kTileRows;
  }
  g.l.ld = (dim + kStep - 1) / kStep * kStep;
  g.l.weight_bytes = align16(static_cast<std::size_t>(g.l.tiles) * kTileRows * g.l.ld * sizeof(__nv_bfloat16));
  g.l.reduce_bytes = 2 * kWarps * kTileSums * sizeof(float);
  g.l.step_bytes = align16(seq_shared_floats(slot_capacity(slots)) * sizeof(float));
  g.tape_bytes = align16(static_cast<std::size_t>(slots) * dim * sizeof(float)) * (backward ? 2 : 1);
  g.smem = g.l.weight_bytes + g.l.reduce_bytes + g.l.step_bytes + g.tape_bytes;
  return g;
}

// Why a block's rows and tapes do not fit ("" when they do).
std::string room(Direction direction, const Device& dev, int dim, int slots, const Geometry& g) {
  if (g.l.tiles > kMaxTiles) {
    return "dim " + std::to_string(dim) + " needs " + std::to_string(g.l.rows_per_block) + " rows a block (at most " +
           std::to_string(kMaxTiles * kTileRows) + ")";
  }
  if (g.smem > smem_limit(dev)) {
    return "dim " + std::to_string(dim) + " and " + std::to_string(slots) + " slots need " + std::to_string(g.smem) +
           " bytes of shared memory a block (weight rows and " +
           (direction == Direction::forward ? "the tape; " : "two tapes; ") + std::to_string(smem_limit(dev)) +
           " available)";
  }
  return "";
}

// f(std::integral_constant<int, MaxN>) for the slot capacity that takes `slots`.
template <typename F>
decltype(auto) with_capacity(int slots, F f) {
  switch (slot_capacity(slots)) {
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    default: return f(std::integral_constant<int, 64>{});
  }
}

// The geometry with `cluster` blocks a sequence and the batch in `parts`, or why it cannot be:
// each block needs a 256-feature chunk of its own, the grid whole clusters (rounded up, within the
// SMs) and one per sequence, and every cluster resident at once (the occupancy query: clusters
// are placed within a GPC, so fewer fit than SMs / cluster); each part at least one group of 8
// sequences and the rows within a block's shared memory.
std::string clustered_geometry(Direction direction, const Device& dev, int dim, int slots, std::int64_t batch,
                               int cluster, int parts, Geometry& g) {
  const Geometry plain = plain_geometry(direction, dev, dim, slots, batch, 1, parts);
  const std::string c = "cluster " + std::to_string(cluster) + ": ";
  if (parts != 1) {
    const std::string p = "batch parts " + std::to_string(parts) + ": ";
    if (parts != kMaxBatchParts) return p + "must be 1 or " + std::to_string(kMaxBatchParts);
    if ((batch + kGroup - 1) / kGroup < parts) {
      return p + "batch " + std::to_string(batch) + " has fewer than " + std::to_string(parts) + " groups of " +
             std::to_string(kGroup) + " sequences";
    }
    const std::string why = room(direction, dev, dim, slots, plain);
    if (!why.empty()) return p + why;
  }
  if (cluster == 1) {
    g = plain;
    return "";
  }
  if (cluster != 2 && cluster != kMaxCluster)
    return c + "blocks a sequence must be 1, 2 or " + std::to_string(kMaxCluster);
  if ((dim + kThreads - 1) / kThreads < cluster) {
    return c + "dim " + std::to_string(dim) + " has fewer than " + std::to_string(cluster) + " chunks of " +
           std::to_string(kThreads) + " features";
  }
  const std::int64_t wanted = std::max<std::int64_t>(plain.grid, batch * cluster);
  const std::int64_t blocks = (wanted + cluster - 1) / cluster * cluster;
  if (blocks > dev.sms) {
    return c + std::to_string(blocks) + " blocks (batch " + std::to_string(batch) + ") are more than the " +
           std::to_string(dev.sms) + " SMs";
  }
  Geometry candidate = plain_geometry(direction, dev, dim, slots, batch, static_cast<int>(blocks), parts);
  candidate.l.cluster = cluster;  // its grid is `blocks`: at least the plain grid and within the SMs
  const int resident = with_capacity(
      slots, [&](auto max_n) { return resident_clusters<decltype(max_n)::value>(direction, dim, slots, candidate); });
  if (resident * cluster < candidate.grid) {
    return c + std::to_string(candidate.grid / cluster) + " clusters are needed at once, " + std::to_string(resident) +
           " fit";
  }
  g = candidate;
  return "";
}

// `cluster` > 0: that many blocks a sequence (g untouched and the reason returned when it cannot
// be); 0: the most of 4 and 2 that can be, else 1; the forward only where at most half the
// blocks would hold sequences, and not in the kernels' full variant (D 1024, N the capacity).
// Its two exchanges a step cost about what splitting its passes saves at B 64 (H100, D 1024, N 8:
// 10.55 ms clustered against 9.95), while at B 16 (N 16) it gained 8.2 -> 7.2 ms; with the full
// variant's straight-line passes the forward at B 16 is faster on one block (H200: 4.47 ms against
// 4.73 with C 2). The backward, one exchange a step, gains at both (12.0 -> 11.5, 9.4 -> 7.9; the
// full variant at B 16: 4.91 against 6.10 on one block).
// `parts` > 0: the batch in that many parts; 0: 2 where it can be, else 1.
std::string geometry_for(Direction direction, const Device& dev, int dim, int slots, std::int64_t batch, int cluster,
                         int parts, Geometry& g) {
  if (parts < 0 || parts > kMaxBatchParts) {
    return "batch parts " + std::to_string(parts) + ": must be 1 or " + std::to_string(kMaxBatchParts);
  }
  // The batch in p parts: the asked-for cluster, else the most blocks a sequence that fit.
  auto with_parts = [&](int p) {
    if (cluster > 0) return clustered_geometry(direction, dev, dim, slots, batch, cluster, p, g);
    const int plain_grid = plain_geometry(direction, dev, dim, slots, batch, 1, 1).grid;
    const bool full = variant_of(dim, slots, slot_capacity(slots)) == Variant::full;
    for (const int c : {kMaxCluster, 2}) {
      if (direction == Direction::forward && (full || 2 * batch * c > plain_grid)) continue;
      if (clustered_geometry(direction, dev, dim, slots, batch, c, p, g).empty()) return std::string();
    }
    return clustered_geometry(direction, dev, dim, slots, batch, 1, p, g);
  };
  std::string why;
  for (const int p : {kMaxBatchParts, 1}) {
    if (parts > 0 && p != parts) continue;
    why = with_parts(p);
    if (why.empty()) return "";
  }
  return why;
}

// The geometry a launch takes, or core::Error saying why there is none.
Geometry checked_geometry(Direction direction, const Device& dev, int dim, int slots, std::int64_t batch, int cluster,
                          int parts) {
  Geometry g;
  const std::string why = geometry_for(direction, dev, dim, slots, batch, cluster, parts, g);
  if (!why.empty()) throw core::Error(std::string("e29a persistent ") + direction_name(direction) + ": " + why);
  return g;
}

std::string refusal(Direction direction, int dim, int slots, std::int64_t max_batch, int cluster, int parts) {
  const Device dev = current_device();
  if (dev.cooperative == 0) return "the device has no cooperative launch";
  if (slots < 1 || slots > kMaxSlots) return "slots " + std::to_string(slots) + " outside [1, 64]";
  if (dim > kMaxDim) {
    return "dim " + std::to_string(dim) + " is above " + std::to_string(kMaxDim);
  }
  if (max_batch > dev.sms) {
    return "batch " + std::to_string(max_batch) + " is above one sequence per SM (" + std::to_string(dev.sms) + ")";
  }
  // The shared memory does not depend on the cluster: the plain geometry decides it (the batch in
  // one part takes the least).
  const std::string why = room(direction, dev, dim, slots, plain_geometry(direction, dev, dim, slots, max_batch, 1, 1));
  if (!why.empty()) return why;
  Geometry chosen;
  return cluster > 0 || parts > 0 ? geometry_for(direction, dev, dim, slots, max_batch, cluster, parts, chosen) : "";
}

template <typename Args>
void run(Direction direction, const Args& args, cudaStream_t stream) {
  // Only the barrier counter: an abort record stays until the host has reported it (layer_cuda.cpp).
  CUDA_CHECK(cudaMemsetAsync(&args.sync->arrived, 0, sizeof(args.sync->arrived), stream));
  if (args.batch == 0 || args.steps == 0) return;
  const Device dev = current_device();
  const Geometry g = checked_geometry(direction, dev, args.dim, args.slots, args.batch, args.cluster, args.batch_parts);
  with_capacity(args.slots, [&](auto max_n) { launch<decltype(max_n)::value>(args, dev, g, stream); });
  CUDA_CHECK_LAUNCH(direction == Direction::forward ? "e29a persistent forward" : "e29a persistent backward");
}

}  // namespace

std::string persistent_forward_refusal(int dim, int slots, std::int64_t max_batch, int cluster, int parts) {
  return refusal(Direction::forward, dim, slots, max_batch, cluster, parts);
}

std::string persistent_backward_refusal(int dim, int slots, std::int64_t max_batch, int cluster, int parts) {
  return refusal(Direction::backward, dim, slots, max_batch, cluster, parts);
}

PersistentShape persistent_shape(bool backward, int dim, int slots, std::int64_t batch, int cluster, int parts) {
  const Direction direction = backward ? Direction::backward : Direction::forward;
  const Geometry g = checked_geometry(direction, current_device(), dim, slots, batch, cluster, parts);
  return {g.l.cluster, g.l.batch_parts};
}

void persistent_forward(const PersistentForwardArgs& args, cudaStream_t stream) {
  run(Direction::forward, args, stream);
}

void persistent_backward(const PersistentBackwardArgs& args, cudaStream_t stream) {
  run(Direction::backward, args, stream);
}

std::size_t persistent_fragment_floats(std::int64_t batch, int dim) {
  return static_cast<std::size_t>((batch + kGroup - 1) / kGroup * kGroup) * ((dim + kStep - 1) / kStep * kStep);
}

std::string persistent_abort_message(const PersistentSync& record, double timeout_seconds, bool backward) {
  const std::string where = "grid barrier " + std::to_string(record.barrier) + " (counter " +
                            std::to_string(record.seen) + ", wanted " + std::to_string(record.wanted) + ")";
  return std::string("e29a persistent ") + (backward ? "backward" : "forward") + ": block " +
         std::to_string(record.block) + " waited more than " + std::to_string(timeout_seconds) + " s at " + where +
         "; every block left, the layer's outputs of that call are not valid";
}

}  // namespace models::e29a::kernels
