// Linear layer without bias (every projection of Qwen3): y = x @ W^T with W stored [out, in]
// row-major, as torch.nn.Linear. Products are accumulated in double (matmul_cpu.h).
//
// Layouts (row-major): x, dx [rows, in_features]; weight, dweight [out_features, in_features];
// y, dy [rows, out_features].
#pragma once

#include <cstdint>
#include <span>

namespace models::ops {

template <typename Scalar>
void linear_forward_cpu(std::span<const Scalar> x, std::span<const Scalar> weight, std::int64_t rows,
                        std::int64_t in_features, std::int64_t out_features, std::span<Scalar> y);

// dx = dy @ W (written); dweight += dy^T @ x (accumulated).
template <typename Scalar>
void linear_backward_cpu(std::span<const Scalar> dy, std::span<const Scalar> x, std::span<const Scalar> weight,
                         std::int64_t rows, std::int64_t in_features, std::int64_t out_features,
                         std::span<Scalar> dx, std::span<Scalar> dweight);

}  // namespace models::ops
