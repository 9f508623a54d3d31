// A kernel's table (work items, segment records) copied to the context's device once, when an
// optimizer is built.
#pragma once

#include <vector>

#include "core/buffer.h"
#include "core/device.h"

namespace optim {

// A buffer on `context`'s device holding the elements of `host`, copied on its stream: `host` must
// outlive the copy (synchronise the context before it goes).
template <typename T>
core::Buffer table_on_device(const core::DeviceContext& context, const std::vector<T>& host) {
  core::Buffer b(context.device(), host.size() * sizeof(T));
  core::copy_bytes(b.data(), host.data(), b.bytes(), context.stream());
  return b;
}

}  // namespace optim
