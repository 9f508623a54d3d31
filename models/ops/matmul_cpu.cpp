// Blocked OpenMP matrix products with double accumulation (see matmul_cpu.h). The NT form is a
// grid of dot products; the NN and TN forms add scaled rows of B into double accumulator rows,
// which keeps the inner loop contiguous and lets each B row serve a block of output rows.
#include "models/ops/matmul_cpu.h"

#include <algorithm>
#include <vector>

namespace models::ops {
namespace {

template <typename Scalar>
void store(Scalar& out, double value, Accumulate mode) {
  out = mode == Accumulate::add ? static_cast<Scalar>(static_cast<double>(out) + value) : static_cast<Scalar>(value);
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// C[i, j] = sum_k A(i, k) * B[k, j] with A(i, k) = a[i * row_stride + k * col_stride].
template <typename Scalar>
void matmul_rows_cpu(const Scalar* a, std::int64_t a_row_stride, std::int64_t a_col_stride, const Scalar* b,
                     std::int64_t m, std::int64_t n, std::int64_t k, Scalar* c, Accumulate mode) {
  constexpr std::int64_t kRowBlock = 8;
  constexpr std::int64_t kColBlock = 512;
  const std::int64_t row_blocks = ceil_div(m, kRowBlock);
  const std::int64_t col_blocks = ceil_div(n, kColBlock);
#pragma omp parallel
  {
    std::vector<double> acc(static_cast<std::size_t>(kRowBlock * kColBlock));
#pragma omp for collapse(2) schedule(static)
    for (std::int64_t rb = 0; rb < row_blocks; ++rb) {
      for (std::int64_t cb = 0; cb < col_blocks; ++cb) {
        const std::int64_t i0 = rb * kRowBlock, i1 = std::min(m, i0 + kRowBlock);
        const std::int64_t j0 = cb * kColBlock, j1 = std::min(n, j0 + kColBlock);
        const std::int64_t width = j1 - j0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (std::int64_t kk = 0; kk < k; ++kk) {
          const Scalar* b_row = b + kk * n + j0;
          for (std::int64_t i = i0; i < i1; ++i) {
            const double scale = static_cast<double>(a[i * a_row_stride + kk * a_col_stride]);
            double* acc_row = acc.data() + (i - i0) * kColBlock;
            for (std::int64_t j = 0; j < width; ++j) acc_row[j] += scale * static_cast<double>(b_row[j]);
          }
        }
        for (std::int64_t i = i0; i < i1; ++i) {
          const double* acc_row = acc.data() + (i - i0) * kColBlock;
          for (std::int64_t j = 0; j < width; ++j) store(c[i * n + j0 + j], acc_row[j], mode);
        }
      }
    }
  }
}

}  // namespace

template <typename Scalar>
void matmul_nt_cpu(const Scalar* a, const Scalar* b, std::int64_t m, std::int64_t n, std::int64_t k, Scalar* c,
                   Accumulate mode) {
  constexpr std::int64_t kRowBlock = 16;
  constexpr std::int64_t kColBlock = 64;
  const std::int64_t row_blocks = ceil_div(m, kRowBlock);
  const std::int64_t col_blocks = ceil_div(n, kColBlock);
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t rb = 0; rb < row_blocks; ++rb) {
    for (std::int64_t cb = 0; cb < col_blocks; ++cb) {
      const std::int64_t i1 = std::min(m, (rb + 1) * kRowBlock);
      const std::int64_t j1 = std::min(n, (cb + 1) * kColBlock);
      for (std::int64_t i = rb * kRowBlock; i < i1; ++i) {
        for (std::int64_t j = cb * kColBlock; j < j1; ++j)
          store(c[i * n + j], dot_double(a + i * k, b + j * k, k), mode);
      }
    }
  }
}

template <typename Scalar>
void matmul_nn_cpu(const Scalar* a, const Scalar* b, std::int64_t m, std::int64_t n, std::int64_t k, Scalar* c,
                   Accumulate mode) {
  matmul_rows_cpu(a, k, 1, b, m, n, k, c, mode);
}

template <typename Scalar>
void matmul_tn_cpu(const Scalar* a, const Scalar* b, std::int64_t m, std::int64_t n, std::int64_t k, Scalar* c,
                   Accumulate mode) {
  matmul_rows_cpu(a, 1, m, b, m, n, k, c, mode);
}

// The three forms share one signature; each is instantiated for float (the models) and double
// (the finite-difference tests).
template <typename Scalar>
using MatmulForm = void(const Scalar*, const Scalar*, std::int64_t, std::int64_t, std::int64_t, Scalar*, Accumulate);
template MatmulForm<float> matmul_nt_cpu<float>;
template MatmulForm<double> matmul_nt_cpu<double>;
template MatmulForm<float> matmul_nn_cpu<float>;
template MatmulForm<double> matmul_nn_cpu<double>;
template MatmulForm<float> matmul_tn_cpu<float>;
template MatmulForm<double> matmul_tn_cpu<double>;

}  // namespace models::ops
