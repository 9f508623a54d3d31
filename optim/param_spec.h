// What a model declares for each parameter; the slab lays these out in the order given.
#pragma once

#include <string>

#include "core/tensor.h"

namespace optim {

// normal(0, init_std); zeros; ones; xavier_uniform (U(-a, a), a = init_gain * sqrt(6 / (rows + cols)));
// orthogonal (a random orthogonal matrix, rows x cols, scaled by init_gain).
enum class InitKind { normal, zeros, ones, xavier_uniform, orthogonal };

struct ParamSpec {
  std::string name;
  core::Shape shape;
  bool decay = true;        // weight decay applies (norm weights and biases: false)
  bool factored = false;    // Adafactor keeps row/column statistics (2-D tensors only)
  float lr_scale = 1.0f;    // multiplies the step's learning rate for this tensor
  InitKind init = InitKind::normal;
  float init_std = 0.02f;   // standard deviation for InitKind::normal
  float init_gain = 1.0f;   // scale of InitKind::xavier_uniform and InitKind::orthogonal
};

}  // namespace optim
