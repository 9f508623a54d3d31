// Token shard reader (read-only mmap with header and size checks) and atomic writer.
#include "text/token_shard.h"

#include <bit>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"

static_assert(std::endian::native == std::endian::little,
              "token shards are read and written in place as little-endian");

namespace text {
namespace {

std::string quoted(const std::filesystem::path& path) { return "token shard '" + path.string() + "'"; }

std::string errno_text() { return std::strerror(errno); }

// Closes a descriptor on every exit path.
struct FileDescriptor {
  int fd = -1;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(int fd, const void* data, std::size_t bytes, const std::filesystem::path& path) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw core::Error("writing " + path.string() + ": " + errno_text());
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

}  // namespace

TokenDtype smallest_token_dtype(std::uint64_t vocab_size) {
  return vocab_size <= 65536 ? TokenDtype::u16 : TokenDtype::u32;
}

void write_token_shard(const std::filesystem::path& path, std::span<const std::uint32_t> tokens, TokenDtype dtype) {
  if (dtype == TokenDtype::u16) {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] > 0xFFFF) {
        throw core::InputError(quoted(path) + ": token " + std::to_string(tokens[i]) + " at index " +
                               std::to_string(i) + " does not fit the u16 dtype; write it as u32");
      }
    }
  }
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::filesystem::path temporary = path;
  temporary += ".tmp." + std::to_string(::getpid());

  unsigned char header[kTokenShardHeaderBytes];
  const std::uint32_t version = kTokenShardVersion;
  const auto dtype_code = static_cast<std::uint32_t>(dtype);
  const std::uint64_t count = tokens.size();
  std::memcpy(header, kTokenShardMagic, 8);
  std::memcpy(header + 8, &version, 4);
  std::memcpy(header + 12, &dtype_code, 4);
  std::memcpy(header + 16, &count, 8);
  try {
    FileDescriptor file{::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
    if (file.fd < 0) throw core::Error("creating " + temporary.string() + ": " + errno_text());
    write_all(file.fd, header, sizeof header, temporary);
    if (dtype == TokenDtype::u32) {
      write_all(file.fd, tokens.data(), tokens.size_bytes(), temporary);
    } else {
      std::vector<std::uint16_t> chunk;
      constexpr std::size_t kChunk = 1 << 20;
      for (std::size_t begin = 0; begin < tokens.size(); begin += kChunk) {
        const std::size_t end = std::min(tokens.size(), begin + kChunk);
        chunk.assign(tokens.begin() + static_cast<std::ptrdiff_t>(begin),
                     tokens.begin() + static_cast<std::ptrdiff_t>(end));
        write_all(file.fd, chunk.data(), chunk.size() * sizeof(std::uint16_t), temporary);
      }
    }
    if (::fsync(file.fd) != 0) throw core::Error("fsync " + temporary.string() + ": " + errno_text());
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw;
  }
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  if (ec) {
    std::filesystem::remove(temporary, ec);
    throw core::Error("renaming " + temporary.string() + " to " + path.string() + ": " + ec.message());
  }
}

