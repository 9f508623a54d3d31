// Where a cpu model's weights come from (cpu_weights.h).
#include "models/cpu_weights.h"

#include <string>

#include "core/error.h"

namespace models {

CpuWeights::CpuWeights(optim::Slab& slab, const float* full_weights, optim::WeightSource* source, const char* who)
    : slab_(slab), full_weights_(const_cast<float*>(full_weights)), holds_(source, slab.layout(), sizeof(float)) {
  if (slab.device().is_cuda() || (full_weights == nullptr && source == nullptr && !(slab.owned() == slab.full()))) {
    throw core::Error(std::string(who) +
                      ": the cpu model needs a cpu slab whose master weights cover the whole model, the whole "
                      "model's weights or a weight source");
  }
}

std::span<float> CpuWeights::of(int tensor) const {
  const optim::SlabTensor& t = slab_.layout().tensors()[static_cast<std::size_t>(tensor)];
  const auto numel = static_cast<std::size_t>(t.numel);
  if (holds_.active()) return {static_cast<float*>(holds_.find(tensor)), numel};
  if (full_weights_ != nullptr) return {full_weights_ + t.offset, numel};
  const auto v = slab_.master_view(tensor);
  return {v.as<float>(), numel};
}

}  // namespace models
