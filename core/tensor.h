// Typed, non-owning views of memory: a pointer with dtype, shape and device. Models read and
// write parameters through views into the slab; nothing here allocates device memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"

namespace core {

using Shape = std::vector<std::int64_t>;

std::int64_t shape_numel(const Shape& shape);
std::string shape_str(const Shape& shape);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  Device device;

  std::int64_t numel() const { return shape_numel(shape); }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  int rank() const { return static_cast<int>(shape.size()); }

  // The data as T*, after checking that T matches the view's dtype (16-bit floats: std::uint16_t).
  template <typename T>
  T* as() const {
    check_element_size(sizeof(T));
    return static_cast<T*>(data);
  }

 private:
  void check_element_size(std::size_t size) const {
    if (size != dtype_size(dtype)) {
      throw Error("tensor view of dtype " + std::string(dtype_name(dtype)) + " accessed with a " +
                  std::to_string(size) + "-byte element type");
    }
  }
};

}  // namespace core
