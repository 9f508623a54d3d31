// Where work runs: the cpu backend (plain C++ references, OpenMP) or one CUDA device with its
// stream and cuBLASLt handle. The cpu backend creates no CUDA handles at all, so it works on
// machines without a driver.
#pragma once

#include <cstddef>
#include <string>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

namespace core {

enum class DeviceKind { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;  // CUDA ordinal; 0 for cpu

  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceKind::cuda, index}; }
  bool is_cuda() const { return kind == DeviceKind::cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

// Number of usable CUDA devices; 0 when there is no driver or no GPU (never throws).
int cuda_device_count();

// Owns the per-device execution resources. Move-only.
class DeviceContext {
 public:
  explicit DeviceContext(Device device);
  ~DeviceContext();
  DeviceContext(DeviceContext&& other) noexcept;
  DeviceContext& operator=(DeviceContext&& other) noexcept;
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  const Device& device() const { return device_; }
  bool is_cuda() const { return device_.is_cuda(); }
  cudaStream_t stream() const { return stream_; }          // nullptr on cpu
  cublasLtHandle_t cublaslt() const { return cublaslt_; }  // nullptr on cpu
  int multiprocessor_count() const { return multiprocessors_; }
  std::string device_name() const { return name_; }

  // Blocks until all work queued on the stream is done (no-op on cpu).
  void synchronize() const;

 private:
  void release() noexcept;

  Device device_;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t cublaslt_ = nullptr;
  int multiprocessors_ = 0;
  std::string name_ = "cpu";
};

}  // namespace core
