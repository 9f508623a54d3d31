#include "core/buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "core/error.h"

namespace core {

namespace {
constexpr std::size_t kHostAlignment = 64;
}

Buffer::Buffer(Device device, std::size_t bytes, bool pinned) : bytes_(bytes), device_(device) {
  if (device.is_cuda()) {
    kind_ = MemoryKind::device;
    if (bytes == 0) return;
    CUDA_CHECK(cudaSetDevice(device.index));
    CUDA_CHECK(cudaMalloc(&data_, bytes));
  } else if (pinned) {
    kind_ = MemoryKind::pinned;
    if (bytes == 0) return;
    CUDA_CHECK(cudaHostAlloc(&data_, bytes, cudaHostAllocDefault));
  } else {
    kind_ = MemoryKind::host;
    if (bytes == 0) return;
    const std::size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
    data_ = std::aligned_alloc(kHostAlignment, rounded);
    if (!data_) throw Error("host allocation of " + std::to_string(bytes) + " bytes failed");
  }
}

Buffer::~Buffer() { release(); }

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      device_(other.device_),
      kind_(other.kind_) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
    kind_ = other.kind_;
  }
  return *this;
}

void Buffer::fill_bytes(int value, cudaStream_t stream) {
  if (bytes_ == 0) return;
  if (kind_ == MemoryKind::device) {
    CUDA_CHECK(cudaMemsetAsync(data_, value, bytes_, stream));
  } else {
    std::memset(data_, value, bytes_);
  }
}

void Buffer::release() noexcept {
  if (!data_) return;
  // Frees must not throw from a destructor; a failure means the context is already lost.
  switch (kind_) {
    case MemoryKind::device: (void)cudaFree(data_); break;
    case MemoryKind::pinned: (void)cudaFreeHost(data_); break;
    case MemoryKind::host: std::free(data_); break;
  }
  data_ = nullptr;
}

void copy_bytes(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  if (stream == nullptr) {
    std::memcpy(dst, src, bytes);
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
}

}  // namespace core
