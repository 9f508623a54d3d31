// The interface the trainer drives: an optimizer made from a config section and a slab, with
// step(lr) doing the whole step for the slab range this rank owns, as a few phases:
//   phase 0: gradient statistics (sum of squares, non-finite count)  -- one launch, or fused into
//            the optimizer's own statistics pass
//   ...      optimizer-specific statistics (Adafactor's row/column sums, per-tensor sums)
//   last:    update: clip derived on the device, master + state update, mirror write, grads zeroed
// After each phase but the last, the phase's partial results (small buffers of doubles or
// counts, see phase_partials) are complete for this rank's shard only; with several ranks they
// are summed across ranks before the next phase (the reducer set by set_partials_reducer).
// On cuda a step allocates nothing, never waits for the device and can be captured in a CUDA
// graph; the host learns the step's statistics when it asks for report(). On cpu the same
// semantics run as plain C++ (the reference the GPU kernels are tested against).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/device.h"
#include "optim/optimizer_config.h"
#include "optim/segments.h"
#include "optim/slab.h"
#include "optim/step_scalars.h"

namespace optim {

// Where entries of a state buffer belong in the slab's global element space, so that a
// checkpoint written by one world size can be read by another. Entries
// [entry_offset, entry_offset + entries) of the buffer hold the state of global elements
// `global`: one entry per `elements_per_entry` elements (1 for per-element state, 256 for
// per-block scales), or, when `whole`, a fixed-size record of the whole range (e.g. Adafactor's
// row and column statistics of one tensor) that is only ever read back in one piece.
struct StatePiece {
  Range global;
  std::int64_t entry_offset = 0;
  std::int64_t entries = 0;
  bool whole = false;
};

// A buffer of optimizer state of this rank, e.g. AdamW's exp_avg over the owned range.
struct StateBuffer {
  std::string name;
  core::DType dtype;
  core::Buffer* buffer;
  std::vector<StatePiece> pieces;  // unless `packed`: ignored, one entry per element of the owned range
  std::int64_t elements_per_entry = 1;
  // `pieces` lists every entry this rank holds; an empty list then means none (a rank whose shard
  // holds no small tensor keeps no packed state), not the whole owned range.
  bool packed = false;

  std::vector<StatePiece> entries(Range owned) const {
    return packed ? pieces : std::vector<StatePiece>{{owned, 0, owned.size() / elements_per_entry, false}};
  }
};

// A small buffer of per-rank partial sums that must be summed across ranks between phases.
struct Partial {
  void* data;         // device memory on cuda
  core::DType dtype;  // f64, u64, or f32 (Muon's assembled matrices)
  std::size_t count;
};

class Optimizer {
 public:
  using PartialsReducer = std::function<void(const std::vector<Partial>&)>;

  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // The whole step: every phase, with the reducer (if any) between phases.
  void step(double lr);

  // The phases of a step, for callers that interleave their own reductions (e.g. tests that
  // simulate several shards on one device). run_phase must be called in order 0..count-1.
  virtual int phase_count() const { return 2; }
  void run_phase(int phase, double lr);
  // Buffers holding this rank's partial results after `phase` (empty for the last phase).
  virtual std::vector<Partial> phase_partials(int phase);
  // Called between phases with phase_partials(phase); sums them across ranks in place.
  void set_partials_reducer(PartialsReducer reducer) { reducer_ = std::move(reducer); }

  // Statistics of the most recent step (blocks until it has finished on the device).
  StepReport report();

  const OptimizerConfig& config() const { return config_; }
  Slab& slab() { return slab_; }
  virtual std::vector<StateBuffer> state_buffers() = 0;

  // The step counters as they stand after the last enqueued step (waits for the device on cuda).
  StepScalars step_scalars();
  // Writes `saved`'s step counters (step, skipped) back, e.g. from a checkpoint, and clears the
  // per-step statistics; on cuda through the stream, finished before it returns.
  void restore_step_scalars(const StepScalars& saved);

  // Work chunk size used by both launches (elements).
  static constexpr std::int64_t kDefaultChunkElements = 16384;

 protected:
  Optimizer(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context, std::int64_t chunk_elements);

  // The update launch (cuda) or loop (cpu), after the statistics are in scalars().
  virtual void update(double lr) = 0;
  // Phase 0: the gradient statistics into scalars(); an optimizer that computes them within
  // its own statistics pass overrides this.
  virtual void run_first_phase(double lr) { gradient_statistics(); }
  // Phases between the first and the update (the last phase).
  virtual void run_middle_phase(int phase, double lr) {}
  // The shared statistics launch (sum of squares and non-finite count of the owned gradients).
  void gradient_statistics();

  StepScalars* scalars() { return scalars_.as<StepScalars>(); }  // device memory on cuda
  const WorkChunk* chunk_table() const;                          // device memory on cuda
  std::int64_t num_chunks() const { return static_cast<std::int64_t>(chunks_.size()); }
  const std::vector<WorkChunk>& chunks() const { return chunks_; }
  const core::DeviceContext& context() const { return context_; }
  bool on_cuda() const { return context_.is_cuda(); }
  // Zero-initialised state buffer of `dtype` covering the owned range.
  core::Buffer make_state(core::DType dtype) const;

  OptimizerConfig config_;
  Slab& slab_;

 private:
  const core::DeviceContext& context_;
  std::vector<WorkChunk> chunks_;
  core::Buffer chunk_table_;   // device copy of chunks_
  core::Buffer scalars_;       // StepScalars (device on cuda)
  core::Buffer partial_sums_;  // grad-stats partials (cuda)
  core::Buffer partial_counts_;
  core::Buffer report_;  // pinned host copy of the scalars after a step (cuda)
  cudaEvent_t report_ready_ = nullptr;
  PartialsReducer reducer_;
};

// `p` with the fields every optimizer's step parameters take from the config alike: the step's
// learning rate, the decoupled weight decay, the global clip threshold and the non-finite policy.
template <typename StepParams>
StepParams with_shared_step_fields(StepParams p, const OptimizerConfig& config, double lr) {
  p.lr = lr;
  p.weight_decay = config.weight_decay;
  p.max_norm = config.grad_clip;
  p.policy = config.nonfinite;
  return p;
}

// Builds the optimizer named by config.type over `slab`. Throws core::InputError for an unknown type.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context,
                                          std::int64_t chunk_elements = Optimizer::kDefaultChunkElements);

// Bytes of the state buffers (state_buffers()) that make_optimizer's optimizer keeps for the
// `owned` range of `layout`, computed from the same plans without allocating (memory plans).
std::int64_t optimizer_state_bytes(const OptimizerConfig& config, const SlabLayout& layout, Range owned,
                                   std::int64_t chunk_elements = Optimizer::kDefaultChunkElements);

}  // namespace optim
