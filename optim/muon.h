// Muon over the slab: the hidden matrices (ParamSpec::hidden_matrix) take torch.optim.Muon's
// update (muon_math.h), every other tensor AdamW's. A step is three phases:
//   phase 0: gradient statistics                                   -> scalars (summed across ranks)
//   phase 1: momentum of the owned matrix elements, and their Newton-Schulz input written into the
//            assembly buffer (zero elsewhere)                      -> assembly (summed across ranks)
//   phase 2: Newton-Schulz of every matrix the shard touches, the weight update of the owned
//            elements (AdamW's for the rest), mirror write, gradient zeroing, step counter.
// Between the phases the partials are summed across ranks under ZeRO >= 1 (muon_plan.h). On cuda
// phase 2 is: the Newton-Schulz input of every touched matrix normalised into bf16 (one launch),
// the iterations as cuBLASLt strided-batched products over all matrices of one shape
// (muon_gemm.h), the matrices' update, then AdamW's update launch over the other tensors, which
// also advances the step counter. The CPU Newton-Schulz runs in fp32, the GPU's in bf16 with fp32
// accumulation.
#pragma once

#include <memory>

#include "optim/adamw.h"
#include "optim/muon_gemm.h"
#include "optim/muon_math.h"
#include "optim/muon_plan.h"
#include "optim/optimizer.h"

namespace optim {

// A piece of the owned part of one matrix, for the elementwise kernels (cuda).
struct MuonChunk {
  std::int64_t offset = 0;  // global element index
  std::int32_t length = 0;
  std::int32_t matrix = 0;  // index into the touched-matrix table
};

// A matrix this rank's shard touches, as the kernels see it.
struct MuonMatrixInfo {
  std::int64_t offset = 0;  // global index of element [0, 0]
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t packed = 0;  // in the assembly buffer
  std::int64_t x = 0;       // first element of its [min, max] bf16 Newton-Schulz matrix
  float lr_scale = 1.0f;
  float decay = 1.0f;   // 1: weight decay applies
  double adjust = 1.0;  // adjusted rate / rate (muon_adjusted_lr)
};

// What the kernels take from the config and the step.
struct MuonKernelParams {
  MuonMomentumParams momentum;  // clip is derived on the device
  double max_norm = 0;
  NonFinitePolicy policy = NonFinitePolicy::skip_step;
  double lr = 0;  // Muon's rate this step
  double weight_decay = 0;
  float eps = 1e-7f;
};

void launch_muon_momentum(const MuonChunk* chunks, std::int64_t num_chunks, const MuonMatrixInfo* matrices,
                          const float* grad, float* momentum, std::int64_t owned_begin, float* assembly,
                          const StepScalars* scalars, const MuonKernelParams& params, cudaStream_t stream);
// X of every touched matrix: its assembled input over max(||U||_F, eps), transposed when taller
// than wide, rounded to bf16.
void launch_muon_normalise(const MuonMatrixInfo* matrices, std::int64_t count, const float* assembly, void* x,
                           const MuonKernelParams& params, cudaStream_t stream);
void launch_muon_update(const MuonChunk* chunks, std::int64_t num_chunks, const MuonMatrixInfo* matrices,
                        const void* orthogonal, float* master, float* grad, void* mirror, core::DType mirror_dtype,
                        std::int64_t owned_begin, const StepScalars* scalars, const MuonKernelParams& params,
                        cudaStream_t stream);

class Muon final : public Optimizer {
 public:
  Muon(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context,
       std::int64_t chunk_elements = kDefaultChunkElements);

  int phase_count() const override { return 3; }
  std::vector<Partial> phase_partials(int phase) override;
  std::vector<StateBuffer> state_buffers() override;

  const MuonPlan& plan() const { return plan_; }
  // Bytes of the working buffers beyond the state: the fp32 assembly buffer, and on cuda the bf16
  // Newton-Schulz buffers (muon_load.h plans them without allocating).
  std::int64_t buffer_bytes() const;
  // Per owned element: AdamW's m, or Muon's momentum buffer for hidden-matrix elements.
  core::Buffer& exp_avg() { return exp_avg_; }
  core::Buffer& exp_avg_sq() { return exp_avg_sq_; }  // AdamW's v (0 for hidden-matrix elements)

 private:
  void run_middle_phase(int phase, double lr) override;
  void update(double lr) override;
  void update_matrices(double lr, bool skip);
  MuonKernelParams kernel_params(double lr) const;
  double muon_lr(double lr) const;
  void prepare_cuda(const core::DeviceContext& context, std::int64_t chunk_elements);
  void update_cuda(double lr);

  MuonPlan plan_;
  core::Buffer exp_avg_;
  core::Buffer exp_avg_sq_;
  core::Buffer assembly_;  // f32, plan_.packed_elements
  // cuda: the tables, the Newton-Schulz buffers (bf16) and one set of products per shape.
  struct ShapeGroup {
    std::int64_t x = 0;     // first element of the group's matrices in x_
    std::int64_t gram = 0;  // first element of its scratch in gram_ and poly_
    std::unique_ptr<NewtonSchulzGemms> gemms;
  };
  std::vector<ShapeGroup> groups_;
  core::Buffer muon_chunks_, matrix_info_, adamw_chunks_;
  std::int64_t muon_chunk_count_ = 0, adamw_chunk_count_ = 0;
  core::Buffer x_[2], gram_, poly_;
};

}  // namespace optim
