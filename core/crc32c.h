// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of checkpoint files and of
// TensorBoard's record framing. SSE4.2 instructions where the CPU has them, else a byte table.
#pragma once

#include <cstddef>
#include <cstdint>

namespace core {

// CRC32C of `bytes` at `data`, continuing from `crc` (0 to start): crc32c(crc32c(0, a), b) is the
// CRC32C of a followed by b.
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t bytes);

}  // namespace core
