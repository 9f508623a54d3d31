// Tokenizers that turn text into token ids and back:
//   ByteTokenizer  id = byte value, vocabulary 256; any byte string round-trips.
//   BpeTokenizer   a Hugging Face `tokenizer.json` byte-level BPE of the Qwen2 / Qwen3 family, with
//                  the ids of the `tokenizers` library: added tokens split off first (longest match at
//                  the leftmost position), NFC when the file's normalizer asks for it, the Qwen2
//                  pre-tokenizer regex (matched by hand, see tokenizer.cpp), the GPT-2 byte-to-unicode
//                  mapping, and merges applied by rank (lowest first, leftmost among equals) with a
//                  cache of encoded pieces. A file with another pre-tokenizer, normalizer, model or
//                  added-token option is refused with a core::InputError saying what is unsupported.
// make_tokenizer("byte") or make_tokenizer("PATH/tokenizer.json") picks one.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace text {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Ids of `text`. The BPE tokenizer needs valid UTF-8 (core::InputError otherwise).
  virtual std::vector<std::uint32_t> encode(std::string_view text) = 0;
  // The bytes of `ids` concatenated (added tokens as their text); core::InputError for an unknown id.
  virtual std::string decode(std::span<const std::uint32_t> ids) const = 0;
  // Text for display, as Hugging Face's decode gives it: the bytes of decode() with special added
  // tokens left out (unless skip_special_tokens is false), and every maximal ill-formed UTF-8
  // subsequence (a token boundary inside a character, say) replaced by U+FFFD.
  std::string decode_text(std::span<const std::uint32_t> ids, bool skip_special_tokens = true) const;
  // decode_text() of a model's output: ids the tokenizer does not know (a model vocabulary larger
  // than the tokenizer's) become U+FFFD instead of an error.
  std::string display_text(std::span<const std::int32_t> ids, bool skip_special_tokens = true) const;
  // Whether `id` is an added token marked special (never for the byte tokenizer).
  virtual bool is_special(std::uint32_t id) const { return false; }
  // One past the largest id.
  virtual std::uint32_t vocab_size() const = 0;
  virtual std::string name() const = 0;
};

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<std::uint32_t> encode(std::string_view text) override;
  std::string decode(std::span<const std::uint32_t> ids) const override;
  std::uint32_t vocab_size() const override { return 256; }
  std::string name() const override { return "byte"; }
};

// Not safe for concurrent encode calls on one instance (the piece cache); use one per thread.
class BpeTokenizer final : public Tokenizer {
 public:
  // Loads and checks `path` (a tokenizer.json); core::InputError names the file and the problem.
  explicit BpeTokenizer(const std::filesystem::path& path);

  std::vector<std::uint32_t> encode(std::string_view text) override;
  std::string decode(std::span<const std::uint32_t> ids) const override;
  bool is_special(std::uint32_t id) const override { return id < id_special_.size() && id_special_[id]; }
  std::uint32_t vocab_size() const override { return vocab_size_; }
  std::string name() const override;

  // The id of an added token's text (e.g. "<|endoftext|>"), or -1.
  std::int64_t added_token_id(std::string_view content) const;

 private:
  struct AddedToken {
    std::string content;
    std::uint32_t id;
  };
  struct Merge {
    std::uint32_t rank;
    std::uint32_t merged_id;
  };

  // Splits `text` on `tokens` (longest match at the leftmost position); calls on_text for the
  // stretches between them and on_token for the matches.
  template <typename OnText, typename OnToken>
  static void split_on_added(std::string_view text, const std::vector<AddedToken>& tokens, OnText&& on_text,
                             OnToken&& on_token);
  void encode_segment(std::string_view text, std::vector<std::uint32_t>& out);
  void encode_piece(std::string_view bytes, std::vector<std::uint32_t>& out);

  std::filesystem::path path_;
  bool nfc_ = false;
  std::uint32_t vocab_size_ = 0;
  std::uint32_t byte_ids_[256] = {};
  std::unordered_map<std::uint64_t, Merge> merges_;  // key: (left id << 32) | right id
  std::vector<std::string> id_bytes_;                // id -> raw bytes (added tokens: their text)
  std::vector<bool> id_known_;
  std::vector<bool> id_special_;              // added tokens with "special": true
  std::vector<AddedToken> raw_added_;         // matched before normalisation
  std::vector<AddedToken> normalized_added_;  // matched after normalisation
  std::unordered_map<std::string, std::vector<std::uint32_t>> cache_;
};

// "byte" -> ByteTokenizer, anything else -> BpeTokenizer(path).
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec);

}  // namespace text
