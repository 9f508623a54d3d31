// The matrices Muon orthogonalises, and where each is assembled. Newton-Schulz needs whole
// matrices while a ZeRO shard may hold any piece of one: every rank writes its owned elements of
// each matrix's Newton-Schulz input into an assembly buffer laid out by this plan (the same on
// every rank, zero where it owns nothing), the buffers are summed across ranks (each element has
// exactly one owner, so the sum is exact), and each rank then orthogonalises the matrices its
// shard touches (docs/optimizers.md says why this split of the work).
#pragma once

#include <cstdint>
#include <vector>

#include "optim/slab_layout.h"

namespace optim {

struct MuonMatrix {
  std::int64_t offset = 0;  // global element index of element [0, 0]
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t packed = 0;  // index of element [0, 0] in the assembly buffer
  int tensor = 0;           // index into SlabLayout::parameters()
  Range range() const { return {offset, offset + rows * cols}; }
};

struct MuonPlan {
  // Every hidden matrix of the layout in slab order: each logical tensor marked hidden_matrix,
  // cut into its parts when the layout could not split them (layout.unsplit()) and into its
  // stacked matrices (ParamSpec::stacked_rows).
  std::vector<MuonMatrix> matrices;
  std::int64_t packed_elements = 0;  // size of the assembly buffer
  std::vector<int> touched;          // indices of the matrices that intersect the owned range
  std::vector<bool> is_matrix;       // per logical tensor: hidden matrix (Muon) or not (AdamW)
};

// Throws core::Error for a hidden matrix that is not 2-D or whose stacked rows do not divide it.
MuonPlan make_muon_plan(const SlabLayout& layout, Range owned);

}  // namespace optim
