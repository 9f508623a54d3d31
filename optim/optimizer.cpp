#include "optim/optimizer.h"

#include <cmath>

#include "core/error.h"
#include "optim/adafactor.h"
#include "optim/adamw.h"
#include "optim/adamw8bit.h"
#include "optim/grad_stats.h"
#include "optim/muon.h"

namespace optim {

Optimizer::Optimizer(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context,
                     std::int64_t chunk_elements)
    : config_(config), slab_(slab), context_(context) {
  validate(config_, "optimizer config");
  if (!(slab.device() == context.device())) {
    throw core::Error("optimizer: slab lives on " + slab.device().str() + " but the context is " +
                      context.device().str());
  }
  chunks_ = make_work_chunks(slab.segments(), chunk_elements);
  const core::Device device = context.device();
  scalars_ = core::Buffer(device, sizeof(StepScalars));
  if (on_cuda()) {
    chunk_table_ = core::Buffer(device, chunks_.size() * sizeof(WorkChunk));
    core::copy_bytes(chunk_table_.data(), chunks_.data(), chunk_table_.bytes(), context.stream());
    const auto blocks = static_cast<std::size_t>(grad_stats_blocks(num_chunks()));
    partial_sums_ = core::Buffer(device, blocks * sizeof(double));
    partial_counts_ = core::Buffer(device, blocks * sizeof(unsigned long long));
    report_ = core::Buffer(core::Device::cpu(), sizeof(StepScalars), /*pinned=*/true);
    *report_.as<StepScalars>() = StepScalars{};
    const StepScalars initial{};
    core::copy_bytes(scalars_.data(), &initial, sizeof(initial), context.stream());
    CUDA_CHECK(cudaEventCreateWithFlags(&report_ready_, cudaEventDisableTiming));
    context.synchronize();
  } else {
    *scalars() = StepScalars{};
  }
}

Optimizer::~Optimizer() {
  if (report_ready_) (void)cudaEventDestroy(report_ready_);
}

const WorkChunk* Optimizer::chunk_table() const { return on_cuda() ? chunk_table_.as<WorkChunk>() : chunks_.data(); }

core::Buffer Optimizer::make_state(core::DType dtype) const {
  core::Buffer b(context_.device(), static_cast<std::size_t>(slab_.owned().size()) * core::dtype_size(dtype));
  b.fill_bytes(0, context_.stream());
  return b;
}

void Optimizer::step(double lr) {
  const int phases = phase_count();
  for (int phase = 0; phase < phases; ++phase) {
    run_phase(phase, lr);
    if (reducer_ && phase + 1 < phases) reducer_(phase_partials(phase));
  }
}

void Optimizer::run_phase(int phase, double lr) {
  if (!std::isfinite(lr) || lr < 0) throw core::Error("optimizer step: learning rate must be finite and >= 0");
  const int last = phase_count() - 1;
  if (phase < 0 || phase > last) throw core::Error("optimizer: phase " + std::to_string(phase) + " out of range");
  if (phase == 0 && phase < last) {
    run_first_phase(lr);
  } else if (phase < last) {
    run_middle_phase(phase, lr);
  } else {
    update(lr);
    if (on_cuda()) {
      core::copy_bytes(report_.data(), scalars_.data(), sizeof(StepScalars), context_.stream());
      // Inside a stream capture the record must be external, so every replay of the graph
      // records the event; outside a capture that flag is refused.
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      CUDA_CHECK(cudaStreamIsCapturing(context_.stream(), &capture));
      if (capture == cudaStreamCaptureStatusActive) {
        CUDA_CHECK(cudaEventRecordWithFlags(report_ready_, context_.stream(), cudaEventRecordExternal));
      } else {
        CUDA_CHECK(cudaEventRecord(report_ready_, context_.stream()));
      }
    }
  }
}

void Optimizer::gradient_statistics() {
  const float* grad = slab_.grad_origin();
  if (on_cuda()) {
    launch_grad_stats(grad, chunk_table(), num_chunks(), partial_sums_.as<double>(),
                      partial_counts_.as<unsigned long long>(), scalars(), context_.stream());
  } else {
    grad_stats_cpu(grad, chunks_.data(), num_chunks(), *scalars());
  }
}

std::vector<Partial> Optimizer::phase_partials(int phase) {
  if (phase != 0) return {};
  StepScalars* s = scalars();
  return {{&s->grad_sq_sum, core::DType::f64, 1}, {&s->nonfinite, core::DType::u64, 1}};
}

StepReport Optimizer::report() {
  StepScalars s;
  if (on_cuda()) {
    CUDA_CHECK(cudaEventSynchronize(report_ready_));
    s = *report_.as<StepScalars>();
  } else {
    s = *scalars();
  }
  StepReport r;
  r.step = s.step;
  r.skipped_steps = s.skipped;
  r.grad_norm = std::sqrt(s.grad_sq_sum);
  r.nonfinite = s.nonfinite;
  r.skipped = skips_step(config_.nonfinite, s.nonfinite);
  return r;
}

StepScalars Optimizer::step_scalars() {
  StepScalars s;
  if (on_cuda()) {
    core::copy_bytes(&s, scalars_.data(), sizeof(StepScalars), context_.stream());
    context_.synchronize();
  } else {
    s = *scalars();
  }
  return s;
}

void Optimizer::restore_step_scalars(const StepScalars& saved) {
  StepScalars s = step_scalars();
  s.grad_sq_sum = 0;
  s.nonfinite = 0;
  s.step = saved.step;
  s.skipped = saved.skipped;
  if (on_cuda()) {
    core::copy_bytes(scalars_.data(), &s, sizeof(StepScalars), context_.stream());
    context_.synchronize();
    *report_.as<StepScalars>() = s;
  } else {
    *scalars() = s;
  }
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context,
                                          std::int64_t chunk_elements) {
  if (config.type == "adamw") return std::make_unique<AdamW>(config, slab, context, chunk_elements);
  if (config.type == "adamw8bit") return std::make_unique<AdamW8bit>(config, slab, context, chunk_elements);
  if (config.type == "adafactor") return std::make_unique<Adafactor>(config, slab, context, chunk_elements);
  if (config.type == "muon") return std::make_unique<Muon>(config, slab, context, chunk_elements);
  throw core::InputError("optimizer.type: unknown optimizer '" + config.type +
                         "' (expected adamw, adamw8bit, adafactor or muon)");
}

std::int64_t optimizer_state_bytes(const OptimizerConfig& config, const SlabLayout& layout, Range owned,
                                   std::int64_t chunk_elements) {
  if (config.type == "adamw" || config.type == "muon")
    return 2 * owned.size() * static_cast<std::int64_t>(sizeof(float));
  const std::vector<Segment> segments = make_segments(layout, owned);
  if (config.type == "adamw8bit") {
    return plan_adamw8bit(layout, segments, owned, config.adamw8bit.min_8bit_size, chunk_elements).state_bytes();
  }
  if (config.type == "adafactor") {
    const AdafactorPlan plan = make_adafactor_plan(layout, segments, chunk_elements);
    const std::int64_t momentum = config.adafactor.beta1 ? owned.size() : 0;
    return (plan.row_col_state_size + plan.v_state_size + momentum) * static_cast<std::int64_t>(sizeof(float));
  }
  throw core::InputError("optimizer.type: unknown optimizer '" + config.type +
                         "' (expected adamw, adamw8bit, adafactor or muon)");
}

}  // namespace optim
