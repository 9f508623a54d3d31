// Errors as exceptions that name the failing call, where it was made and what it was doing.
// Every CUDA, cuBLASLt, NCCL and MPI return code goes through one of the checks below.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

namespace core {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// Invalid user input (config value, file contents): reported without a source location.
class InputError : public Error {
 public:
  explicit InputError(const std::string& message) : Error(message) {}
};

[[noreturn]] void throw_call_error(std::string_view library, std::string_view call, std::string_view detail,
                                   const char* file, int line);

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) {
    throw_call_error("CUDA", call, std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status), file,
                     line);
  }
}

void check_cublas(cublasStatus_t status, const char* call, const char* file, int line);

// Throws `Error` with `message` (and the location) when `condition` is false.
void require(bool condition, std::string_view message, const char* file, int line);

}  // namespace core

#define CUDA_CHECK(call) ::core::check_cuda((call), #call, __FILE__, __LINE__)
#define CUBLAS_CHECK(call) ::core::check_cublas((call), #call, __FILE__, __LINE__)
// After a kernel launch: reports launch-configuration errors at the launch site.
#define CUDA_CHECK_LAUNCH(what) ::core::check_cuda(cudaGetLastError(), what, __FILE__, __LINE__)
#define REQUIRE(condition, message) ::core::require((condition), (message), __FILE__, __LINE__)
