// The safetensors file format (Hugging Face): an 8-byte little-endian header length, a JSON
// header mapping each tensor name to {dtype, shape, data_offsets [begin, end)} relative to the
// data that follows, and the raw little-endian data. Reading checks every offset and size and
// names the file in each error; writing goes through a temporary file renamed into place.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace models {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // F64, F32, BF16, F16, I64, I32, ...
  core::Shape shape;
  std::uint64_t begin = 0;  // byte offsets into the data section
  std::uint64_t end = 0;
};

class SafetensorsFile {
 public:
  // Reads and validates the header; throws core::InputError naming `path` on any problem.
  explicit SafetensorsFile(std::string path);

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  bool contains(const std::string& name) const;
  const SafetensorsEntry& entry(const std::string& name) const;

  // The tensor as fp32 (from F32, F64, BF16 or F16) or as int64 (from I64 or I32).
  std::vector<float> read_f32(const std::string& name) const;
  std::vector<std::int64_t> read_i64(const std::string& name) const;

 private:
  std::vector<char> read_bytes(const SafetensorsEntry& e) const;

  std::string path_;
  std::uint64_t data_start_ = 0;
  std::vector<SafetensorsEntry> entries_;
};

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // F32, BF16, F16, I64, I32
  core::Shape shape;
  const void* data = nullptr;  // shape's element count * dtype size bytes
};

// Writes `tensors` to `path` (via `path`.tmp and a rename). Throws core::Error on I/O failure.
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors);

// Bytes per element of a safetensors dtype; 0 for an unknown one.
std::size_t safetensors_dtype_size(const std::string& dtype);

}  // namespace models
