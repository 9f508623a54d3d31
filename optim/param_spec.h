// What a model declares for each parameter; the slab lays these out in the order given.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace optim {

// normal(0, init_std); zeros; ones; xavier_uniform (U(-a, a), a = init_gain * sqrt(6 / (rows + cols)));
// orthogonal (a random orthogonal matrix, rows x cols, scaled by init_gain).
enum class InitKind { normal, zeros, ones, xavier_uniform, orthogonal };

// A logical tensor inside a stored one: `rows` consecutive rows of a 2-D parameter. Models keep
// q/k/v (and gate/up) in one matrix so one GEMM computes them, while the optimizers must see
// them as the separate tensors they are (Adafactor's statistics and relative step are per tensor).
struct ParamPart {
  std::string name;
  std::int64_t rows = 0;
};

struct ParamSpec {
  std::string name;
  core::Shape shape;
  bool decay = true;      // weight decay applies (norm weights and biases: false)
  bool factored = false;  // Adafactor keeps row/column statistics (2-D tensors only)
  float lr_scale = 1.0f;  // multiplies the step's learning rate for this tensor
  // A 2-D weight between hidden activations (not an embedding, output head, norm, bias or state):
  // matrix-wise optimizers (Muon) update these as matrices, everything else element by element.
  bool hidden_matrix = false;
  // hidden_matrix only: 0, or the rows of each of the independent matrices stacked in the
  // (logical) tensor, e.g. E29a's input projection [W_x; W_z], which are then updated one by one.
  std::int64_t stacked_rows = 0;
  InitKind init = InitKind::normal;
  float init_std = 0.02f;  // standard deviation for InitKind::normal
  float init_gain = 1.0f;  // scale of InitKind::xavier_uniform and InitKind::orthogonal
  // Empty: the parameter is one logical tensor. Otherwise its row blocks in order (rows summing
  // to shape[0]), each a logical tensor for the optimizers (SlabLayout::parameters()).
  std::vector<ParamPart> parts;
};

}  // namespace optim
