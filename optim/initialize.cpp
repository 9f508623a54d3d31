// Seeded initialisation of the owned master weights (initialize.h): every element's value is a
// function of (seed, tensor index, element index) alone, so any shard of any world size gets the
// same values as the whole model.
#include "optim/initialize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "optim/initialize_kernel.h"

namespace optim {

namespace {

// An orthogonal rows x cols matrix (orthonormal rows or columns, whichever are fewer), by
// modified Gram-Schmidt in fp64 on a counter-based normal matrix, scaled by `gain`.
std::vector<float> orthogonal(std::int64_t rows, std::int64_t cols, std::uint64_t seed, float gain) {
  const bool transpose = rows < cols;
  const std::int64_t n = transpose ? cols : rows,
                     k = transpose ? rows : cols;  // n >= k: k orthonormal columns of length n
  std::vector<double> q(static_cast<std::size_t>(n * k));
  for (std::int64_t i = 0; i < n * k; ++i)
    q[static_cast<std::size_t>(i)] = core::normal01(seed, static_cast<std::uint64_t>(i));
  for (std::int64_t j = 0; j < k; ++j) {
    for (std::int64_t p = 0; p < j; ++p) {
      double dot = 0;
      for (std::int64_t i = 0; i < n; ++i)
        dot += q[static_cast<std::size_t>(i * k + j)] * q[static_cast<std::size_t>(i * k + p)];
      for (std::int64_t i = 0; i < n; ++i)
        q[static_cast<std::size_t>(i * k + j)] -= dot * q[static_cast<std::size_t>(i * k + p)];
    }
    double norm = 0;
    for (std::int64_t i = 0; i < n; ++i)
      norm += q[static_cast<std::size_t>(i * k + j)] * q[static_cast<std::size_t>(i * k + j)];
    norm = std::sqrt(norm);
    for (std::int64_t i = 0; i < n; ++i) q[static_cast<std::size_t>(i * k + j)] /= norm;
  }
  std::vector<float> out(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      const double v = transpose ? q[static_cast<std::size_t>(c * k + r)] : q[static_cast<std::size_t>(r * k + c)];
      out[static_cast<std::size_t>(r * cols + c)] = static_cast<float>(gain * v);
    }
  }
  return out;
}

}  // namespace

static std::vector<InitPiece> init_pieces(const SlabLayout& layout, Range owned, std::uint64_t seed) {
  std::vector<InitPiece> pieces;
  const auto& tensors = layout.tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const SlabTensor& tensor = tensors[t];
    const std::int64_t begin = std::max(owned.begin, tensor.offset),
                       end = std::min(owned.end, tensor.offset + tensor.numel);
    if (begin >= end) continue;
    const ParamSpec& spec = tensor.spec;
    const std::int64_t rows = spec.shape.empty() ? 1 : spec.shape[0];
    const std::int64_t cols = tensor.numel / std::max<std::int64_t>(rows, 1);
    InitPiece piece{.begin = begin,
                    .end = end,
                    .tensor_offset = tensor.offset,
                    .seed = core::splitmix64(seed ^ core::splitmix64(t + 1)),
                    .kind = spec.init};
    switch (spec.init) {
      case InitKind::normal: piece.scale = spec.init_std; break;
      case InitKind::xavier_uniform:
        piece.scale = spec.init_gain * std::sqrt(6.0f / static_cast<float>(rows + cols));
        break;
      case InitKind::orthogonal:
        piece.scale = spec.init_gain;
        piece.rows = rows;
        piece.cols = cols;
        break;
      default: break;
    }
    pieces.push_back(piece);
  }
  return pieces;
}

void initialize_owned(Slab& slab, const core::DeviceContext& context, std::uint64_t seed) {
  const Range owned = slab.owned();
  const std::vector<InitPiece> pieces = init_pieces(slab.layout(), owned, seed);
  // Orthogonal matrices need the whole matrix (Gram-Schmidt): made on the host and the owned
  // part copied into place. They are a family's recurrent D x D matrices, small next to the rest.
  if (context.is_cuda()) {
    std::vector<InitPiece> generated;
    for (const InitPiece& piece : pieces) {
      if (piece.kind != InitKind::orthogonal) generated.push_back(piece);
    }
    core::Buffer table(slab.device(), std::max<std::size_t>(generated.size(), 1) * sizeof(InitPiece));
    core::copy_bytes(table.data(), generated.data(), generated.size() * sizeof(InitPiece), context.stream());
    launch_initialize(static_cast<const InitPiece*>(table.data()), static_cast<int>(generated.size()),
                      static_cast<float*>(slab.master().data()), owned.begin, context.stream());
    for (const InitPiece& piece : pieces) {
      if (piece.kind != InitKind::orthogonal) continue;
      const std::vector<float> matrix = orthogonal(piece.rows, piece.cols, piece.seed, piece.scale);
      core::copy_bytes(static_cast<float*>(slab.master().data()) + (piece.begin - owned.begin),
                       matrix.data() + (piece.begin - piece.tensor_offset),
                       static_cast<std::size_t>(piece.end - piece.begin) * sizeof(float), context.stream());
      context.synchronize();  // `matrix` is pageable host memory about to be freed
    }
    context.synchronize();
  } else {
    float* master = static_cast<float*>(slab.master().data());
    for (const InitPiece& piece : pieces) {
      float* out = master + (piece.begin - owned.begin);
      if (piece.kind == InitKind::orthogonal) {
        const std::vector<float> matrix = orthogonal(piece.rows, piece.cols, piece.seed, piece.scale);
        std::copy(matrix.begin() + (piece.begin - piece.tensor_offset),
                  matrix.begin() + (piece.end - piece.tensor_offset), out);
        continue;
      }
#pragma omp parallel for schedule(static)
      for (std::int64_t g = piece.begin; g < piece.end; ++g) out[g - piece.begin] = init_value(piece, g);
    }
  }
  slab.write_mirror(context);
  context.synchronize();
}

}  // namespace optim
