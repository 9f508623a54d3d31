#include "optim/newton_schulz_buffers.h"

#include <algorithm>
#include <utility>

#include "optim/muon_gemm.h"

namespace optim {

NewtonSchulzBuffers newton_schulz_buffers(const MuonPlan& plan) {
  auto shape = [&](int index) {
    const MuonMatrix& m = plan.matrices[static_cast<std::size_t>(index)];
    return std::make_pair(std::min(m.rows, m.cols), std::max(m.rows, m.cols));
  };
  NewtonSchulzBuffers buffers;
  buffers.order = plan.touched;
  std::stable_sort(buffers.order.begin(), buffers.order.end(), [&](int a, int b) { return shape(a) < shape(b); });
  for (std::size_t k = 0; k < buffers.order.size(); ++k) {
    const auto [r, c] = shape(buffers.order[k]);
    if (k == 0 || shape(buffers.order[k - 1]) != shape(buffers.order[k])) {
      buffers.groups.push_back({r, c, 0, buffers.x_elements, buffers.gram_elements});
    }
    NewtonSchulzGroup& group = buffers.groups.back();
    ++group.batch;
    buffers.gram_elements += NewtonSchulzGemms::gram_stride(r);
    buffers.x.push_back(buffers.x_elements);
    buffers.x_elements += NewtonSchulzGemms::x_stride(r, c);
  }
  return buffers;
}

}  // namespace optim
