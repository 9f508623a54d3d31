#include "optim/muon_plan.h"

#include "core/error.h"

namespace optim {

MuonPlan make_muon_plan(const SlabLayout& layout, Range owned) {
  MuonPlan plan;
  const auto& tensors = layout.parameters();
  plan.is_matrix.assign(tensors.size(), false);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const SlabTensor& t = tensors[i];
    if (!t.spec.hidden_matrix) continue;
    if (t.spec.shape.size() != 2) {
      throw core::Error("muon: hidden matrix '" + t.spec.name + "' has shape " + core::shape_str(t.spec.shape) +
                        " (expected 2-D)");
    }
    plan.is_matrix[i] = true;
    const std::int64_t cols = t.spec.shape[1];
    std::vector<std::int64_t> blocks;  // row counts
    if (t.spec.parts.empty()) {
      blocks.push_back(t.spec.shape[0]);
    } else {
      for (const ParamPart& part : t.spec.parts) blocks.push_back(part.rows);
    }
    const std::int64_t stacked = t.spec.stacked_rows;
    std::int64_t row = 0;
    for (const std::int64_t rows : blocks) {
      if (stacked > 0 && rows % stacked != 0) {
        throw core::Error("muon: hidden matrix '" + t.spec.name + "' has blocks of " + std::to_string(rows) +
                          " rows, not a multiple of its stacked_rows " + std::to_string(stacked));
      }
      const std::int64_t step = stacked > 0 ? stacked : rows;
      for (std::int64_t r = 0; r < rows && cols > 0; r += step) {
        MuonMatrix m;
        m.offset = t.offset + (row + r) * cols;
        m.rows = step;
        m.cols = cols;
        m.packed = plan.packed_elements;
        m.tensor = static_cast<int>(i);
        plan.packed_elements += step * cols;
        if (!m.range().intersect(owned).empty()) plan.touched.push_back(static_cast<int>(plan.matrices.size()));
        plan.matrices.push_back(m);
      }
      row += rows;
    }
  }
  return plan;
}

}  // namespace optim
