#include "core/error.h"

#include <filesystem>

namespace core {

[[noreturn]] void throw_call_error(std::string_view library, std::string_view call, std::string_view detail,
                                   const char* file, int line) {
  std::string message;
  message.append(library).append(" call `").append(call).append("` failed: ").append(detail);
  message.append(" (at ").append(std::filesystem::path(file).filename().string()).append(":");
  message.append(std::to_string(line)).append(")");
  throw Error(message);
}

void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw_call_error("cuBLASLt", call, "status " + std::to_string(static_cast<int>(status)), file, line);
  }
}

void require(bool condition, std::string_view message, const char* file, int line) {
  if (!condition) {
    throw Error(std::string(message) + " (at " + std::filesystem::path(file).filename().string() + ":" +
                std::to_string(line) + ")");
  }
}

}  // namespace core
