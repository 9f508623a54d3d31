#include "optim/muon_load.h"

#include <algorithm>

#include "optim/muon_plan.h"
#include "optim/newton_schulz_buffers.h"
#include "optim/slab.h"

namespace optim {

double newton_schulz_flop(std::int64_t rows, std::int64_t cols, std::int64_t steps) {
  const auto r = static_cast<double>(std::min(rows, cols));
  const auto c = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(steps) * (4.0 * r * r * c + 2.0 * r * r * r);
}

double MuonLoad::busiest_over_even() const {
  double busiest = 0;
  for (const MuonRankLoad& r : ranks) busiest = std::max(busiest, r.flop);
  return flop > 0 ? busiest / (flop / static_cast<double>(ranks.size())) : 1.0;
}

double MuonLoad::redundant() const {
  double done = 0;
  for (const MuonRankLoad& r : ranks) done += r.flop;
  return flop > 0 ? (done - flop) / flop : 0.0;
}

std::int64_t MuonLoad::largest_bytes(bool cuda) const {
  std::int64_t largest = 0;
  for (const MuonRankLoad& r : ranks) largest = std::max(largest, r.bytes(cuda));
  return largest;
}

MuonLoad muon_load(const SlabLayout& layout, int zero_stage, std::int64_t ns_steps) {
  MuonLoad load;
  load.ns_steps = ns_steps;
  for (int rank = 0; rank < layout.world_size(); ++rank) {
    const Range owned = slab_coverage(layout, {.rank = rank, .zero_stage = zero_stage}).owned;
    const MuonPlan plan = make_muon_plan(layout, owned);
    MuonRankLoad r;
    r.matrices = static_cast<std::int64_t>(plan.touched.size());
    for (const int index : plan.touched) {
      const MuonMatrix& m = plan.matrices[static_cast<std::size_t>(index)];
      r.flop += newton_schulz_flop(m.rows, m.cols, ns_steps);
    }
    r.assembly_bytes = plan.packed_elements * static_cast<std::int64_t>(sizeof(float));
    r.newton_schulz_bytes = newton_schulz_buffers(plan).bytes();
    if (rank == 0) {
      for (const MuonMatrix& m : plan.matrices) load.flop += newton_schulz_flop(m.rows, m.cols, ns_steps);
    }
    load.ranks.push_back(r);
  }
  return load;
}

}  // namespace optim
