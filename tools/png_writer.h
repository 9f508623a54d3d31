// A minimal PNG encoder for RGB images (8-bit, no filtering, zlib's deflate): enough for plots
// without an image library. zlib also gives the chunks' CRC-32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tools {

struct RgbImage {
  int width = 0, height = 0;
  std::vector<std::uint8_t> pixels;  // row-major RGB

  RgbImage(int w, int h, std::uint8_t gray = 255)
      : width(w), height(h), pixels(static_cast<std::size_t>(w) * h * 3, gray) {}
  void set(int x, int y, std::uint8_t r, std::uint8_t g, std::uint8_t b) {
    if (x < 0 || y < 0 || x >= width || y >= height) return;
    std::uint8_t* p = &pixels[(static_cast<std::size_t>(y) * width + x) * 3];
    p[0] = r;
    p[1] = g;
    p[2] = b;
  }
};

// Writes `image` to `path`; throws std::runtime_error on I/O failure.
void write_png(const std::string& path, const RgbImage& image);

}  // namespace tools
