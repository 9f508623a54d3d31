// Newton-Schulz orthogonalisation of one matrix (Muon's O = NS_k(U)), the CPU reference: the
// quintic iteration of torch.optim.Muon (muon_math.h's coefficients) in fp32 with products
// accumulated in double. For U = [rows, cols] it works on X = U (U^T when rows > cols, so the
// Gram matrix is the smaller one):
//   X /= max(||X||_F, eps)
//   k times:  A = X X^T;  B = b A + c A A;  X = a X + B X
// and returns X (transposed back). The singular values of the result lie roughly in [0.5, 1.5]
// (not exactly 1: the coefficients favour speed of the small ones over convergence).
#pragma once

#include <cstdint>

namespace optim {

// `u` and `out` are row-major [rows, cols] and may not overlap.
void newton_schulz_cpu(const float* u, std::int64_t rows, std::int64_t cols, int steps, float eps, float* out);

}  // namespace optim
