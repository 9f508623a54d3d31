#include "optim/newton_schulz.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "optim/float_ops.h"
#include "optim/muon_math.h"

namespace optim {

namespace {

// Products smaller than this run on one thread: a parallel region costs more than they do.
constexpr std::int64_t kParallelMultiplies = std::int64_t{1} << 20;

// c[m, n] = sum_k a[m, k] * (b_transposed ? b[n, k] : b[k, n]), accumulated in double, rounded once.
void matmul(const float* a, const float* b, bool b_transposed, std::int64_t m, std::int64_t k, std::int64_t n,
            float* c) {
#pragma omp parallel for schedule(static) if (m * n * k >= kParallelMultiplies)
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (std::int64_t l = 0; l < k; ++l) {
        sum += static_cast<double>(a[i * k + l]) * (b_transposed ? b[j * k + l] : b[l * n + j]);
      }
      c[i * n + j] = static_cast<float>(sum);
    }
  }
}

}  // namespace

void newton_schulz_cpu(const float* u, std::int64_t rows, std::int64_t cols, int steps, float eps, float* out) {
  const bool transposed = rows > cols;
  const std::int64_t r = transposed ? cols : rows;  // X is [r, c] with r <= c
  const std::int64_t c = transposed ? rows : cols;
  std::vector<float> x(static_cast<std::size_t>(r * c));
  double sum_sq = 0;
  for (std::int64_t i = 0; i < rows * cols; ++i) sum_sq += static_cast<double>(u[i]) * u[i];
  const float norm = std::max(static_cast<float>(std::sqrt(sum_sq)), eps);
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      x[static_cast<std::size_t>(transposed ? j * c + i : i * c + j)] = fp::div(u[i * cols + j], norm);
    }
  }
  std::vector<float> gram(static_cast<std::size_t>(r * r)), gram_sq(gram.size()), bx(x.size());
  for (int step = 0; step < steps; ++step) {
    matmul(x.data(), x.data(), true, r, c, r, gram.data());
    matmul(gram.data(), gram.data(), false, r, r, r, gram_sq.data());
    for (std::size_t i = 0; i < gram.size(); ++i) {
      gram[i] = fp::add(fp::mul(kMuonNsB, gram[i]), fp::mul(kMuonNsC, gram_sq[i]));
    }
    matmul(gram.data(), x.data(), false, r, r, c, bx.data());
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = fp::add(fp::mul(kMuonNsA, x[i]), bx[i]);
  }
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      out[i * cols + j] = x[static_cast<std::size_t>(transposed ? j * c + i : i * c + j)];
    }
  }
}

}  // namespace optim
