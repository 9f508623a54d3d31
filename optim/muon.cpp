#include "optim/muon.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "optim/muon_math.h"
#include "optim/newton_schulz.h"
#include "optim/update_epilogue.h"

namespace optim {

namespace {
// Element loops shorter than this run on one thread: a parallel region costs more than they do.
constexpr std::int64_t kParallelElements = std::int64_t{1} << 16;
}  // namespace

Muon::Muon(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context, std::int64_t chunk_elements)
    : Optimizer(config, slab, context, chunk_elements), plan_(make_muon_plan(slab.layout(), slab.owned())) {
  if (on_cuda()) {
    throw core::InputError(
        "optimizer.type: muon runs on device: cpu only (its CUDA kernels are not written yet); on cuda use adamw, "
        "adamw8bit or adafactor");
  }
  exp_avg_ = make_state(core::DType::f32);
  exp_avg_sq_ = make_state(core::DType::f32);
  assembly_ = core::Buffer(context.device(), static_cast<std::size_t>(plan_.packed_elements) * sizeof(float));
  assembly_.fill_bytes(0, context.stream());
}

std::vector<Partial> Muon::phase_partials(int phase) {
  if (phase == 0) return Optimizer::phase_partials(0);
  if (phase == 1) return {{assembly_.data(), core::DType::f32, static_cast<std::size_t>(plan_.packed_elements)}};
  return {};
}

std::vector<StateBuffer> Muon::state_buffers() {
  return {{"exp_avg", core::DType::f32, &exp_avg_}, {"exp_avg_sq", core::DType::f32, &exp_avg_sq_}};
}

void Muon::run_middle_phase(int phase, double lr) {
  (void)phase;
  (void)lr;
  const StepScalars& s = *scalars();
  float* assembly = assembly_.as<float>();
  std::fill(assembly, assembly + plan_.packed_elements, 0.0f);
  if (skips_step(config_.nonfinite, s.nonfinite)) return;
  const MuonConfig& m = config_.muon;
  const MuonMomentumParams p{static_cast<float>(1.0 - m.momentum), m.nesterov ? static_cast<float>(m.momentum) : -1.0f,
                             clip_coefficient(s.grad_sq_sum, config_.grad_clip)};
  const Range owned = slab_.owned();
  const float* grad = slab_.grad_origin();
  float* buf = exp_avg_.as<float>();
  const auto count = static_cast<std::int64_t>(plan_.touched.size());
#pragma omp parallel for schedule(dynamic, 1) if (plan_.packed_elements >= kParallelElements)
  for (std::int64_t k = 0; k < count; ++k) {
    const MuonMatrix& matrix = plan_.matrices[static_cast<std::size_t>(plan_.touched[static_cast<std::size_t>(k)])];
    const Range mine = matrix.range().intersect(owned);
    for (std::int64_t i = mine.begin; i < mine.end; ++i) {
      assembly[matrix.packed + i - matrix.offset] = muon_momentum(buf[i - owned.begin], grad[i], p);
    }
  }
}

void Muon::update_matrices(double lr, bool skip) {
  const MuonConfig& m = config_.muon;
  // The schedule scales Muon's rate as it scales optimizer.lr.
  const double muon_lr = config_.lr > 0 ? m.lr * (lr / config_.lr) : 0.0;
  const double weight_decay = m.weight_decay ? *m.weight_decay : config_.weight_decay;
  const Range owned = slab_.owned();
  float* master = slab_.master().as<float>();
  float* grad = slab_.grad_origin();
  auto* mirror = static_cast<std::uint16_t*>(slab_.mirror_origin());
  const bool bf16 = slab_.mirror_dtype() == core::DType::bf16;
  const auto& tensors = slab_.layout().parameters();
  std::vector<float> orthogonal;
  for (const int index : plan_.touched) {
    const MuonMatrix& matrix = plan_.matrices[static_cast<std::size_t>(index)];
    const Range mine = matrix.range().intersect(owned);
    if (skip) {
      for (std::int64_t i = mine.begin; i < mine.end; ++i) grad[i] = 0.0f;
      continue;
    }
    orthogonal.resize(static_cast<std::size_t>(matrix.rows * matrix.cols));
    newton_schulz_cpu(assembly_.as<float>() + matrix.packed, matrix.rows, matrix.cols, static_cast<int>(m.ns_steps),
                      static_cast<float>(m.eps), orthogonal.data());
    const ParamSpec& spec = tensors[static_cast<std::size_t>(matrix.tensor)].spec;
    const double rate = muon_lr * static_cast<double>(spec.lr_scale);
    const MuonWeightParams p{static_cast<float>(1.0 - rate * (spec.decay ? weight_decay : 0.0)),
                             static_cast<float>(muon_adjusted_lr(rate, m.adjust_lr, matrix.rows, matrix.cols))};
#pragma omp parallel for schedule(static) if (mine.size() >= kParallelElements)
    for (std::int64_t i = mine.begin; i < mine.end; ++i) {
      float& w = master[i - owned.begin];
      w = muon_weight(w, orthogonal[static_cast<std::size_t>(i - matrix.offset)], p);
      write_back(w, grad[i], mirror[i], bf16);
    }
  }
}

void Muon::update(double lr) {
  StepScalars& s = *scalars();
  const bool skip = skips_step(config_.nonfinite, s.nonfinite);
  adamw_update_chunks_cpu(adamw_owned_span_cpu(slab_, exp_avg_, exp_avg_sq_), chunks(), slab_.segments(),
                          adamw_step_params(config_, lr), s, skip, plan_.is_matrix);
  update_matrices(lr, skip);
  finish_update(s, skip);
}

}  // namespace optim
