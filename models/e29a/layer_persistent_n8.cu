// The persistent E29a kernels of slot capacity 8 (layer_persistent_kernels.cuh), both directions.
#include "models/e29a/layer_persistent_kernels.cuh"

namespace models::e29a::kernels::persistent {
E29A_PERSISTENT_INSTANCES(8);
}  // namespace models::e29a::kernels::persistent
