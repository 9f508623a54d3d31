#include "fuzz_support.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>

#include <spdlog/spdlog.h>
#include <unistd.h>

namespace fuzz {

Files split_files(const std::uint8_t* data, std::size_t size, const std::string& first_name) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  // A header "=== NAME" starts the input or a line; the newline before it separates, not belongs.
  std::vector<std::size_t> headers;
  if (text.starts_with("=== ")) headers.push_back(0);
  for (std::size_t p = text.find("\n=== "); p != std::string_view::npos; p = text.find("\n=== ", p + 1)) {
    headers.push_back(p + 1);
  }
  Files files;
  if (headers.empty() || headers[0] != 0) {
    files.emplace_back(first_name, std::string(text.substr(0, headers.empty() ? size : headers[0] - 1)));
  }
  for (std::size_t i = 0; i < headers.size(); ++i) {
    const std::size_t h = headers[i];
    const std::size_t line_end = std::min(text.find('\n', h), size);
    const std::size_t body_start = std::min(line_end + 1, size);
    const std::size_t body_end = std::max(body_start, i + 1 < headers.size() ? headers[i + 1] - 1 : size);
    files.emplace_back(std::string(text.substr(h + 4, line_end - h - 4)),
                       std::string(text.substr(body_start, body_end - body_start)));
  }
  return files;
}

const std::string* find_file(const Files& files, std::string_view name) {
  for (const auto& [n, bytes] : files) {
    if (n == name) return &bytes;
  }
  return nullptr;
}

std::string safe_name(std::string_view name) {
  std::string out;
  for (char c : name) {
    if (out.size() == 64) break;
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (ok) out.push_back(c);
  }
  if (out == "." || out == "..") out.clear();
  return out;
}

Scratch::Scratch() {
  // Progress lines of the readers would drown the fuzzer's own; LLMTRAIN_FUZZ_VERBOSE keeps them.
  if (std::getenv("LLMTRAIN_FUZZ_VERBOSE") == nullptr) spdlog::set_level(spdlog::level::off);
  std::string pattern = (std::filesystem::temp_directory_path() / "llmtrain_fuzz_XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = pattern;
}

Scratch::~Scratch() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

const std::filesystem::path& Scratch::fresh() {
  for (const auto& entry : std::filesystem::directory_iterator(path_)) std::filesystem::remove_all(entry.path());
  return path_;
}

void refused(const std::exception& error) {
  static const bool verbose = std::getenv("LLMTRAIN_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "refused: %s\n", error.what());
}

void write_file(const std::filesystem::path& path, std::string_view bytes) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

void finding(std::string_view target, const std::string& what) {
  std::fprintf(stderr, "%.*s: %s\n", static_cast<int>(target.size()), target.data(), what.c_str());
  std::abort();
}

}  // namespace fuzz
