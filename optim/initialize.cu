// Device side of seeded initialisation (initialize_kernel.h): the weights are drawn where they
// live, so start-up costs no host loop over the model and no host-to-device copy of it.
#include "core/error.h"
#include "optim/initialize_kernel.h"

namespace optim {

namespace {

// blockIdx.y: the piece; the blocks of x stride over its elements.
__global__ void initialize_kernel(const InitPiece* __restrict__ pieces, float* __restrict__ master,
                                  std::int64_t owned_begin) {
  const InitPiece piece = pieces[blockIdx.y];
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t g = piece.begin + static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < piece.end;
       g += stride) {
    master[g - owned_begin] = init_value(piece, g);
  }
}

}  // namespace

void launch_initialize(const InitPiece* pieces, int count, float* master, std::int64_t owned_begin,
                       cudaStream_t stream) {
  if (count == 0) return;
  // 65,535 is the limit of grid y; larger tables go in slices.
  for (int first = 0; first < count; first += 65535) {
    const dim3 grid(256, static_cast<unsigned>(std::min(count - first, 65535)));
    initialize_kernel<<<grid, 256, 0, stream>>>(pieces + first, master, owned_begin);
    CUDA_CHECK_LAUNCH("initialize_kernel");
  }
}

}  // namespace optim
