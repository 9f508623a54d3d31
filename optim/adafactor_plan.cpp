#include "optim/adafactor_plan.h"

#include <algorithm>

#include "core/error.h"

namespace optim {

AdafactorPlan make_adafactor_plan(const SlabLayout& layout, const std::vector<Segment>& segments,
                                  std::int64_t chunk_elements) {
  AdafactorPlan plan;
  const auto& tensors = layout.parameters();

  // Rank-independent layouts: statistics and row/column state for every tensor of the model.
  std::vector<std::int64_t> row_stats(tensors.size(), -1), row_state(tensors.size(), -1);
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    if (!tensors[t].spec.factored) continue;
    const std::int64_t rows = tensors[t].spec.shape[0], cols = tensors[t].spec.shape[1];
    row_stats[t] = plan.stats_size;
    row_state[t] = plan.row_col_state_size;
    plan.stats_size += rows + cols;
    plan.row_col_state_size += rows + cols;
    ++plan.factored_tensors;
  }
  const std::int64_t weight_stats_base = plan.stats_size;
  plan.stats_size += static_cast<std::int64_t>(tensors.size());
  plan.u_stats_size = static_cast<std::int64_t>(tensors.size());

  // This rank's work.
  for (std::size_t si = 0; si < segments.size(); ++si) {
    const Segment& s = segments[si];
    const SlabTensor& tensor = tensors[static_cast<std::size_t>(s.tensor)];
    AdafactorSegment info;
    info.first_item = static_cast<std::int64_t>(plan.items.size());
    info.weight_stats = weight_stats_base + s.tensor;
    info.u_stats = s.tensor;
    info.numel = static_cast<double>(tensor.numel);
    info.tensor = s.tensor;
    info.factored = tensor.spec.factored ? 1 : 0;
    if (info.factored) {
      const std::int64_t cols = s.cols;
      info.row_stats = row_stats[static_cast<std::size_t>(s.tensor)];
      info.row_state = row_state[static_cast<std::size_t>(s.tensor)];
      info.first_col_partial = plan.col_partials_size;
      const std::int64_t local_begin = s.offset - s.tensor_offset;
      const std::int64_t local_end = local_begin + s.length;
      const std::int64_t first_row = local_begin / cols;
      const std::int64_t last_row = (local_end - 1) / cols;  // inclusive
      for (std::int64_t r = first_row; r <= last_row; r += kAdafactorTileRows) {
        AdafactorItem item;
        item.kind = kTileItem;
        item.segment = static_cast<std::int32_t>(si);
        item.row0 = static_cast<std::int32_t>(r);
        item.count = static_cast<std::int32_t>(std::min<std::int64_t>(kAdafactorTileRows, last_row - r + 1));
        item.first = s.tensor_offset + r * cols;
        item.col_partials = plan.col_partials_size;
        plan.col_partials_size += cols;
        plan.items.push_back(item);
      }
      for (std::int32_t c0 = 0; c0 < s.cols; c0 += kAdafactorReduceColumns) {
        plan.reduce_stats.push_back({static_cast<std::int32_t>(si), kReduceColumns, c0});
      }
      info.first_row_partial = plan.row_partials_size;
      for (std::int64_t b = 0; b < s.rows; b += kAdafactorEmaSpan) {
        const auto count = static_cast<std::int32_t>(std::min<std::int64_t>(kAdafactorEmaSpan, s.rows - b));
        plan.ema_items.push_back(
            {b, count, static_cast<std::int32_t>(si), 1, static_cast<std::int32_t>(plan.row_partials_size++)});
      }
      info.row_partial_count = plan.row_partials_size - info.first_row_partial;
      for (std::int64_t b = 0; b < s.cols; b += kAdafactorEmaSpan) {
        const auto count = static_cast<std::int32_t>(std::min<std::int64_t>(kAdafactorEmaSpan, s.cols - b));
        plan.ema_items.push_back({b, count, static_cast<std::int32_t>(si), 0, -1});
      }
    } else {
      info.v_state = plan.v_state_size;
      plan.v_state_size += s.length;
      for (const WorkChunk& c : make_work_chunks({s}, chunk_elements)) {
        AdafactorItem item;
        item.kind = kChunkItem;
        item.segment = static_cast<std::int32_t>(si);
        item.first = c.offset;
        item.count = c.length;
        plan.items.push_back(item);
      }
    }
    info.item_count = static_cast<std::int64_t>(plan.items.size()) - info.first_item;
    plan.reduce_stats.push_back({static_cast<std::int32_t>(si), kReduceWeights, 0});
    plan.reduce_u.push_back({static_cast<std::int32_t>(si), kReduceU, 0});
    plan.segments.push_back(info);
  }
  plan.reduce_stats.push_back({0, kReduceGrad, 0});
  return plan;
}

}  // namespace optim
