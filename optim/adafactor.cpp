#include "optim/adafactor.h"

#include <cstring>
#include <limits>

#include "core/error.h"
#include "core/half.h"
#include "optim/device_table.h"
#include "optim/update_epilogue.h"

namespace optim {

namespace {

core::Buffer zeroed(const core::DeviceContext& context, std::size_t bytes) {
  core::Buffer b(context.device(), bytes);
  b.fill_bytes(0, context.stream());
  return b;
}

// Runs visit(i, item, seg, info) for every item i of the plan (its segment and the segment's
// plan), the items in parallel: each writes only what belongs to it.
template <typename Visit>
void for_each_item(const AdafactorPlan& plan, const std::vector<Segment>& segments, Visit visit) {
  const auto item_count = static_cast<std::int64_t>(plan.items.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t i = 0; i < item_count; ++i) {
    const AdafactorItem& item = plan.items[static_cast<std::size_t>(i)];
    visit(i, item, segments[static_cast<std::size_t>(item.segment)],
          plan.segments[static_cast<std::size_t>(item.segment)]);
  }
}

// Runs visit(el, r, c) for the elements of a tile item that lie in its segment, column by column
// (el = item.first + r * cols + c, r the item's row).
template <typename Visit>
void for_each_tile_element(const AdafactorItem& item, const Segment& seg, Visit visit) {
  for (std::int64_t c = 0; c < seg.cols; ++c) {
    for (std::int32_t r = 0; r < item.count; ++r) {
      const std::int64_t el = item.first + r * seg.cols + c;
      if (el < seg.offset || el >= seg.offset + seg.length) continue;
      visit(el, r, c);
    }
  }
}

}  // namespace

Adafactor::Adafactor(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context,
                     std::int64_t chunk_elements)
    : Optimizer(config, slab, context, chunk_elements),
      plan_(make_adafactor_plan(slab.layout(), slab.segments(), chunk_elements)) {
  for (const auto& t : slab.layout().parameters()) {
    if (t.spec.factored && t.spec.shape[1] > 0 && t.spec.shape[0] > std::numeric_limits<std::int32_t>::max()) {
      throw core::Error("adafactor: factored tensor '" + t.spec.name + "' has too many rows");
    }
  }
  row_col_state_ = zeroed(context, static_cast<std::size_t>(plan_.row_col_state_size) * sizeof(float));
  row_partials_ = zeroed(context, static_cast<std::size_t>(plan_.row_partials_size) * sizeof(double));
  v_state_ = zeroed(context, static_cast<std::size_t>(plan_.v_state_size) * sizeof(float));
  if (config.adafactor.beta1) exp_avg_ = make_state(core::DType::f32);
  stats_ = zeroed(context, static_cast<std::size_t>(plan_.stats_size) * sizeof(double));
  u_stats_ = zeroed(context, static_cast<std::size_t>(plan_.u_stats_size) * sizeof(double));
  item_partials_ = zeroed(context, plan_.items.size() * sizeof(double));
  grad_partials_ = zeroed(context, plan_.items.size() * sizeof(double));
  nonfinite_partials_ = zeroed(context, plan_.items.size() * sizeof(unsigned long long));
  col_partials_ = zeroed(context, static_cast<std::size_t>(plan_.col_partials_size) * sizeof(float));
  if (on_cuda()) {
    items_ = table_on_device(context, plan_.items);
    segment_info_ = table_on_device(context, plan_.segments);
    reduce_stats_ = table_on_device(context, plan_.reduce_stats);
    reduce_u_ = table_on_device(context, plan_.reduce_u);
    ema_items_ = table_on_device(context, plan_.ema_items);
    context.synchronize();  // the host tables must outlive the copies
  }
}

std::vector<Partial> Adafactor::phase_partials(int phase) {
  if (phase == 0) {
    auto partials = Optimizer::phase_partials(0);  // the gradient statistics
    partials.push_back({stats_.data(), core::DType::f64, static_cast<std::size_t>(plan_.stats_size)});
    return partials;
  }
  if (phase == 1) return {{u_stats_.data(), core::DType::f64, static_cast<std::size_t>(plan_.u_stats_size)}};
  return {};
}

std::vector<StateBuffer> Adafactor::state_buffers() {
  // R and C of a factored tensor belong to the whole tensor (every rank holding part of it keeps
  // the same copy); v of a non-factored segment is packed.
  std::vector<StatePiece> row_col, v;
  const auto& tensors = slab_.layout().parameters();
  for (std::size_t i = 0; i < plan_.segments.size(); ++i) {
    const AdafactorSegment& info = plan_.segments[i];
    const Segment& seg = slab_.segments()[i];
    if (info.row_state >= 0) {
      row_col.push_back({tensors[static_cast<std::size_t>(seg.tensor)].range(), info.row_state,
                         static_cast<std::int64_t>(seg.rows) + seg.cols, true});
    }
    if (info.v_state >= 0) v.push_back({{seg.offset, seg.offset + seg.length}, info.v_state, seg.length});
  }
  std::vector<StateBuffer> s = {{"row_col", core::DType::f32, &row_col_state_, row_col, 1, true},
                                {"v", core::DType::f32, &v_state_, v, 1, true}};
  if (config_.adafactor.beta1) s.push_back({"exp_avg", core::DType::f32, &exp_avg_});
  return s;
}

AdafactorStepParams Adafactor::step_params(double lr) const {
  const AdafactorConfig& a = config_.adafactor;
  AdafactorStepParams p;
  p.eps1 = a.eps1;
  p.eps2 = a.eps2;
  p.clip_threshold = a.clip_threshold;
  p.decay_rate = a.decay_rate;
  p.beta1 = a.beta1 ? *a.beta1 : -1.0;
  p.relative_step = a.relative_step;
  p.scale_parameter = a.scale_parameter;
  p.warmup_init = a.warmup_init;
  p.eps1_mode = a.eps1_mode;
  p.decay_scale = a.decay_scale;
  return with_shared_step_fields(p, config_, lr);
}

AdafactorDeviceView Adafactor::device_view() {
  return AdafactorDeviceView{slab_.master().as<float>(),
                             slab_.grad_origin(),
                             slab_.mirror_origin(),
                             slab_.mirror_dtype(),
                             slab_.owned().begin,
                             slab_.segment_table(),
                             segment_info_.as<AdafactorSegment>(),
                             items_.as<AdafactorItem>(),
                             static_cast<std::int64_t>(plan_.items.size()),
                             reduce_stats_.as<AdafactorReduceItem>(),
                             static_cast<std::int64_t>(plan_.reduce_stats.size()),
                             reduce_u_.as<AdafactorReduceItem>(),
                             static_cast<std::int64_t>(plan_.reduce_u.size()),
                             ema_items_.as<AdafactorEmaItem>(),
                             static_cast<std::int64_t>(plan_.ema_items.size()),
                             row_col_state_.as<float>(),
                             row_partials_.as<double>(),
                             v_state_.as<float>(),
                             exp_avg_.as<float>(),
                             stats_.as<double>(),
                             plan_.stats_size,
                             u_stats_.as<double>(),
                             item_partials_.as<double>(),
                             grad_partials_.as<double>(),
                             nonfinite_partials_.as<unsigned long long>(),
                             col_partials_.as<float>(),
                             scalars()};
}

void Adafactor::run_first_phase(double lr) {
  const AdafactorStepParams p = step_params(lr);
  if (!on_cuda()) {
    statistics_cpu(p);
    return;
  }
  stats_.fill_bytes(0, context().stream());
  launch_adafactor_statistics(device_view(), p, context().stream());
}

void Adafactor::run_middle_phase(int phase, double lr) {
  const AdafactorStepParams p = step_params(lr);
  if (!on_cuda()) {
    second_moments_cpu(p, lr);
    return;
  }
  u_stats_.fill_bytes(0, context().stream());
  launch_adafactor_second_moments(device_view(), p, context().stream());
}

void Adafactor::update(double lr) {
  const AdafactorStepParams p = step_params(lr);
  if (!on_cuda()) {
    update_cpu(p, lr);
    return;
  }
  const AdafactorDeviceView v = device_view();
  launch_adafactor_update(v, p, context().stream());
}

// ---- CPU reference -------------------------------------------------------------------------

void Adafactor::statistics_cpu(const AdafactorStepParams& p) {
  StepScalars& s = *scalars();
  const float* grad = slab_.grad_origin();
  const float* master = slab_.master().as<float>();
  const std::int64_t owned_begin = slab_.owned().begin;
  double* stats = stats_.as<double>();
  double* partials = item_partials_.as<double>();
  double* grad_partials = grad_partials_.as<double>();
  auto* nonfinite_partials = nonfinite_partials_.as<unsigned long long>();
  float* col_partials = col_partials_.as<float>();
  const auto& segments = slab_.segments();
  std::memset(stats, 0, stats_.bytes());

  const auto item_count = static_cast<std::int64_t>(plan_.items.size());
  for_each_item(plan_, segments,
                [&](std::int64_t i, const AdafactorItem& item, const Segment& seg, const AdafactorSegment& info) {
                  const std::int64_t lo = seg.offset, hi = seg.offset + seg.length;
                  double weight_sq = 0, grad_sq = 0;
                  unsigned long long nonfinite = 0;
                  // Statistics of the unclipped gradient; a non-finite element counts as 0 (and is counted).
                  auto squared_grad = [&](std::int64_t e) {
                    if (p.scale_parameter) {
                      const double w = master[e - owned_begin];
                      weight_sq += w * w;
                    }
                    const float g = grad[e];
                    if (!fp::finite(g)) {
                      ++nonfinite;
                      return 0.0f;
                    }
                    const float g2 = fp::mul(g, g);
                    grad_sq += g2;
                    return g2;
                  };
                  if (item.kind == kTileItem) {
                    const std::int64_t cols = seg.cols;
                    std::vector<double> col_sum(static_cast<std::size_t>(cols), 0.0);
                    for (std::int32_t r = 0; r < item.count; ++r) {
                      double row_sum = 0;
                      for (std::int64_t c = 0; c < cols; ++c) {
                        const std::int64_t e = item.first + r * cols + c;
                        if (e < lo || e >= hi) continue;
                        const double g2 = squared_grad(e);
                        row_sum += g2;
                        col_sum[static_cast<std::size_t>(c)] += g2;
                      }
                      stats[info.row_stats + item.row0 + r] = row_sum;
                    }
                    for (std::int64_t c = 0; c < cols; ++c) {
                      col_partials[item.col_partials + c] = static_cast<float>(col_sum[static_cast<std::size_t>(c)]);
                    }
                  } else {
                    for (std::int64_t e = item.first; e < item.first + item.count; ++e) squared_grad(e);
                  }
                  partials[i] = weight_sq;
                  grad_partials[i] = grad_sq;
                  nonfinite_partials[i] = nonfinite;
                });

  const auto reduce_count = static_cast<std::int64_t>(plan_.reduce_stats.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t k = 0; k < reduce_count; ++k) {
    const AdafactorReduceItem& r = plan_.reduce_stats[static_cast<std::size_t>(k)];
    if (r.kind == kReduceGrad) {
      double sum = 0;
      unsigned long long count = 0;
      for (std::int64_t i = 0; i < item_count; ++i) {
        sum += grad_partials[i];
        count += nonfinite_partials[i];
      }
      s.grad_sq_sum = sum;
      s.nonfinite = count;
      continue;
    }
    const AdafactorSegment& info = plan_.segments[static_cast<std::size_t>(r.segment)];
    const Segment& seg = segments[static_cast<std::size_t>(r.segment)];
    if (r.kind == kReduceColumns) {
      const std::int64_t end = std::min<std::int64_t>(r.col0 + kAdafactorReduceColumns, seg.cols);
      for (std::int64_t c = r.col0; c < end; ++c) {
        double sum = 0;
        for (std::int64_t t = 0; t < info.item_count; ++t)
          sum += col_partials[info.first_col_partial + t * seg.cols + c];
        stats[info.row_stats + seg.rows + c] = sum;
      }
    } else {
      double sum = 0;
      for (std::int64_t t = 0; t < info.item_count; ++t) sum += partials[info.first_item + t];
      stats[info.weight_stats] = sum;
    }
  }
}

double Adafactor::row_mean(const AdafactorSegment& info, const Segment& seg) const {
  if (!info.factored || seg.rows == 0) return 0.0;
  const double* partials = row_partials_.as<double>() + info.first_row_partial;
  double total = 0;
  for (std::int64_t k = 0; k < info.row_partial_count; ++k) total += partials[k];
  return total / static_cast<double>(seg.rows);
}

void Adafactor::second_moments_cpu(const AdafactorStepParams& p, double lr) {
  const StepScalars& s = *scalars();
  double* u_stats = u_stats_.as<double>();
  std::memset(u_stats, 0, u_stats_.bytes());
  if (skips_step(p.policy, s.nonfinite)) return;
  const float clip = clip_coefficient(s.grad_sq_sum, p.max_norm);
  const long long t = s.step + 1;
  const double beta2 = adafactor_beta2(p, t);
  const double* stats = stats_.as<double>();
  float* row_col = row_col_state_.as<float>();
  double* row_partials = row_partials_.as<double>();
  const auto& segments = slab_.segments();

  // C: EMA of the row and column statistics (of the clipped gradient); partial sums of the new rows.
  const double clip_sq = static_cast<double>(clip) * static_cast<double>(clip);
  for (const AdafactorEmaItem& item : plan_.ema_items) {
    const Segment& seg = segments[static_cast<std::size_t>(item.segment)];
    const AdafactorSegment& info = plan_.segments[static_cast<std::size_t>(item.segment)];
    float* state = row_col + info.row_state + (item.rows ? 0 : seg.rows) + item.begin;
    const double* sums = stats + info.row_stats + (item.rows ? 0 : seg.rows) + item.begin;
    const double count = item.rows ? seg.cols : seg.rows;
    double total = 0;
    for (std::int32_t i = 0; i < item.count; ++i) {
      state[i] = adafactor_ema(p, beta2, state[i], clip_sq * sums[i] / count);
      total += state[i];
    }
    if (item.rows) row_partials[item.row_partial] = total;
  }

  // D: per-item sums of U*U (and the full-v EMA).
  const float* grad = slab_.grad_origin();
  float* v_state = v_state_.as<float>();
  double* partials = item_partials_.as<double>();
  for_each_item(plan_, segments,
                [&](std::int64_t i, const AdafactorItem& item, const Segment& seg, const AdafactorSegment& info) {
                  const AdafactorElementParams e =
                      adafactor_element_params(p, t, clip, lr * seg.lr_scale, seg.decay, stats[info.weight_stats], 0.0,
                                               info.numel, row_mean(info, seg));
                  double u_sq = 0;
                  if (item.kind == kTileItem) {
                    const float* R = row_col + info.row_state;
                    const float* C = R + seg.rows;
                    for_each_tile_element(item, seg, [&](std::int64_t el, std::int32_t r, std::int64_t c) {
                      const float u =
                          adafactor_u(adafactor_grad(grad[el], clip), adafactor_factored_v(e, R[item.row0 + r], C[c]));
                      u_sq += static_cast<double>(u) * u;
                    });
                  } else {
                    for (std::int64_t el = item.first; el < item.first + item.count; ++el) {
                      const float g = adafactor_grad(grad[el], clip);
                      const float u = adafactor_u(g, adafactor_full_v(e, v_state[info.v_state + (el - seg.offset)], g));
                      u_sq += static_cast<double>(u) * u;
                    }
                  }
                  partials[i] = u_sq;
                });

  // E: per-tensor sums of U*U.
  for (const AdafactorReduceItem& r : plan_.reduce_u) {
    const AdafactorSegment& info = plan_.segments[static_cast<std::size_t>(r.segment)];
    double sum = 0;
    for (std::int64_t k = 0; k < info.item_count; ++k) sum += partials[info.first_item + k];
    u_stats[info.u_stats] = sum;
  }
}

void Adafactor::update_cpu(const AdafactorStepParams& p, double lr) {
  StepScalars& s = *scalars();
  float* grad = slab_.grad_origin();
  const bool skip = skips_step(p.policy, s.nonfinite);
  const auto& segments = slab_.segments();
  if (skip) {
    for (const Segment& seg : segments) std::fill(grad + seg.offset, grad + seg.offset + seg.length, 0.0f);
    finish_update(s, true);
    return;
  }
  const float clip = clip_coefficient(s.grad_sq_sum, p.max_norm);
  const long long t = s.step + 1;
  const double* stats = stats_.as<double>();
  const double* u_stats = u_stats_.as<double>();
  const float* row_col = row_col_state_.as<float>();
  const float* v_state = v_state_.as<float>();
  float* master = slab_.master().as<float>();
  float* exp_avg = exp_avg_.as<float>();
  auto* mirror = static_cast<std::uint16_t*>(slab_.mirror_origin());
  const bool bf16 = slab_.mirror_dtype() == core::DType::bf16;
  const std::int64_t owned_begin = slab_.owned().begin;

  for_each_item(plan_, segments,
                [&](std::int64_t, const AdafactorItem& item, const Segment& seg, const AdafactorSegment& info) {
                  const AdafactorElementParams e =
                      adafactor_element_params(p, t, clip, lr * seg.lr_scale, seg.decay, stats[info.weight_stats],
                                               u_stats[info.u_stats], info.numel, row_mean(info, seg));
                  auto apply = [&](std::int64_t el, float v) {
                    const std::int64_t local = el - owned_begin;
                    const float u = adafactor_u(adafactor_grad(grad[el], clip), v);
                    adafactor_apply(e, master[local], e.use_beta1 ? exp_avg + local : nullptr, u);
                    write_back(master[local], grad[el], mirror[el], bf16);
                  };
                  if (item.kind == kTileItem) {
                    const float* R = row_col + info.row_state;
                    const float* C = R + seg.rows;
                    for_each_tile_element(item, seg, [&](std::int64_t el, std::int32_t r, std::int64_t c) {
                      apply(el, adafactor_factored_v(e, R[item.row0 + r], C[c]));
                    });
                  } else {
                    for (std::int64_t el = item.first; el < item.first + item.count; ++el) {
                      apply(el, adafactor_full_v_read(e, v_state[info.v_state + (el - seg.offset)]));
                    }
                  }
                });
  finish_update(s, false);
}

}  // namespace optim
