// What the fuzz targets share: an input cut into named files, a scratch folder per process, and
// the rule that a reader given hostile bytes either succeeds or throws core::Error (any other
// exception escapes LLVMFuzzerTestOneInput and counts as a finding).
//
// Input layout (seed corpora stay readable text where the format is text):
//   bytes of the first file
//   === NAME
//   bytes of file NAME ...
// A line "=== NAME" starts the next file; the bytes before the first such line form the file
// named by the target's default (e.g. "config.yaml").
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace fuzz {

using Files = std::vector<std::pair<std::string, std::string>>;

// The files of `data`; the part before the first "=== " line is named `first_name`.
Files split_files(const std::uint8_t* data, std::size_t size, const std::string& first_name);

// Contents of the file `name`, or nullptr.
const std::string* find_file(const Files& files, std::string_view name);

// A file name from an input made safe: one path component of [A-Za-z0-9._-], not "." or "..",
// at most 64 characters; empty when nothing usable remains.
std::string safe_name(std::string_view name);

// A folder of this process under the temporary directory, emptied by each call to fresh().
class Scratch {
 public:
  Scratch();
  ~Scratch();
  // Empties the folder and returns it.
  const std::filesystem::path& fresh();
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A finding: a reader accepted what it must refuse, or broke an invariant. Prints
// "TARGET: WHAT" and aborts, so libFuzzer keeps the input.
[[noreturn]] void finding(std::string_view target, const std::string& what);

// A refusal the target expected; printed when LLMTRAIN_FUZZ_VERBOSE is set (to check seeds).
void refused(const std::exception& error);

// Writes `bytes` to `path` (parent folders created).
void write_file(const std::filesystem::path& path, std::string_view bytes);

}  // namespace fuzz
