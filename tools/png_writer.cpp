#include "tools/png_writer.h"

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include <unistd.h>
#include <zlib.h>

namespace tools {

namespace {

void put32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(v >> s));
}

void chunk(std::vector<std::uint8_t>& out, const char* type, const std::vector<std::uint8_t>& data) {
  put32(out, static_cast<std::uint32_t>(data.size()));
  std::vector<std::uint8_t> body(type, type + 4);
  body.insert(body.end(), data.begin(), data.end());
  out.insert(out.end(), body.begin(), body.end());
  put32(out, static_cast<std::uint32_t>(::crc32(0, body.data(), static_cast<uInt>(body.size()))));
}

}  // namespace

void write_png(const std::string& path, const RgbImage& image) {
  // Raw scanlines: a filter byte (0) then the row.
  std::vector<std::uint8_t> raw;
  const std::size_t row = static_cast<std::size_t>(image.width) * 3;
  for (int y = 0; y < image.height; ++y) {
    raw.push_back(0);
    raw.insert(raw.end(), image.pixels.begin() + static_cast<std::ptrdiff_t>(y * row),
               image.pixels.begin() + static_cast<std::ptrdiff_t>((y + 1) * row));
  }
  // Plots are mostly flat colour: deflate shrinks them about a hundredfold.
  uLongf z_size = compressBound(static_cast<uLong>(raw.size()));
  std::vector<std::uint8_t> z(z_size);
  if (compress2(z.data(), &z_size, raw.data(), static_cast<uLong>(raw.size()), Z_BEST_COMPRESSION) != Z_OK) {
    throw std::runtime_error("deflate failed for " + path);
  }
  z.resize(z_size);

  std::vector<std::uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<std::uint8_t> header;
  put32(header, static_cast<std::uint32_t>(image.width));
  put32(header, static_cast<std::uint32_t>(image.height));
  header.insert(header.end(), {8, 2, 0, 0, 0});  // 8-bit RGB, deflate, no filter, no interlace
  chunk(png, "IHDR", header);
  chunk(png, "IDAT", z);
  chunk(png, "IEND", {});
  // Written beside the target and renamed when complete: a failed write leaves no half a PNG.
  const std::string temporary = path + ".tmp." + std::to_string(::getpid());
  std::FILE* out = std::fopen(temporary.c_str(), "wb");
  if (out == nullptr) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
  const bool written = std::fwrite(png.data(), 1, png.size(), out) == png.size();
  const int write_error = errno;
  if (std::fclose(out) != 0 || !written) {
    const int error = written ? errno : write_error;
    std::remove(temporary.c_str());
    throw std::runtime_error("cannot write " + path + ": " + std::strerror(error));
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    std::remove(temporary.c_str());
    throw std::runtime_error("cannot write " + path + ": " + std::strerror(error));
  }
}

}  // namespace tools
