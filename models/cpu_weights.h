// The fp32 weights a cpu model reads, one lookup for every family: the slab's master (covering
// the whole model), a whole-model copy (ZeRO-1/2 across ranks), or, with ZeRO-3, the ranges the
// model holds from a weight source for a scope (weight_holds.h): `const auto held =
// weights.hold(range, next);`.
#pragma once

#include <span>

#include "models/weight_holds.h"
#include "optim/slab.h"
#include "optim/weight_source.h"

namespace models {

class CpuWeights {
 public:
  // core::Error naming `who` unless the slab is on cpu and one of the three sources exists.
  CpuWeights(optim::Slab& slab, const float* full_weights, optim::WeightSource* source, const char* who);

  // Tensor `tensor`'s weights; with a source, from a held range (core::Error when none holds it).
  std::span<float> of(int tensor) const;
  [[nodiscard]] WeightHolds::Hold hold(optim::Range range, optim::Range next = {}) { return holds_.hold(range, next); }
  WeightHolds& holds() { return holds_; }

 private:
  optim::Slab& slab_;
  float* full_weights_;
  WeightHolds holds_;
};

}  // namespace models
