#include "core/device.h"

#include <utility>

#include "core/error.h"

namespace core {

std::string Device::str() const { return is_cuda() ? "cuda:" + std::to_string(index) : "cpu"; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

DeviceContext::DeviceContext(Device device) : device_(device) {
  if (!device_.is_cuda()) return;
  const int count = cuda_device_count();
  if (device_.index < 0 || device_.index >= count) {
    throw Error("device " + device_.str() + " requested but " + std::to_string(count) +
                " CUDA device(s) are available");
  }
  try {
    CUDA_CHECK(cudaSetDevice(device_.index));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasLtCreate(&cublaslt_));
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device_.index));
    multiprocessors_ = prop.multiProcessorCount;
    name_ = prop.name;
  } catch (...) {
    release();
    throw;
  }
}

DeviceContext::~DeviceContext() { release(); }

DeviceContext::DeviceContext(DeviceContext&& other) noexcept
    : device_(other.device_),
      stream_(std::exchange(other.stream_, nullptr)),
      cublaslt_(std::exchange(other.cublaslt_, nullptr)),
      multiprocessors_(other.multiprocessors_),
      name_(std::move(other.name_)) {}

DeviceContext& DeviceContext::operator=(DeviceContext&& other) noexcept {
  if (this != &other) {
    release();
    device_ = other.device_;
    stream_ = std::exchange(other.stream_, nullptr);
    cublaslt_ = std::exchange(other.cublaslt_, nullptr);
    multiprocessors_ = other.multiprocessors_;
    name_ = std::move(other.name_);
  }
  return *this;
}

void DeviceContext::synchronize() const {
  if (stream_) CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void DeviceContext::release() noexcept {
  // Destruction must not throw; failures here mean the context is already unusable.
  if (cublaslt_) (void)cublasLtDestroy(std::exchange(cublaslt_, nullptr));
  if (stream_) (void)cudaStreamDestroy(std::exchange(stream_, nullptr));
}

}  // namespace core
