// Seeded initialisation of the master weights a rank owns, on the slab's device.
#pragma once

#include <cstdint>

#include "core/device.h"
#include "optim/slab.h"

namespace optim {

// Writes the owned master weights from each parameter's init, then the owned mirror.
void initialize_owned(Slab& slab, const core::DeviceContext& context, std::uint64_t seed);

}  // namespace optim