TokenShard::TokenShard(const std::filesystem::path& path) : path_(path) {
  FileDescriptor file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (file.fd < 0) throw core::InputError("cannot open " + quoted(path) + ": " + errno_text());
  struct stat info {};
  if (::fstat(file.fd, &info) != 0) throw core::InputError("cannot stat " + quoted(path) + ": " + errno_text());
  const auto file_bytes = static_cast<std::uint64_t>(info.st_size);
  if (file_bytes < kTokenShardHeaderBytes) {
    throw core::InputError(quoted(path) + " is truncated: " + std::to_string(file_bytes) + " bytes, shorter than the " +
                           std::to_string(kTokenShardHeaderBytes) + "-byte header");
  }
  mapping_ = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, file.fd, 0);
  if (mapping_ == MAP_FAILED) {
    mapping_ = nullptr;
    throw core::InputError("cannot map " + quoted(path) + ": " + errno_text());
  }
  mapping_bytes_ = file_bytes;
  try {
    const auto* bytes = static_cast<const unsigned char*>(mapping_);
    if (std::memcmp(bytes, kTokenShardMagic, 8) != 0) {
      throw core::InputError(quoted(path) + " has a wrong magic (expected \"LLMTOKS1\"): not a token shard");
    }
    std::uint32_t version = 0, dtype_code = 0;
    std::memcpy(&version, bytes + 8, 4);
    std::memcpy(&dtype_code, bytes + 12, 4);
    std::memcpy(&count_, bytes + 16, 8);
    if (version != kTokenShardVersion) {
      throw core::InputError(quoted(path) + " has unknown version " + std::to_string(version) +
                             " (this build reads version " + std::to_string(kTokenShardVersion) + ")");
    }
    if (dtype_code != 2 && dtype_code != 4) {
      throw core::InputError(quoted(path) + " has unknown token dtype " + std::to_string(dtype_code) +
                             " (expected 2 for u16 or 4 for u32)");
    }
    dtype_ = static_cast<TokenDtype>(dtype_code);
    const std::uint64_t payload = file_bytes - kTokenShardHeaderBytes;
    if (count_ > payload / dtype_code || payload != count_ * dtype_code) {
      const bool short_file = count_ > payload / dtype_code;
      throw core::InputError(quoted(path) + (short_file ? " is truncated" : " has trailing bytes") + ": header says " +
                             std::to_string(count_) + " tokens of " + std::to_string(dtype_code) +
                             " bytes, file holds " + std::to_string(payload) + " bytes of tokens");
    }
    tokens_ = bytes + kTokenShardHeaderBytes;
  } catch (...) {
    release();
    throw;
  }
}

TokenShard::~TokenShard() { release(); }

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      mapping_bytes_(std::exchange(other.mapping_bytes_, 0)),
      tokens_(std::exchange(other.tokens_, nullptr)),
      dtype_(other.dtype_),
      count_(std::exchange(other.count_, 0)) {}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapping_bytes_ = std::exchange(other.mapping_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
    dtype_ = other.dtype_;
    count_ = std::exchange(other.count_, 0);
  }
  return *this;
}

void TokenShard::release() noexcept {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
  mapping_ = nullptr;
  mapping_bytes_ = 0;
  tokens_ = nullptr;
}

std::uint32_t TokenShard::operator[](std::uint64_t index) const {
  if (dtype_ == TokenDtype::u16) {
    std::uint16_t value;
    std::memcpy(&value, tokens_ + index * 2, 2);
    return value;
  }
  std::uint32_t value;
  std::memcpy(&value, tokens_ + index * 4, 4);
  return value;
}

void TokenShard::read(std::uint64_t start, std::span<std::uint32_t> out) const {
  if (start > count_ || out.size() > count_ - start) {
    throw core::Error(quoted(path_) + ": reading tokens [" + std::to_string(start) + ", " +
                      std::to_string(start + out.size()) + ") past its " + std::to_string(count_) + " tokens");
  }
  if (dtype_ == TokenDtype::u32) {
    if (!out.empty()) std::memcpy(out.data(), tokens_ + start * 4, out.size_bytes());
    return;
  }
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = (*this)[start + i];
}

void TokenShard::read_window(std::uint64_t start, std::span<std::int32_t> inputs,
                             std::span<std::int32_t> targets) const {
  if (inputs.size() != targets.size()) throw core::Error("read_window: inputs and targets differ in length");
  const std::uint64_t n = inputs.size();
  if (start > count_ || n + 1 > count_ - start) {
    throw core::Error(quoted(path_) + ": window of " + std::to_string(n + 1) + " tokens at " + std::to_string(start) +
                      " runs past its " + std::to_string(count_) + " tokens");
  }
  for (std::uint64_t i = 0; i < n; ++i) {
    inputs[i] = static_cast<std::int32_t>((*this)[start + i]);
    targets[i] = static_cast<std::int32_t>((*this)[start + i + 1]);
  }
}

}  // namespace text
