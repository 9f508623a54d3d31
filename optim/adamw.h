// Fused multi-tensor AdamW over the slab: fp32 master, exp_avg (m) and exp_avg_sq (v) for the
// owned range; one statistics launch and one update launch per step whatever the number of
// tensors (optimizer.h describes the step).
#pragma once

#include "optim/adamw_math.h"
#include "optim/optimizer.h"

namespace optim {

class AdamW final : public Optimizer {
 public:
  AdamW(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context,
        std::int64_t chunk_elements = kDefaultChunkElements);

  std::vector<StateBuffer> state_buffers() override;
  core::Buffer& exp_avg() { return exp_avg_; }
  core::Buffer& exp_avg_sq() { return exp_avg_sq_; }

 private:
  void update(double lr) override;
  void update_cpu(const AdamWStepParams& params);

  core::Buffer exp_avg_;
  core::Buffer exp_avg_sq_;
};

// The step's hyper-parameters from the optimizer config (AdamW and 8-bit AdamW share them).
AdamWStepParams adamw_step_params(const OptimizerConfig& config, double lr);

// The CPU reference of adamw_update_span (adamw_span.cuh), shared by AdamW and adamw8bit's fp32
// chunks: elements [offset, offset + length) by global index, their moments at m[0, length) and
// v[0, length); master by the index relative to `owned_begin`. A skipped step only zeroes the
// gradients.
struct AdamWSpanCpu {
  float* master;
  float* m;
  float* v;
  float* grad;
  std::uint16_t* mirror;
  bool bf16;
  std::int64_t owned_begin;
};
// The span over `slab`'s owned range with moments `m` and `v` (cpu buffers covering it).
AdamWSpanCpu adamw_owned_span_cpu(Slab& slab, core::Buffer& m, core::Buffer& v);
void adamw_update_span_cpu(const AdamWSpanCpu& span, std::int64_t offset, std::int64_t length,
                           const AdamWElementParams& e, bool skip);

// AdamW's CPU update of `chunks` (of `segments`), m and v covering the owned range like master,
// with the clip and step taken from `scalars`; chunks of a logical tensor t with
// `excluded[t]` (when not empty) are left to another update (Muon's matrices).
void adamw_update_chunks_cpu(const AdamWSpanCpu& owned, const std::vector<WorkChunk>& chunks,
                             const std::vector<Segment>& segments, const AdamWStepParams& params,
                             const StepScalars& scalars, bool skip, const std::vector<bool>& excluded = {});

// Arguments of the update launch: buffers by their base pointers; master and state cover the
// owned range starting at global index `owned_begin`, the mirror the whole slab; grad is
// Slab::grad_origin() (indexed by global element, covering Slab::grad_covers()).
struct AdamWBuffers {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  float* grad;
  void* mirror;
  core::DType mirror_dtype;
  std::int64_t owned_begin;
};

void launch_adamw_update(const AdamWBuffers& buffers, const WorkChunk* chunks, std::int64_t num_chunks,
                         const Segment* segments, StepScalars* scalars, const AdamWStepParams& params,
                         cudaStream_t stream);

}  // namespace optim
