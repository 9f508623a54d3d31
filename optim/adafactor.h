// Fused multi-tensor Adafactor over the slab (adafactor_math.h has the formulas). A step is a
// fixed number of launches whatever the number of tensors:
//   phase 0: A  row sums, column partials and weight sums of squares (tiles / chunks), and the
//               gradient's sum of squares and non-finite count (the step's gradient statistics)
//            B  column sums, per-tensor weight sums, the gradient norm      -> `stats` slab, scalars
//   phase 1: C  EMA of the row/column statistics (scaled by clip^2), partial sums of the new rows
//            D  per-item sums of U*U (and the full-v EMA of non-factored tensors)
//            E  per-tensor sums of U*U                                          -> `u_stats` slab
//   phase 2: F  update: weights (+ first moment), mirror, gradient zeroing, step counter
// Under ZeRO the statistics slabs (and the gradient statistics) are summed across ranks after
// phases 0 and 1; the row and column state of factored tensors is replicated.
#pragma once

#include "optim/adafactor_math.h"
#include "optim/adafactor_plan.h"
#include "optim/optimizer.h"

namespace optim {

// Everything the kernels read, by pointer (device memory).
struct AdafactorDeviceView {
  float* master;
  float* grad;  // Slab::grad_origin(): indexed by global element
  void* mirror;
  core::DType mirror_dtype;
  std::int64_t owned_begin;
  const Segment* segments;
  const AdafactorSegment* info;
  const AdafactorItem* items;
  std::int64_t item_count;
  const AdafactorReduceItem* reduce_stats;
  std::int64_t reduce_stats_count;
  const AdafactorReduceItem* reduce_u;
  std::int64_t reduce_u_count;
  const AdafactorEmaItem* ema_items;
  std::int64_t ema_count;
  float* row_col_state;
  double* row_partials;
  float* v_state;
  float* exp_avg;  // null without beta1
  double* stats;
  std::int64_t stats_size;
  double* u_stats;
  double* item_partials;
  double* grad_partials;
  unsigned long long* nonfinite_partials;
  float* col_partials;
  StepScalars* scalars;
};

class Adafactor final : public Optimizer {
 public:
  Adafactor(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context,
            std::int64_t chunk_elements = kDefaultChunkElements);

  int phase_count() const override { return 3; }
  std::vector<Partial> phase_partials(int phase) override;
  std::vector<StateBuffer> state_buffers() override;

  const AdafactorPlan& plan() const { return plan_; }
  core::Buffer& row_col_state() { return row_col_state_; }  // R then C of each factored tensor (fp32)
  core::Buffer& v_state() { return v_state_; }              // full v of non-factored segments (fp32)
  core::Buffer& exp_avg() { return exp_avg_; }              // first moment over the owned range (beta1 only)

 private:
  void run_first_phase(double lr) override;
  void run_middle_phase(int phase, double lr) override;
  void update(double lr) override;
  AdafactorStepParams step_params(double lr) const;
  AdafactorDeviceView device_view();

  void statistics_cpu(const AdafactorStepParams& p);
  void second_moments_cpu(const AdafactorStepParams& p, double lr);
  void update_cpu(const AdafactorStepParams& p, double lr);
  double row_mean(const AdafactorSegment& info, const Segment& seg) const;  // mean(R), CPU

  AdafactorPlan plan_;
  core::Buffer row_col_state_;
  core::Buffer row_partials_;  // double: partial sums of the updated R (their mean is mean(R))
  core::Buffer v_state_;
  core::Buffer exp_avg_;
  core::Buffer stats_;               // double, plan_.stats_size
  core::Buffer u_stats_;             // double, plan_.u_stats_size
  core::Buffer item_partials_;       // double per item: weight sums of squares, later U*U sums
  core::Buffer grad_partials_;       // double per item: gradient sums of squares
  core::Buffer nonfinite_partials_;  // u64 per item
  core::Buffer col_partials_;        // float, plan_.col_partials_size
  // Device copies of the plan's tables (cuda only).
  core::Buffer items_, segment_info_, reduce_stats_, reduce_u_, ema_items_;
};

void launch_adafactor_statistics(const AdafactorDeviceView& view, const AdafactorStepParams& params,
                                 cudaStream_t stream);
void launch_adafactor_second_moments(const AdafactorDeviceView& view, const AdafactorStepParams& params,
                                     cudaStream_t stream);
void launch_adafactor_update(const AdafactorDeviceView& view, const AdafactorStepParams& params, cudaStream_t stream);

}  // namespace optim
