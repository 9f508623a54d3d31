#include "optim/muon.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "optim/device_table.h"
#include "optim/muon_math.h"
#include "optim/newton_schulz.h"
#include "optim/newton_schulz_buffers.h"
#include "optim/update_epilogue.h"

namespace optim {

namespace {
// Element loops shorter than this run on one thread: a parallel region costs more than they do.
constexpr std::int64_t kParallelElements = std::int64_t{1} << 16;
}  // namespace

Muon::Muon(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context, std::int64_t chunk_elements)
    : Optimizer(config, slab, context, chunk_elements), plan_(make_muon_plan(slab.layout(), slab.owned())) {
  exp_avg_ = make_state(core::DType::f32);
  exp_avg_sq_ = make_state(core::DType::f32);
  assembly_ = core::Buffer(context.device(), static_cast<std::size_t>(plan_.packed_elements) * sizeof(float));
  assembly_.fill_bytes(0, context.stream());
  if (on_cuda()) prepare_cuda(context, chunk_elements);
}

void Muon::prepare_cuda(const core::DeviceContext& context, std::int64_t chunk_elements) {
  const auto& tensors = slab_.layout().parameters();
  const Range owned = slab_.owned();
  const NewtonSchulzBuffers buffers = newton_schulz_buffers(plan_);
  for (const NewtonSchulzGroup& g : buffers.groups) {
    groups_.push_back({g.x, g.gram, std::make_unique<NewtonSchulzGemms>(context.cublaslt(), g.r, g.c, g.batch)});
  }
  std::vector<MuonMatrixInfo> info;
  std::vector<int> table_index(plan_.matrices.size(), -1);
  for (std::size_t k = 0; k < buffers.order.size(); ++k) {
    const MuonMatrix& m = plan_.matrices[static_cast<std::size_t>(buffers.order[k])];
    const ParamSpec& spec = tensors[static_cast<std::size_t>(m.tensor)].spec;
    table_index[static_cast<std::size_t>(buffers.order[k])] = static_cast<int>(info.size());
    info.push_back({m.offset, m.rows, m.cols, m.packed, buffers.x[k], spec.lr_scale, spec.decay ? 1.0f : 0.0f,
                    muon_adjusted_lr(1.0, config_.muon.adjust_lr, m.rows, m.cols)});
  }
  std::vector<MuonChunk> chunks;
  for (const int index : plan_.touched) {
    const MuonMatrix& m = plan_.matrices[static_cast<std::size_t>(index)];
    const Range mine = m.range().intersect(owned);
    for (std::int64_t at = mine.begin; at < mine.end; at += chunk_elements) {
      chunks.push_back({at, static_cast<std::int32_t>(std::min(chunk_elements, mine.end - at)),
                        table_index[static_cast<std::size_t>(index)]});
    }
  }
  std::vector<WorkChunk> adamw;
  for (const WorkChunk& c : this->chunks()) {
    if (!plan_.is_matrix[static_cast<std::size_t>(slab_.segments()[static_cast<std::size_t>(c.segment)].tensor)]) {
      adamw.push_back(c);
    }
  }
  muon_chunk_count_ = static_cast<std::int64_t>(chunks.size());
  adamw_chunk_count_ = static_cast<std::int64_t>(adamw.size());
  muon_chunks_ = table_on_device(context, chunks);
  matrix_info_ = table_on_device(context, info);
  adamw_chunks_ = table_on_device(context, adamw);
  const std::size_t bf16 = 2;
  for (auto& buffer : x_) buffer = core::Buffer(context.device(), static_cast<std::size_t>(buffers.x_elements) * bf16);
  gram_ = core::Buffer(context.device(), static_cast<std::size_t>(buffers.gram_elements) * bf16);
  poly_ = core::Buffer(context.device(), static_cast<std::size_t>(buffers.gram_elements) * bf16);
  context.synchronize();  // the host tables must outlive the copies
}

std::vector<Partial> Muon::phase_partials(int phase) {
  if (phase == 0) return Optimizer::phase_partials(0);
  if (phase == 1) return {{assembly_.data(), core::DType::f32, static_cast<std::size_t>(plan_.packed_elements)}};
  return {};
}

std::int64_t Muon::buffer_bytes() const {
  std::size_t bytes = assembly_.bytes() + gram_.bytes() + poly_.bytes();
  for (const auto& buffer : x_) bytes += buffer.bytes();
  return static_cast<std::int64_t>(bytes);
}

std::vector<StateBuffer> Muon::state_buffers() {
  return {{"exp_avg", core::DType::f32, &exp_avg_}, {"exp_avg_sq", core::DType::f32, &exp_avg_sq_}};
}

double Muon::muon_lr(double lr) const {
  // The schedule scales Muon's rate as it scales optimizer.lr.
  return config_.lr > 0 ? config_.muon.lr * (lr / config_.lr) : 0.0;
}

MuonKernelParams Muon::kernel_params(double lr) const {
  const MuonConfig& m = config_.muon;
  MuonKernelParams p;
  p.momentum = {static_cast<float>(1.0 - m.momentum), m.nesterov ? static_cast<float>(m.momentum) : -1.0f, 1.0f};
  p.max_norm = config_.grad_clip;
  p.policy = config_.nonfinite;
  p.lr = muon_lr(lr);
  p.weight_decay = m.weight_decay ? *m.weight_decay : config_.weight_decay;
  p.eps = static_cast<float>(m.eps);
  return p;
}

void Muon::run_middle_phase(int phase, double lr) {
  (void)phase;
  const MuonKernelParams params = kernel_params(lr);
  if (on_cuda()) {
    CUDA_CHECK(cudaMemsetAsync(assembly_.data(), 0, assembly_.bytes(), context().stream()));
    launch_muon_momentum(muon_chunks_.as<MuonChunk>(), muon_chunk_count_, matrix_info_.as<MuonMatrixInfo>(),
                         slab_.grad_origin(), exp_avg_.as<float>(), slab_.owned().begin, assembly_.as<float>(),
                         scalars(), params, context().stream());
    return;
  }
  const StepScalars& s = *scalars();
  float* assembly = assembly_.as<float>();
  std::fill(assembly, assembly + plan_.packed_elements, 0.0f);
  if (skips_step(params.policy, s.nonfinite)) return;
  MuonMomentumParams p = params.momentum;
  p.clip = clip_coefficient(s.grad_sq_sum, params.max_norm);
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

void Muon::update_cuda(double lr) {
  const MuonKernelParams params = kernel_params(lr);
  const cudaStream_t stream = context().stream();
  const auto* info = matrix_info_.as<MuonMatrixInfo>();
  launch_muon_normalise(info, static_cast<std::int64_t>(plan_.touched.size()), assembly_.as<float>(), x_[0].data(),
                        params, stream);
  const std::size_t bf16 = 2;
  int current = 0;
  for (std::int64_t step = 0; step < config_.muon.ns_steps; ++step) {
    for (const ShapeGroup& g : groups_) {
      g.gemms->iterate(static_cast<const char*>(x_[current].data()) + g.x * bf16,
                       static_cast<char*>(x_[1 - current].data()) + g.x * bf16,
                       static_cast<char*>(gram_.data()) + g.gram * bf16,
                       static_cast<char*>(poly_.data()) + g.gram * bf16, stream);
    }
    current = 1 - current;
  }
  launch_muon_update(muon_chunks_.as<MuonChunk>(), muon_chunk_count_, info, x_[current].data(),
                     slab_.master().as<float>(), slab_.grad_origin(), slab_.mirror_origin(), slab_.mirror_dtype(),
                     slab_.owned().begin, scalars(), params, stream);
  // Last: AdamW's launch over the other tensors also advances the step counter.
  const AdamWBuffers buffers{slab_.master().as<float>(), exp_avg_.as<float>(),  exp_avg_sq_.as<float>(),
                             slab_.grad_origin(),        slab_.mirror_origin(), slab_.mirror_dtype(),
                             slab_.owned().begin};
  launch_adamw_update(buffers, adamw_chunks_.as<WorkChunk>(), adamw_chunk_count_, slab_.segment_table(), scalars(),
                      adamw_step_params(config_, lr), stream);
}

void Muon::update_matrices(double lr, bool skip) {
  const MuonKernelParams params = kernel_params(lr);
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
    newton_schulz_cpu(assembly_.as<float>() + matrix.packed, matrix.rows, matrix.cols,
                      static_cast<int>(config_.muon.ns_steps), params.eps, orthogonal.data());
    const ParamSpec& spec = tensors[static_cast<std::size_t>(matrix.tensor)].spec;
    const double rate = params.lr * static_cast<double>(spec.lr_scale);
    const MuonWeightParams p{
        static_cast<float>(1.0 - rate * (spec.decay ? params.weight_decay : 0.0)),
        static_cast<float>(rate * muon_adjusted_lr(1.0, config_.muon.adjust_lr, matrix.rows, matrix.cols))};
#pragma omp parallel for schedule(static) if (mine.size() >= kParallelElements)
    for (std::int64_t i = mine.begin; i < mine.end; ++i) {
      float& w = master[i - owned.begin];
      w = muon_weight(w, orthogonal[static_cast<std::size_t>(i - matrix.offset)], p);
      write_back(w, grad[i], mirror[i], bf16);
    }
  }
}

void Muon::update(double lr) {
  if (on_cuda()) {
    update_cuda(lr);
    return;
  }
  StepScalars& s = *scalars();
  const bool skip = skips_step(config_.nonfinite, s.nonfinite);
  adamw_update_chunks_cpu(adamw_owned_span_cpu(slab_, exp_avg_, exp_avg_sq_), chunks(), slab_.segments(),
                          adamw_step_params(config_, lr), s, skip, plan_.is_matrix);
  update_matrices(lr, skip);
  finish_update(s, skip);
}

}  // namespace optim
