// plot_metrics: turns a run's metrics.jsonl into a PNG loss curve (training loss per logged step
// and validation loss), with axes, tick labels and a legend drawn by a tiny built-in font.
//   plot_metrics RUN_DIR/metrics.jsonl [-o loss.png]
// Exit status: 0, 2 for bad input (named), 1 when the PNG cannot be written.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <sys/stat.h>
#include <nlohmann/json.hpp>

#include "core/standard_streams.h"
#include "tools/png_writer.h"

namespace {

// 3x5 glyphs, one row per 3-bit number (bit 2 = left column).
const std::map<char, std::array<int, 5>>& font() {
  static const std::map<char, std::array<int, 5>> glyphs = {
      {'0', {7, 5, 5, 5, 7}}, {'1', {2, 6, 2, 2, 7}}, {'2', {7, 1, 7, 4, 7}}, {'3', {7, 1, 7, 1, 7}},
      {'4', {5, 5, 7, 1, 1}}, {'5', {7, 4, 7, 1, 7}}, {'6', {7, 4, 7, 5, 7}}, {'7', {7, 1, 1, 1, 1}},
      {'8', {7, 5, 7, 5, 7}}, {'9', {7, 5, 7, 1, 7}}, {'.', {0, 0, 0, 0, 2}}, {'-', {0, 0, 7, 0, 0}},
      {'k', {4, 5, 6, 5, 5}}, {'t', {2, 7, 2, 2, 3}}, {'r', {0, 6, 5, 4, 4}}, {'a', {0, 3, 5, 5, 3}},
      {'i', {2, 0, 2, 2, 2}}, {'n', {0, 6, 5, 5, 5}}, {'v', {0, 5, 5, 5, 2}}, {'l', {6, 2, 2, 2, 7}},
      {'s', {0, 3, 6, 1, 6}}, {'o', {0, 2, 5, 5, 2}}, {'e', {0, 7, 7, 4, 7}}, {'p', {0, 6, 5, 6, 4}},
      {' ', {0, 0, 0, 0, 0}}, {'_', {0, 0, 0, 0, 7}},
  };
  return glyphs;
}

void text(tools::RgbImage& img, int x, int y, const std::string& s, int scale = 2) {
  for (char ch : s) {
    const auto it = font().find(ch);
    if (it != font().end()) {
      for (int r = 0; r < 5; ++r) {
        for (int c = 0; c < 3; ++c) {
          if (!((it->second[static_cast<std::size_t>(r)] >> (2 - c)) & 1)) continue;
          for (int dy = 0; dy < scale; ++dy) {
            for (int dx = 0; dx < scale; ++dx) img.set(x + c * scale + dx, y + r * scale + dy, 30, 30, 30);
          }
        }
      }
    }
    x += 4 * scale;
  }
}

void line(tools::RgbImage& img, int x0, int y0, int x1, int y1, std::array<std::uint8_t, 3> rgb, int width = 1) {
  const int steps = std::max({std::abs(x1 - x0), std::abs(y1 - y0), 1});
  for (int i = 0; i <= steps; ++i) {
    const int x = x0 + (x1 - x0) * i / steps, y = y0 + (y1 - y0) * i / steps;
    for (int d = -(width / 2); d <= width / 2; ++d) {
      img.set(x, y + d, rgb[0], rgb[1], rgb[2]);
      img.set(x + d, y, rgb[0], rgb[1], rgb[2]);
    }
  }
}

std::string label(double v) {
  char buf[32];
  if (std::fabs(v) >= 10000) {
    std::snprintf(buf, sizeof buf, "%.0fk", v / 1000);
  } else if (std::fabs(v - std::round(v)) < 1e-9) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f", v);
  }
  return buf;
}

// Whether two paths name one existing file (device and inode).
bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {
  }, sb{};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// A record's number: null (how a non-finite loss is written) reads as NaN, which is not drawn.
double number(const nlohmann::json& record, const char* key) {
  const nlohmann::json& value = record.at(key);
  if (value.is_null()) return std::nan("");
  if (!value.is_number())
    throw std::runtime_error(std::string("'") + key + "' is " + value.type_name() + ", not a number");
  return value.get<double>();
}

}  // namespace

