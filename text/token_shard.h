// Token shards: a fixed 24-byte header then little-endian token ids (format in docs/formats.md).
//   magic "LLMTOKS1" (8 bytes) | version u32 (= 1) | token dtype u32 (2 = u16, 4 = u32) | count u64 | tokens
// TokenShard maps a shard read-only and checks the header and the size against the count;
// write_token_shard writes one atomically (a temporary file in the same folder, fsync, rename).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

namespace text {

inline constexpr char kTokenShardMagic[8] = {'L', 'L', 'M', 'T', 'O', 'K', 'S', '1'};
inline constexpr std::uint32_t kTokenShardVersion = 1;
inline constexpr std::size_t kTokenShardHeaderBytes = 24;

// Bytes per token id in the file.
enum class TokenDtype : std::uint32_t { u16 = 2, u32 = 4 };

// u16 when every id of a vocabulary of `vocab_size` fits in 16 bits, else u32.
TokenDtype smallest_token_dtype(std::uint64_t vocab_size);

// Writes `tokens` to `path` (parent folders created) as dtype `dtype`; throws core::InputError when
// an id does not fit the dtype, core::Error when the file cannot be written. An existing file at
// `path` is replaced only once the new one is complete.
void write_token_shard(const std::filesystem::path& path, std::span<const std::uint32_t> tokens, TokenDtype dtype);

// A read-only memory map of a shard. Throws core::InputError naming the file for a missing or
// unreadable file, a wrong magic, an unknown version or dtype, and a size that does not match the count.
class TokenShard {
 public:
  explicit TokenShard(const std::filesystem::path& path);
  ~TokenShard();
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::filesystem::path& path() const { return path_; }
  TokenDtype dtype() const { return dtype_; }
  std::uint64_t size() const { return count_; }

  // Token `index` (< size()).
  std::uint32_t operator[](std::uint64_t index) const;
  // Copies tokens [start, start + out.size()) into `out`; throws core::Error past the end.
  void read(std::uint64_t start, std::span<std::uint32_t> out) const;
  // The window of seq_len + 1 tokens at `start`: inputs = tokens [start, start + seq_len),
  // targets = tokens [start + 1, start + seq_len + 1) (the next token of each input).
  void read_window(std::uint64_t start, std::span<std::int32_t> inputs, std::span<std::int32_t> targets) const;

 private:
  void release() noexcept;

  std::filesystem::path path_;
  void* mapping_ = nullptr;
  std::size_t mapping_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;
  TokenDtype dtype_ = TokenDtype::u32;
  std::uint64_t count_ = 0;
};

}  // namespace text
