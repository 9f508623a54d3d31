// RAII owners of raw memory: host (64-byte aligned), pinned host (for fast, asynchronous
// device transfers) or device. Move-only; zero-sized buffers are valid and hold no memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "core/device.h"

namespace core {

enum class MemoryKind { host, pinned, device };

class Buffer {
 public:
  Buffer() = default;
  // Allocates `bytes` on `device` (host memory for the cpu device). `pinned` asks for
  // page-locked host memory (cpu device only). Contents are uninitialised.
  Buffer(Device device, std::size_t bytes, bool pinned = false);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  template <typename T>
  T* as() {
    return static_cast<T*>(data_);
  }
  template <typename T>
  const T* as() const {
    return static_cast<const T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }
  const Device& device() const { return device_; }
  MemoryKind kind() const { return kind_; }

  // Sets every byte to `value` (on `stream` for device memory; synchronous on the host).
  void fill_bytes(int value, cudaStream_t stream = nullptr);

 private:
  void release() noexcept;

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Device device_{};
  MemoryKind kind_ = MemoryKind::host;
};

// Copies `bytes` between any two memories; asynchronous on `stream` when a device is involved.
void copy_bytes(void* dst, const void* src, std::size_t bytes, cudaStream_t stream);

}  // namespace core
