// Muon over the slab: the hidden matrices (ParamSpec::hidden_matrix) take torch.optim.Muon's
// update (muon_math.h), every other tensor AdamW's. A step is three phases:
//   phase 0: gradient statistics                                   -> scalars (summed across ranks)
//   phase 1: momentum of the owned matrix elements, and their Newton-Schulz input written into the
//            assembly buffer (zero elsewhere)                      -> assembly (summed across ranks)
//   phase 2: Newton-Schulz of every matrix the shard touches, the weight update of the owned
//            elements (AdamW's for the rest), mirror write, gradient zeroing, step counter.
// Between the phases the partials are summed across ranks under ZeRO >= 1 (muon_plan.h). The cpu
// backend only: on cuda the constructor refuses.
#pragma once

#include "optim/adamw.h"
#include "optim/muon_plan.h"
#include "optim/optimizer.h"

namespace optim {

class Muon final : public Optimizer {
 public:
  Muon(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context,
       std::int64_t chunk_elements = kDefaultChunkElements);

  int phase_count() const override { return 3; }
  std::vector<Partial> phase_partials(int phase) override;
  std::vector<StateBuffer> state_buffers() override;

  const MuonPlan& plan() const { return plan_; }
  // Per owned element: AdamW's m, or Muon's momentum buffer for hidden-matrix elements.
  core::Buffer& exp_avg() { return exp_avg_; }
  core::Buffer& exp_avg_sq() { return exp_avg_sq_; }  // AdamW's v (0 for hidden-matrix elements)

 private:
  void run_middle_phase(int phase, double lr) override;
  void update(double lr) override;
  void update_matrices(double lr, bool skip);

  MuonPlan plan_;
  core::Buffer exp_avg_;
  core::Buffer exp_avg_sq_;
  core::Buffer assembly_;  // f32, plan_.packed_elements
};

}  // namespace optim
