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

AdamWSpanCpu adamw_owned_span_cpu(Slab& slab, core::Buffer& m, core::Buffer& v) {
  // The moments cover the owned range, like master; the mirror is indexed globally (ZeRO-3 holds
  // only the owned part of it).
  return {slab.master().as<float>(),
          m.as<float>(),
          v.as<float>(),
          slab.grad_origin(),
          static_cast<std::uint16_t*>(slab.mirror_origin()),
          slab.mirror_dtype() == core::DType::bf16,
          slab.owned().begin};
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

void adamw_update_chunks_cpu(const AdamWSpanCpu& owned, const std::vector<WorkChunk>& chunks,
                             const std::vector<Segment>& segments, const AdamWStepParams& params,
                             const StepScalars& scalars, bool skip, const std::vector<bool>& excluded) {
  const float clip = clip_coefficient(scalars.grad_sq_sum, params.max_norm);
  const long long t = scalars.step + 1;
  const auto count = static_cast<std::int64_t>(chunks.size());
#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t c = 0; c < count; ++c) {
    const WorkChunk& chunk = chunks[static_cast<std::size_t>(c)];
    const Segment& seg = segments[static_cast<std::size_t>(chunk.segment)];
    if (!excluded.empty() && excluded[static_cast<std::size_t>(seg.tensor)]) continue;
    const AdamWElementParams e = adamw_element_params(params, clip, t, seg.lr_scale, seg.decay);
    AdamWSpanCpu span = owned;
    span.m += chunk.offset - owned.owned_begin;
    span.v += chunk.offset - owned.owned_begin;
    adamw_update_span_cpu(span, chunk.offset, chunk.length, e, skip);
  }
}

void AdamW::update_cpu(const AdamWStepParams& params) {
  StepScalars& s = *scalars();
  const bool skip = skips_step(params.policy, s.nonfinite);
  adamw_update_chunks_cpu(adamw_owned_span_cpu(slab_, exp_avg_, exp_avg_sq_), chunks(), slab_.segments(), params, s,
                          skip);
  finish_update(s, skip);
}

}  // namespace optim
