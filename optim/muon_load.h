// Muon's work and memory per rank under ZeRO, from the plans the run allocates from, without a
// GPU (`trainer --plan`). Each rank orthogonalises every matrix its owned range touches
// (muon_plan.h): a matrix split between k ranks is orthogonalised k times (redundant work), and a
// rank whose shard holds only AdamW's tensors (the embedding) does none, so the busiest rank sets
// the step's Newton-Schulz time. Every rank keeps the whole fp32 assembly buffer, and on cuda the
// bf16 Newton-Schulz buffers of its own matrices (newton_schulz_buffers.h).
#pragma once

#include <cstdint>
#include <vector>

#include "optim/slab_layout.h"

namespace optim {

// FLOPs of `steps` Newton-Schulz iterations on a [rows, cols] matrix: per iteration, with
// r = min(rows, cols) and c = max(rows, cols), X X^T (2 r^2 c), A A (2 r^3) and B X (2 r^2 c).
double newton_schulz_flop(std::int64_t rows, std::int64_t cols, std::int64_t steps);

struct MuonRankLoad {
  std::int64_t matrices = 0;             // the matrices it orthogonalises
  double flop = 0;                       // their Newton-Schulz FLOPs per step
  std::int64_t assembly_bytes = 0;       // fp32, every matrix of the model (the same on every rank)
  std::int64_t newton_schulz_bytes = 0;  // cuda: the bf16 buffers of its matrices
  std::int64_t bytes(bool cuda) const { return assembly_bytes + (cuda ? newton_schulz_bytes : 0); }
};

struct MuonLoad {
  std::vector<MuonRankLoad> ranks;  // by rank
  double flop = 0;                  // every matrix once
  std::int64_t ns_steps = 0;
  // The busiest rank's FLOPs over an even split's, flop / N (1: balanced).
  double busiest_over_even() const;
  // FLOPs done more than once (a matrix split between ranks), as a fraction of flop.
  double redundant() const;
  // The largest bytes(cuda) over the ranks.
  std::int64_t largest_bytes(bool cuda) const;
};

// The load of each of layout.world_size() ranks at ZeRO `zero_stage` (below 1 every rank owns,
// and orthogonalises, everything).
MuonLoad muon_load(const SlabLayout& layout, int zero_stage, std::int64_t ns_steps);

}  // namespace optim
