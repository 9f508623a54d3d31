#include "optim/adamw.h"

#include "core/half.h"
#include "optim/update_epilogue.h"

namespace optim {

AdamW::AdamW(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context, std::int64_t chunk_elements)
    : Optimizer(config, slab, context, chunk_elements),
      exp_avg_(make_state(core::DType::f32)),
      exp_avg_sq_(make_state(core::DType::f32)) {}

std::vector<StateBuffer> AdamW::state_buffers() {
  return {{"exp_avg", core::DType::f32, &exp_avg_}, {"exp_avg_sq", core::DType::f32, &exp_avg_sq_}};
}

AdamWStepParams adamw_step_params(const OptimizerConfig& config, double lr) {
  AdamWStepParams params;
  params.lr = lr;
  params.beta1 = config.beta1;
  params.beta2 = config.beta2;
  params.eps = config.eps;
  params.weight_decay = config.weight_decay;
  params.max_norm = config.grad_clip;
  params.policy = config.nonfinite;
  return params;
}

void AdamW::update(double lr) {
  const AdamWStepParams params = adamw_step_params(config_, lr);
  if (!on_cuda()) {
    update_cpu(params);
    return;
  }
  const AdamWBuffers buffers{slab_.master().as<float>(), exp_avg_.as<float>(),  exp_avg_sq_.as<float>(),
                             slab_.grad_origin(),        slab_.mirror_origin(), slab_.mirror_dtype(),
                             slab_.owned().begin};
  launch_adamw_update(buffers, chunk_table(), num_chunks(), slab_.segment_table(), scalars(), params,
                      context().stream());
}

void AdamW::update_cpu(const AdamWStepParams& params) {
  StepScalars& s = *scalars();
  const bool skip = skips_step(params.policy, s.nonfinite);
  const float clip = clip_coefficient(s.grad_sq_sum, params.max_norm);
  const long long t = s.step + 1;
  float* master = slab_.master().as<float>();
  float* m = exp_avg_.as<float>();
  float* v = exp_avg_sq_.as<float>();
  float* grad = slab_.grad_origin();
  auto* mirror = static_cast<std::uint16_t*>(slab_.mirror_origin());
  const bool bf16 = slab_.mirror_dtype() == core::DType::bf16;
  const std::int64_t owned_begin = slab_.owned().begin;
  const auto& segments = slab_.segments();
  const auto& work = chunks();
  const auto count = static_cast<std::int64_t>(work.size());

#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t c = 0; c < count; ++c) {
    const WorkChunk& chunk = work[static_cast<std::size_t>(c)];
    const Segment& seg = segments[static_cast<std::size_t>(chunk.segment)];
    const AdamWElementParams e = adamw_element_params(params, clip, t, seg.lr_scale, seg.decay);
    for (std::int64_t i = chunk.offset; i < chunk.offset + chunk.length; ++i) {
      if (!skip) {
        const std::int64_t local = i - owned_begin;
        adamw_element(master[local], m[local], v[local], grad[i], e);
        write_back(master[local], grad[i], mirror[i], bf16);
      } else {
        grad[i] = 0.0f;
      }
    }
  }
  finish_update(s, skip);
}

}  // namespace optim
