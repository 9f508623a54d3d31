// Dense products of row-major matrices for the CPU references (the linear layers and the
// lm_head fused into the loss). Every output element is a sum accumulated in double in a fixed
// order of the reduction index, so results do not depend on the number of OpenMP threads; the
// result is rounded once to the element type. Loops are blocked for cache reuse: fast enough for
// tiny models, not a BLAS. Callers validate shapes; these helpers take raw pointers.
#pragma once

#include <cstdint>

namespace models::ops {

// Whether a product overwrites its output or is added to it (gradient accumulation).
enum class Accumulate { overwrite, add };

// Dot product of two length-n vectors, in double, with a fixed summation order.
template <typename Scalar>
double dot_double(const Scalar* x, const Scalar* y, std::int64_t n) {
  constexpr int kLanes = 8;
  double lane[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lane[l] += static_cast<double>(x[i + l]) * static_cast<double>(y[i + l]);
  }
  for (; i < n; ++i) lane[0] += static_cast<double>(x[i]) * static_cast<double>(y[i]);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// C[i, j] (= or +=) sum_k A[i, k] * B[j, k];  A [m, k], B [n, k], C [m, n].
template <typename Scalar>
void matmul_nt_cpu(const Scalar* a, const Scalar* b, std::int64_t m, std::int64_t n, std::int64_t k, Scalar* c,
                   Accumulate mode);

// C[i, j] (= or +=) sum_k A[i, k] * B[k, j];  A [m, k], B [k, n], C [m, n].
template <typename Scalar>
void matmul_nn_cpu(const Scalar* a, const Scalar* b, std::int64_t m, std::int64_t n, std::int64_t k, Scalar* c,
                   Accumulate mode);

// C[i, j] (= or +=) sum_k A[k, i] * B[k, j];  A [k, m], B [k, n], C [m, n].
template <typename Scalar>
void matmul_tn_cpu(const Scalar* a, const Scalar* b, std::int64_t m, std::int64_t n, std::int64_t k, Scalar* c,
                   Accumulate mode);

}  // namespace models::ops
