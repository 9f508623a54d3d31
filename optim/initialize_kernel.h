// The element formula of seeded initialisation, shared by the host loop (initialize.cpp) and the
// device kernel (initialize.cu): each value depends on (seed, tensor, element) alone. Host and
// device draw the same counter-based uniforms; normal values go through logf/cosf, whose device
// versions may differ from the host's in the last bit, so a cuda run's initial weights equal a
// cpu run's to within a few fp32 ulp, not bit for bit (each backend is reproducible on its own
// and independent of the world size).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "core/rng.h"
#include "optim/param_spec.h"

namespace optim {

// One tensor's owned part [begin, end) in global elements.
struct InitPiece {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int64_t tensor_offset = 0;  // global index of the tensor's element 0 (the draw counter origin)
  std::uint64_t seed = 0;          // the tensor's stream
  InitKind kind = InitKind::zeros;
  float scale = 0.0f;               // normal: std; xavier_uniform: bound; orthogonal: gain
  std::int64_t rows = 0, cols = 0;  // orthogonal only
};

LLMTRAIN_HD inline float init_value(const InitPiece& piece, std::int64_t global) {
  const auto i = static_cast<std::uint64_t>(global - piece.tensor_offset);
  switch (piece.kind) {
    case InitKind::normal: return piece.scale * core::normal01(piece.seed, i);
    case InitKind::ones: return 1.0f;
    case InitKind::xavier_uniform: return piece.scale * (2.0f * core::uniform01(piece.seed, i) - 1.0f);
    default: return 0.0f;  // zeros (orthogonal pieces are filled from the host)
  }
}

// master[g - owned_begin] = init_value(piece, g) for every piece of the device table `pieces`.
void launch_initialize(const InitPiece* pieces, int count, float* master, std::int64_t owned_begin,
                       cudaStream_t stream);

}  // namespace optim
