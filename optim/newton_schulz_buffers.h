// Where the GPU's Newton-Schulz keeps the matrices one rank orthogonalises (Muon's touched
// matrices, muon_plan.h): grouped by shape [r, c] = [min(rows, cols), max(rows, cols)], each
// group's matrices consecutive in the X buffers as the strided-batched products need
// (muon_gemm.h), each group's scratch consecutive in the Gram and polynomial buffers. Muon
// allocates from it, and the memory plan counts it (muon_load.h), without a GPU.
#pragma once

#include <cstdint>
#include <vector>

#include "optim/muon_plan.h"

namespace optim {

struct NewtonSchulzGroup {
  std::int64_t r = 0, c = 0;  // the shape Newton-Schulz works on, r <= c
  std::int64_t batch = 0;     // matrices of this shape
  std::int64_t x = 0;         // first element of its matrices in the X buffers
  std::int64_t gram = 0;      // first element of its scratch in the Gram and polynomial buffers
};

struct NewtonSchulzBuffers {
  std::vector<int> order;       // plan.touched sorted by shape (stable): the X buffers' order
  std::vector<std::int64_t> x;  // per entry of order: its first element in the X buffers
  std::vector<NewtonSchulzGroup> groups;
  std::int64_t x_elements = 0;     // of each of the two X buffers (the iterations alternate)
  std::int64_t gram_elements = 0;  // of the Gram buffer and of the polynomial buffer
  // All four buffers, bf16.
  std::int64_t bytes() const { return 2 * (2 * x_elements + 2 * gram_elements); }
};

NewtonSchulzBuffers newton_schulz_buffers(const MuonPlan& plan);

}  // namespace optim
