// CRC32C: 8 bytes per SSE4.2 crc32 instruction when the CPU has it, else one table lookup per byte.
#include "core/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace core {
namespace {

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(std::uint32_t state, const unsigned char* p,
                                                             std::size_t n) {
  std::uint64_t c = state;
  for (; n >= 8; p += 8, n -= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (; n > 0; ++p, --n) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}
#endif

std::uint32_t crc32c_table(std::uint32_t state, const unsigned char* p, std::size_t n) {
  static const std::array<std::uint32_t, 256> table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  for (; n > 0; ++p, --n) state = table[(state ^ *p) & 0xFF] ^ (state >> 8);
  return state;
}

}  // namespace

std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  if (hardware) return ~crc32c_sse42(~crc, p, bytes);
#endif
  return ~crc32c_table(~crc, p, bytes);
}

}  // namespace core
