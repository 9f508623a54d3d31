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
  params.beta1 = config.beta1;
  params.beta2 = config.beta2;
  params.eps = config.eps;
  return with_shared_step_fields(params, config, lr);
}

void adamw_update_span_cpu(const AdamWSpanCpu& span, std::int64_t offset, std::int64_t length,
                           const AdamWElementParams& e, bool skip) {
  for (std::int64_t k = 0; k < length; ++k) {
    const std::int64_t i = offset + k;
    if (!skip) {
      const std::int64_t local = i - span.owned_begin;
      adamw_element(span.master[local], span.m[k], span.v[k], span.grad[i], e);
      write_back(span.master[local], span.grad[i], span.mirror[i], span.bf16);
    } else {
      span.grad[i] = 0.0f;
    }
  }
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
  // The moments cover the owned range, like master; the mirror is indexed globally (ZeRO-3 holds
  // only the owned part of it).
  const AdamWSpanCpu owned{slab_.master().as<float>(),
                           exp_avg_.as<float>(),
                           exp_avg_sq_.as<float>(),
                           slab_.grad_origin(),
                           static_cast<std::uint16_t*>(slab_.mirror_origin()),
                           slab_.mirror_dtype() == core::DType::bf16,
                           slab_.owned().begin};
  const auto& segments = slab_.segments();
  const auto& work = chunks();
  const auto count = static_cast<std::int64_t>(work.size());

#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t c = 0; c < count; ++c) {
    const WorkChunk& chunk = work[static_cast<std::size_t>(c)];
    const Segment& seg = segments[static_cast<std::size_t>(chunk.segment)];
    const AdamWElementParams e = adamw_element_params(params, clip, t, seg.lr_scale, seg.decay);
    AdamWSpanCpu span = owned;
    span.m += chunk.offset - owned.owned_begin;
    span.v += chunk.offset - owned.owned_begin;
    adamw_update_span_cpu(span, chunk.offset, chunk.length, e, skip);
  }
  finish_update(s, skip);
}

}  // namespace optim
