// Fuzz target: a Hugging Face tokenizer.json loaded by the BPE tokenizer, then text encoded and
// ids decoded with it. Input: the tokenizer.json text, then optionally "=== text" (bytes to
// encode) and "=== ids" (little-endian u32 ids to decode). Every id encode returns must lie in
// the vocabulary and decode back without error.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "fuzz_support.h"
#include "text/tokenizer.h"

namespace {

std::unique_ptr<fuzz::Scratch> scratch;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  scratch = std::make_unique<fuzz::Scratch>();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fuzz::Files files = fuzz::split_files(data, size, "tokenizer.json");
  const auto path = scratch->fresh() / "tokenizer.json";
  fuzz::write_file(path, files.front().second);
  std::unique_ptr<text::BpeTokenizer> tokenizer;
  try {
    tokenizer = std::make_unique<text::BpeTokenizer>(path);
  } catch (const core::Error& e) {
    fuzz::refused(e);
    return 0;
  }
  if (tokenizer->vocab_size() == 0) fuzz::finding("fuzz_tokenizer", "accepted an empty vocabulary");
  if (const std::string* text = fuzz::find_file(files, "text")) {
    try {
      const std::vector<std::uint32_t> ids = tokenizer->encode(*text);
      for (std::uint32_t id : ids) {
        if (id >= tokenizer->vocab_size())
          fuzz::finding("fuzz_tokenizer", "encode gave id " + std::to_string(id) + " beyond the vocabulary");
      }
      (void)tokenizer->decode(ids);
      (void)tokenizer->decode_text(ids);
    } catch (const core::Error& e) {
      fuzz::refused(e);
    }
  }
  if (const std::string* bytes = fuzz::find_file(files, "ids")) {
    std::vector<std::uint32_t> ids(bytes->size() / 4);
    if (!ids.empty()) std::memcpy(ids.data(), bytes->data(), ids.size() * 4);
    for (bool skip : {true, false}) {
      try {
        (void)tokenizer->decode_text(ids, skip);
      } catch (const core::Error& e) {
        fuzz::refused(e);
      }
    }
    for (std::uint32_t id : ids) (void)tokenizer->is_special(id);
  }
  (void)tokenizer->added_token_id("<|endoftext|>");
  return 0;
}
