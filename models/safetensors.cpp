#include "models/safetensors.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/half.h"

namespace models {

namespace {

constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;

std::uint64_t read_le64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

std::size_t safetensors_dtype_size(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  std::ifstream in(path_, std::ios::binary);
  if (!in) throw core::InputError(path_ + ": cannot open safetensors file");
  const std::uint64_t file_size = std::filesystem::file_size(path_);
  unsigned char length_bytes[8];
  if (!in.read(reinterpret_cast<char*>(length_bytes), 8)) {
    throw core::InputError(path_ + ": truncated safetensors file (no header length)");
  }
  const std::uint64_t header_size = read_le64(length_bytes);
  if (header_size > kMaxHeaderBytes || header_size + 8 > file_size) {
    throw core::InputError(path_ + ": invalid safetensors header length " + std::to_string(header_size) +
                           " for a file of " + std::to_string(file_size) + " bytes");
  }
  std::string header(header_size, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(header_size))) {
    throw core::InputError(path_ + ": truncated safetensors header");
  }
  data_start_ = 8 + header_size;
  const std::uint64_t data_size = file_size - data_start_;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    throw core::InputError(path_ + ": safetensors header is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw core::InputError(path_ + ": safetensors header is not a JSON object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const auto& v = it.value();
    SafetensorsEntry e;
    e.name = it.key();
    try {
      e.dtype = v.at("dtype").get<std::string>();
      for (const char* key : {"shape", "data_offsets"}) {  // integers, not floats converted out of range
        const nlohmann::json& list = v.at(key);
        if (!list.is_array()) throw core::InputError(std::string(key) + " must be a list");
        for (const nlohmann::json& x : list) {
          if (!x.is_number_integer()) throw core::InputError(std::string(key) + " must hold integers");
        }
      }
      e.shape = v.at("shape").get<core::Shape>();
      const auto offsets = v.at("data_offsets").get<std::vector<std::uint64_t>>();
      if (offsets.size() != 2) throw core::InputError("data_offsets must have two entries");
      e.begin = offsets[0];
      e.end = offsets[1];
    } catch (const std::exception& ex) {
      throw core::InputError(path_ + ": tensor '" + e.name + "': malformed entry (" + ex.what() + ")");
    }
    const std::size_t element = safetensors_dtype_size(e.dtype);
    if (element == 0) throw core::InputError(path_ + ": tensor '" + e.name + "': unknown dtype " + e.dtype);
    // Every partial product of the shape (in bytes) fits the data section, so no product of it
    // overflows, here or where the shape is used.
    std::uint64_t expected = element;
    for (std::int64_t d : e.shape) {
      if (d < 0) throw core::InputError(path_ + ": tensor '" + e.name + "': negative dimension");
      if (d != 0 && expected > data_size / static_cast<std::uint64_t>(d)) {
        throw core::InputError(path_ + ": tensor '" + e.name + "': shape " + core::shape_str(e.shape) +
                               " holds more than the file's " + std::to_string(data_size) + " bytes of data");
      }
      expected *= static_cast<std::uint64_t>(d);
    }
    if (e.end < e.begin || e.end - e.begin != expected || e.end > data_size) {
      throw core::InputError(path_ + ": tensor '" + e.name + "': data_offsets [" + std::to_string(e.begin) + ", " +
                             std::to_string(e.end) + ") do not hold " + std::to_string(expected) + " bytes within " +
                             std::to_string(data_size) + " bytes of data");
    }
    entries_.push_back(std::move(e));
  }
}

bool SafetensorsFile::contains(const std::string& name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return true;
  }
  return false;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return e;
  }
  throw core::InputError(path_ + ": no tensor named '" + name + "'");
}

std::vector<char> SafetensorsFile::read_bytes(const SafetensorsEntry& e) const {
  std::ifstream in(path_, std::ios::binary);
  std::vector<char> bytes(e.end - e.begin);
  in.seekg(static_cast<std::streamoff>(data_start_ + e.begin));
  if (!in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()))) {
    throw core::InputError(path_ + ": tensor '" + e.name + "': could not read its data");
  }
  return bytes;
}

std::vector<float> SafetensorsFile::read_f32(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const std::vector<char> bytes = read_bytes(e);
  const auto n = static_cast<std::size_t>(core::shape_numel(e.shape));
  std::vector<float> out(n);
  if (e.dtype == "F32") {
    std::memcpy(out.data(), bytes.data(), n * 4);
  } else if (e.dtype == "F64") {
    for (std::size_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, bytes.data() + 8 * i, 8);
      out[i] = static_cast<float>(d);
    }
  } else if (e.dtype == "BF16" || e.dtype == "F16") {
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = e.dtype == "BF16" ? core::bf16_to_float(h) : core::fp16_to_float(h);
    }
  } else {
    throw core::InputError(path_ + ": tensor '" + name + "' has dtype " + e.dtype + ", expected a float type");
  }
  return out;
}

std::vector<std::int64_t> SafetensorsFile::read_i64(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  const std::vector<char> bytes = read_bytes(e);
  const auto n = static_cast<std::size_t>(core::shape_numel(e.shape));
  std::vector<std::int64_t> out(n);
  if (e.dtype == "I64") {
    std::memcpy(out.data(), bytes.data(), n * 8);
  } else if (e.dtype == "I32") {
    for (std::size_t i = 0; i < n; ++i) {
      std::int32_t v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      out[i] = v;
    }
  } else {
    throw core::InputError(path_ + ": tensor '" + name + "' has dtype " + e.dtype + ", expected I64 or I32");
  }
  return out;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors) {
  nlohmann::json header = nlohmann::json::object();
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    const std::size_t element = safetensors_dtype_size(t.dtype);
    if (element == 0) throw core::Error("write_safetensors: tensor '" + t.name + "' has unknown dtype " + t.dtype);
    const auto bytes = static_cast<std::uint64_t>(core::shape_numel(t.shape)) * element;
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw core::Error("write_safetensors: cannot create " + tmp);
    unsigned char length[8];
    std::uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(n >> (8 * i));
    out.write(reinterpret_cast<const char*>(length), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const auto& t : tensors) {
      const auto bytes = static_cast<std::streamsize>(core::shape_numel(t.shape) *
                                                      static_cast<std::int64_t>(safetensors_dtype_size(t.dtype)));
      out.write(static_cast<const char*>(t.data), bytes);
    }
    out.flush();
    if (!out) throw core::Error("write_safetensors: writing " + tmp + " failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw core::Error("write_safetensors: renaming " + tmp + " to " + path + " failed: " + ec.message());
}

}  // namespace models