int main(int argc, char** argv) {
  core::guard_standard_streams();
  CLI::App app{"metrics.jsonl -> PNG loss curve"};
  std::string input, output = "loss.png";
  app.add_option("metrics", input, "metrics.jsonl of a run")->required();
  app.add_option("-o,--output", output, "PNG to write");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  struct stat info {};
  if (::stat(input.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
    std::fprintf(stderr, "plot_metrics: %s is a folder; give its metrics.jsonl\n", input.c_str());
    return 2;
  }
  std::ifstream in(input);
  if (!in) {
    std::fprintf(stderr, "plot_metrics: cannot open %s\n", input.c_str());
    return 2;
  }
  if (same_file(input, output)) {
    std::fprintf(stderr, "plot_metrics: -o %s is the input itself\n", output.c_str());
    return 2;
  }
  std::vector<std::pair<double, double>> train, val;
  std::string row;
  int line_no = 0;
  while (std::getline(in, row)) {
    ++line_no;
    if (row.empty()) continue;
    try {
      const auto j = nlohmann::json::parse(row);
      if (!j.is_object()) throw std::runtime_error("not a JSON object");
      if (!j.contains("loss") && !j.contains("val_loss")) continue;
      if (!j.contains("step")) throw std::runtime_error("a loss without a 'step'");
      const double step = number(j, "step");
      // Steps place points on the x axis, which starts at 0.
      if (!(step >= 0 && step <= 1e15))
        throw std::runtime_error("'step' must be in [0, 1e15], got " + j["step"].dump());
      if (j.contains("loss")) train.emplace_back(step, number(j, "loss"));
      if (j.contains("val_loss")) val.emplace_back(step, number(j, "val_loss"));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "plot_metrics: %s:%d: %s\n", input.c_str(), line_no, e.what());
      return 2;
    }
  }
  if (train.empty() && val.empty()) {
    std::fprintf(stderr, "plot_metrics: %s has no loss records\n", input.c_str());
    return 2;
  }
  double x_max = 1, y_min = 1e30, y_max = -1e30;
  for (const auto* series : {&train, &val}) {
    for (const auto& [x, y] : *series) {
      if (!std::isfinite(y)) continue;
      x_max = std::max(x_max, x);
      y_min = std::min(y_min, y);
      y_max = std::max(y_max, y);
    }
  }
  if (y_max < y_min) y_min = 0, y_max = 1;  // no finite loss at all
  // Spans beyond a double's range would make NaN coordinates: losses that large plot clipped.
  y_min = std::max(y_min, -1e300);
  y_max = std::min(y_max, 1e300);
  if (y_max <= y_min) y_max = y_min + 1;
  const int width = 900, height = 560, left = 80, right = 30, top = 40, bottom = 60;
  tools::RgbImage img(width, height);
  // Coordinates clamped just outside the image: a converted out-of-range double is undefined.
  auto clamp = [](double v, int limit) {
    return static_cast<int>(std::clamp(std::isnan(v) ? -1.0 : v, -1.0, limit + 1.0));
  };
  auto px = [&](double x) { return clamp(left + (width - left - right) * x / x_max, width); };
  auto py = [&](double y) {
    return clamp(height - bottom - (height - top - bottom) * (y - y_min) / (y_max - y_min), height);
  };
  for (int t = 0; t <= 5; ++t) {  // grid and tick labels
    const double yv = y_min + (y_max - y_min) * t / 5, xv = x_max * t / 5;
    line(img, left, py(yv), width - right, py(yv), {225, 225, 225});
    line(img, px(xv), top, px(xv), height - bottom, {225, 225, 225});
    text(img, 8, py(yv) - 5, label(yv));
    text(img, px(xv) - 10, height - bottom + 12, label(std::round(xv)));
  }
  line(img, left, top, left, height - bottom, {60, 60, 60});
  line(img, left, height - bottom, width - right, height - bottom, {60, 60, 60});
  for (std::size_t i = 1; i < train.size(); ++i) {
    if (!std::isfinite(train[i - 1].second) || !std::isfinite(train[i].second)) continue;
    line(img, px(train[i - 1].first), py(train[i - 1].second), px(train[i].first), py(train[i].second), {31, 119, 180},
         2);
  }
  for (std::size_t i = 0; i < val.size(); ++i) {
    if (!std::isfinite(val[i].second)) continue;
    if (i > 0 && std::isfinite(val[i - 1].second))
      line(img, px(val[i - 1].first), py(val[i - 1].second), px(val[i].first), py(val[i].second), {214, 39, 40}, 2);
    for (int d = -3; d <= 3; ++d)
      line(img, px(val[i].first) - 3, py(val[i].second) + d, px(val[i].first) + 3, py(val[i].second) + d,
           {214, 39, 40});
  }
  line(img, width - 200, 20, width - 170, 20, {31, 119, 180}, 3);
  text(img, width - 160, 15, "train loss");
  line(img, width - 200, 40, width - 170, 40, {214, 39, 40}, 3);
  text(img, width - 160, 35, "val loss");
  text(img, width / 2 - 20, height - 25, "step");
  try {
    tools::write_png(output, img);
    std::printf("wrote %s (%zu training, %zu validation points)\n", output.c_str(), train.size(), val.size());
    core::finish_standard_output();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "plot_metrics: %s\n", e.what());
    return 1;
  }
  return 0;
}
