// Byte tokenizer and the Hugging Face byte-level BPE tokenizer (Qwen2 / Qwen3 tokenizer.json).
//
// The pre-tokenizer regex of the Qwen2 family is
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// matched here by hand on code points, alternative by alternative with the backtracking outcome of
// a leftmost-first regex engine worked out (see qwen2_piece_end). The case-insensitive contractions
// fold ASCII letters only, as Hugging Face's engine does ("'ſ" is not a contraction).
#include "text/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <queue>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/unicode_text.h"

namespace text {
namespace {

constexpr std::string_view kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// GPT-2's reversible map from bytes to printable code points: printable Latin-1 bytes map to
// themselves, the other 68 bytes to U+0100 onwards in byte order.
struct ByteLevelMap {
  char32_t byte_to_char[256];
  int char_to_byte[324];  // -1 where no byte maps
  ByteLevelMap() {
    std::fill(std::begin(char_to_byte), std::end(char_to_byte), -1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_to_char[b] = printable ? static_cast<char32_t>(b) : next++;
      char_to_byte[byte_to_char[b]] = b;
    }
  }
};

const ByteLevelMap& byte_level() {
  static const ByteLevelMap map;
  return map;
}

bool is_line_break(char32_t c) { return c == '\r' || c == '\n'; }
bool is_other(char32_t c) { return !unicode::is_whitespace(c) && !unicode::is_letter(c) && !unicode::is_number(c); }
char32_t ascii_lower(char32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

// End of the regex match that starts at `i` (every position starts one, so pieces tile the text).
std::size_t qwen2_piece_end(std::u32string_view s, std::size_t i) {
  const std::size_t n = s.size();
  const char32_t c = s[i];
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)
  if (c == '\'' && i + 1 < n) {
    const char32_t a = ascii_lower(s[i + 1]);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if (i + 2 < n) {
      const char32_t b = ascii_lower(s[i + 2]);
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    }
  }
  // [^\r\n\p{L}\p{N}]?\p{L}+
  std::size_t letters = n;
  if (unicode::is_letter(c)) {
    letters = i;
  } else if (!is_line_break(c) && !unicode::is_number(c) && i + 1 < n && unicode::is_letter(s[i + 1])) {
    letters = i + 1;
  }
  if (letters != n) {
    std::size_t j = letters + 1;
    while (j < n && unicode::is_letter(s[j])) ++j;
    return j;
  }
  // \p{N}
  if (unicode::is_number(c)) return i + 1;
  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
  const std::size_t k = (c == ' ' && i + 1 < n) ? i + 1 : i;
  if (is_other(s[k])) {
    std::size_t j = k + 1;
    while (j < n && is_other(s[j])) ++j;
    while (j < n && is_line_break(s[j])) ++j;
    return j;
  }
  // c is whitespace here. \s*[\r\n]+ : the run up to and including its last line break.
  std::size_t run_end = i;
  std::size_t last_break = n;
  while (run_end < n && unicode::is_whitespace(s[run_end])) {
    if (is_line_break(s[run_end])) last_break = run_end;
    ++run_end;
  }
  if (last_break != n) return last_break + 1;
  // \s+(?!\S) : the whole run at the end of the text, else the run less its last character.
  if (run_end == n) return n;
  if (run_end - 1 > i) return run_end - 1;
  // \s+
  return run_end;
}

// Pieces longer than this merge through a heap: the plain rescan is quadratic in the piece's
// length (a megabyte without spaces took minutes), the heap O(n log n); short pieces stay on the
// plain loop, which is faster for them.
constexpr std::size_t kPlainMergeBytes = 64;

// Applies the lowest-ranked merge present (the leftmost of equals) until none applies, as the
// plain loop in encode_piece does: candidate pairs sit in a heap keyed (rank, position of the
// left token), tokens in a linked list; entries whose tokens changed since are skipped.
template <typename Merges>
void merge_with_heap(std::vector<std::uint32_t>& ids, const Merges& merges) {
  const std::size_t n = ids.size();
  std::vector<std::size_t> next(n), prev(n);
  for (std::size_t i = 0; i < n; ++i) {
    next[i] = i + 1;
    prev[i] = i == 0 ? n : i - 1;  // n: none
  }
  struct Candidate {
    std::uint32_t rank;
    std::size_t left;
    std::uint32_t left_id, right_id, merged_id;
  };
  const auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.left > b.left;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> heap(later);
  std::vector<bool> alive(n, true);
  const auto push = [&](std::size_t left) {
    if (left >= n || next[left] >= n) return;
    const auto it = merges.find((std::uint64_t{ids[left]} << 32) | ids[next[left]]);
    if (it != merges.end()) heap.push({it->second.rank, left, ids[left], ids[next[left]], it->second.merged_id});
  };
  for (std::size_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const std::size_t right = next[c.left];
    if (!alive[c.left] || right >= n || ids[c.left] != c.left_id || ids[right] != c.right_id) continue;
    ids[c.left] = c.merged_id;
    alive[right] = false;
    next[c.left] = next[right];
    if (next[right] < n) prev[next[right]] = c.left;
    push(prev[c.left]);
    push(c.left);
  }
  std::size_t kept = 0;
  for (std::size_t i = 0; i < n; i = next[i]) ids[kept++] = ids[i];
  ids.resize(kept);
}

[[noreturn]] void refuse(const std::filesystem::path& path, const std::string& what) {
  throw core::InputError("tokenizer '" + path.string() + "': " + what);
}

// tokenizer.json nests five levels; deeper input is refused before anything recurses over it.
constexpr int kMaxJsonDepth = 64;

// A token id of the file: an integer in [0, limit). `limit` is the file's size in bytes (a
// vocabulary of n ids takes more than n bytes to list), so the id tables stay proportional to
// the input; it never exceeds 2^31 (ids are int32 on the device).
std::uint32_t checked_id(const std::filesystem::path& path, const nlohmann::json& value, std::uint64_t limit,
                         const std::string& where) {
  limit = std::min<std::uint64_t>(limit, std::uint64_t{1} << 31);
  if (!value.is_number_integer() ||
      (value.is_number_unsigned()
           ? value.get<std::uint64_t>() >= limit
           : value.get<std::int64_t>() < 0 || static_cast<std::uint64_t>(value.get<std::int64_t>()) >= limit)) {
    refuse(path, where + ": id " + value.dump() + " is not an integer in [0, " + std::to_string(limit) +
                     ") (ids are bounded by the file's size in bytes)");
  }
  return static_cast<std::uint32_t>(value.get<std::uint64_t>());
}

bool is_false_or_absent(const nlohmann::json& object, const char* key) {
  return !object.contains(key) || object.at(key).is_null() ||
         (object.at(key).is_boolean() && !object.at(key).get<bool>());
}

bool is_empty_or_absent(const nlohmann::json& object, const char* key) {
  return !object.contains(key) || object.at(key).is_null() ||
         (object.at(key).is_string() && object.at(key).get<std::string>().empty());
}

}  // namespace

std::vector<std::uint32_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<std::uint32_t> ids(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const std::uint32_t> ids) const {
  std::string out(ids.size(), '\0');
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] > 255)
      throw core::InputError("byte tokenizer: id " + std::to_string(ids[i]) + " is not a byte (vocab 256)");
    out[i] = static_cast<char>(ids[i]);
  }
  return out;
}

BpeTokenizer::BpeTokenizer(const std::filesystem::path& path) : path_(path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) refuse(path, "cannot be opened");
  std::error_code size_error;
  const std::uint64_t file_bytes = std::filesystem::file_size(path, size_error);
  if (size_error) refuse(path, "cannot read its size: " + size_error.message());
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(file, [&](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > kMaxJsonDepth) refuse(path, "nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    refuse(path, std::string("is not valid JSON: ") + e.what());
  }
  try {
    const nlohmann::json& model = root.at("model");
    if (model.value("type", std::string("BPE")) != "BPE")
      refuse(path, "model type '" + model.at("type").get<std::string>() + "' is not BPE");
    if (!is_false_or_absent(model, "byte_fallback")) refuse(path, "model.byte_fallback is not supported");
    if (!is_empty_or_absent(model, "continuing_subword_prefix") || !is_empty_or_absent(model, "end_of_word_suffix")) {
      refuse(path, "model.continuing_subword_prefix / end_of_word_suffix are not supported");
    }
    if (model.contains("dropout") && !model.at("dropout").is_null()) refuse(path, "model.dropout is not supported");
    if (!is_false_or_absent(model, "ignore_merges")) refuse(path, "model.ignore_merges is not supported");

    const nlohmann::json& normalizer = root.at("normalizer");
    if (!normalizer.is_null()) {
      if (normalizer.value("type", std::string()) != "NFC")
        refuse(path, "normalizer " + normalizer.dump() + " is not supported (null or NFC)");
      nfc_ = true;
    }

    const nlohmann::json& pre = root.at("pre_tokenizer");
    const bool qwen2_pre_tokenizer =
        pre.value("type", std::string()) == "Sequence" && pre.at("pretokenizers").size() == 2 &&
        pre.at("pretokenizers")[0].value("type", std::string()) == "Split" &&
        pre.at("pretokenizers")[0].at("pattern").value("Regex", std::string()) == kQwen2Pattern &&
        pre.at("pretokenizers")[0].value("behavior", std::string()) == "Isolated" &&
        is_false_or_absent(pre.at("pretokenizers")[0], "invert") &&
        pre.at("pretokenizers")[1].value("type", std::string()) == "ByteLevel" &&
        is_false_or_absent(pre.at("pretokenizers")[1], "add_prefix_space") &&
        is_false_or_absent(pre.at("pretokenizers")[1], "use_regex");
    if (!qwen2_pre_tokenizer) {
      refuse(path,
             "pre_tokenizer is not the Qwen2 one (Split on the Qwen2 regex, Isolated, then ByteLevel without regex)");
    }

    // Vocabulary: byte-level strings -> raw bytes.
    const ByteLevelMap& map = byte_level();
    std::unordered_map<std::string, std::uint32_t> vocab;  // byte-level text -> id
    const nlohmann::json& vocab_json = model.at("vocab");
    vocab.reserve(vocab_json.size());
    std::uint32_t max_id = 0;
    for (const auto& [token, id_json] : vocab_json.items()) {
      const std::uint32_t id = checked_id(path, id_json, file_bytes, "model.vocab['" + token + "']");
      vocab.emplace(token, id);
      max_id = std::max(max_id, id);
    }
    std::size_t added_index = 0;
    for (const auto& added : root.at("added_tokens")) {
      const std::string where = "added_tokens[" + std::to_string(added_index++) + "]";
      max_id = std::max(max_id, checked_id(path, added.at("id"), file_bytes, where));
    }
    vocab_size_ = max_id + 1;
    id_bytes_.assign(vocab_size_, std::string());
    id_known_.assign(vocab_size_, false);
    id_special_.assign(vocab_size_, false);
    for (const auto& [token, id] : vocab) {
      std::string bytes;
      for (char32_t c : unicode::decode_utf8(token, "tokenizer vocabulary")) {
        if (c >= std::size(map.char_to_byte) || map.char_to_byte[c] < 0) {
          refuse(path, "vocabulary token '" + token + "' is not byte-level text");
        }
        bytes.push_back(static_cast<char>(map.char_to_byte[c]));
      }
      id_bytes_[id] = std::move(bytes);
      id_known_[id] = true;
    }
    for (int b = 0; b < 256; ++b) {
      std::string token;
      unicode::append_utf8(token, map.byte_to_char[b]);
      const auto it = vocab.find(token);
      if (it == vocab.end()) refuse(path, "the vocabulary lacks the token of byte " + std::to_string(b));
      byte_ids_[b] = it->second;
    }

    const nlohmann::json& merges = model.at("merges");
    merges_.reserve(merges.size());
    for (std::size_t rank = 0; rank < merges.size(); ++rank) {
      std::string left, right;
      if (merges[rank].is_array()) {
        left = merges[rank].at(0).get<std::string>();
        right = merges[rank].at(1).get<std::string>();
      } else {
        const std::string pair = merges[rank].get<std::string>();
        const std::size_t space = pair.find(' ');
        if (space == std::string::npos)
          refuse(path, "merge " + std::to_string(rank) + " '" + pair + "' is not two tokens");
        left = pair.substr(0, space);
        right = pair.substr(space + 1);
      }
      const auto l = vocab.find(left), r = vocab.find(right), m = vocab.find(left + right);
      if (l == vocab.end() || r == vocab.end() || m == vocab.end()) {
        refuse(path, "merge " + std::to_string(rank) + " ('" + left + "', '" + right +
                         "') uses a token missing from the vocabulary");
      }
      const std::uint64_t key = (std::uint64_t{l->second} << 32) | r->second;
      merges_.try_emplace(key, Merge{static_cast<std::uint32_t>(rank), m->second});
    }

    for (const auto& added : root.at("added_tokens")) {
      if (!is_false_or_absent(added, "single_word") || !is_false_or_absent(added, "lstrip") ||
          !is_false_or_absent(added, "rstrip")) {
        refuse(path, "added token " + added.at("content").get<std::string>() +
                         " sets single_word, lstrip or rstrip (not supported)");
      }
      AddedToken token{added.at("content").get<std::string>(), added.at("id").get<std::uint32_t>()};
      if (token.content.empty()) refuse(path, "an added token is empty");
      id_bytes_[token.id] = token.content;
      id_known_[token.id] = true;
      id_special_[token.id] = added.value("special", false);
      if (added.value("normalized", false)) {
        if (nfc_)
          token.content = unicode::encode_utf8(unicode::nfc(unicode::decode_utf8(token.content, "added token")));
        normalized_added_.push_back(std::move(token));
      } else {
        raw_added_.push_back(std::move(token));
      }
    }
    const auto longer_first = [](const AddedToken& a, const AddedToken& b) {
      return a.content.size() > b.content.size();
    };
    std::stable_sort(raw_added_.begin(), raw_added_.end(), longer_first);
    std::stable_sort(normalized_added_.begin(), normalized_added_.end(), longer_first);
  } catch (const nlohmann::json::exception& e) {
    refuse(path, std::string("unexpected structure: ") + e.what());
  }
}

std::string BpeTokenizer::name() const { return "bpe:" + path_.string(); }

std::int64_t BpeTokenizer::added_token_id(std::string_view content) const {
  for (const auto* list : {&raw_added_, &normalized_added_}) {
    for (const AddedToken& token : *list) {
      if (token.content == content) return token.id;
    }
  }
  return -1;
}

template <typename OnText, typename OnToken>
void BpeTokenizer::split_on_added(std::string_view text, const std::vector<AddedToken>& tokens, OnText&& on_text,
                                  OnToken&& on_token) {
  bool first_bytes[256] = {};
  for (const AddedToken& token : tokens) first_bytes[static_cast<unsigned char>(token.content[0])] = true;
  std::size_t start = 0;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (!first_bytes[static_cast<unsigned char>(text[i])]) continue;
    for (const AddedToken& token : tokens) {  // longest first
      if (text.compare(i, token.content.size(), token.content) == 0) {
        if (i > start) on_text(text.substr(start, i - start));
        on_token(token.id);
        start = i + token.content.size();
        i = start - 1;
        break;
      }
    }
  }
  if (start < text.size()) on_text(text.substr(start));
}

std::vector<std::uint32_t> BpeTokenizer::encode(std::string_view text) {
  std::vector<std::uint32_t> ids;
  ids.reserve(text.size() / 3 + 16);
  split_on_added(
      text, raw_added_, [&](std::string_view segment) { encode_segment(segment, ids); },
      [&](std::uint32_t id) { ids.push_back(id); });
  return ids;
}

void BpeTokenizer::encode_segment(std::string_view text, std::vector<std::uint32_t>& out) {
  std::u32string code_points = unicode::decode_utf8(text, "text to tokenize");
  if (nfc_) code_points = unicode::nfc(code_points);
  const auto pre_tokenize = [&](std::u32string_view s) {
    std::string piece;
    for (std::size_t i = 0; i < s.size();) {
      const std::size_t end = qwen2_piece_end(s, i);
      piece.clear();
      for (std::size_t k = i; k < end; ++k) unicode::append_utf8(piece, s[k]);
      encode_piece(piece, out);
      i = end;
    }
  };
  if (normalized_added_.empty()) {
    pre_tokenize(code_points);
    return;
  }
  split_on_added(
      unicode::encode_utf8(code_points), normalized_added_,
      [&](std::string_view segment) { pre_tokenize(unicode::decode_utf8(segment, "normalized text")); },
      [&](std::uint32_t id) { out.push_back(id); });
}

void BpeTokenizer::encode_piece(std::string_view bytes, std::vector<std::uint32_t>& out) {
  constexpr std::size_t kCachedPieceBytes = 128, kCacheEntries = std::size_t{1} << 20;
  if (bytes.size() <= kCachedPieceBytes) {
    if (const auto it = cache_.find(std::string(bytes)); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<std::uint32_t> ids(bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) ids[i] = byte_ids_[static_cast<unsigned char>(bytes[i])];
  // Apply the lowest-ranked merge present (the leftmost of equals) until none applies.
  if (ids.size() > kPlainMergeBytes) {
    merge_with_heap(ids, merges_);
  } else {
    while (ids.size() > 1) {
      std::uint32_t best_rank = std::numeric_limits<std::uint32_t>::max();
      std::size_t best = 0;
      std::uint32_t best_id = 0;
      for (std::size_t i = 0; i + 1 < ids.size(); ++i) {
        const auto it = merges_.find((std::uint64_t{ids[i]} << 32) | ids[i + 1]);
        if (it != merges_.end() && it->second.rank < best_rank) {
          best_rank = it->second.rank;
          best = i;
          best_id = it->second.merged_id;
        }
      }
      if (best_rank == std::numeric_limits<std::uint32_t>::max()) break;
      ids[best] = best_id;
      ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    }
  }
  out.insert(out.end(), ids.begin(), ids.end());
  if (bytes.size() <= kCachedPieceBytes) {
    if (cache_.size() >= kCacheEntries) cache_.clear();
    cache_.emplace(std::string(bytes), std::move(ids));
  }
}

std::string BpeTokenizer::decode(std::span<const std::uint32_t> ids) const {
  std::string out;
  for (std::uint32_t id : ids) {
    if (id >= vocab_size_ || !id_known_[id]) {
      throw core::InputError("tokenizer '" + path_.string() + "': id " + std::to_string(id) +
                             " is not in the vocabulary");
    }
    out += id_bytes_[id];
  }
  return out;
}

namespace {

// Length of the well-formed UTF-8 sequence at text[i], or of its maximal ill-formed prefix as a
// negative number (Unicode's "maximal subpart", at least one byte), per the Unicode table of
// well-formed byte sequences.
int utf8_sequence(std::string_view text, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  if (lead < 0x80) return 1;
  int length = 0;
  unsigned char low = 0x80, high = 0xBF;  // range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;
  } else {
    return -1;
  }
  for (int k = 1; k < length; ++k) {
    if (i + k >= text.size()) return -k;
    const unsigned char b = byte(i + k);
    const bool ok = k == 1 ? (b >= low && b <= high) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return -k;
  }
  return length;
}

}  // namespace

std::string Tokenizer::decode_text(std::span<const std::uint32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  if (skip_special_tokens) {
    std::vector<std::uint32_t> kept;
    kept.reserve(ids.size());
    for (std::uint32_t id : ids) {
      if (!is_special(id)) kept.push_back(id);
    }
    bytes = decode(kept);
  } else {
    bytes = decode(ids);
  }
  std::string text;
  text.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size();) {
    const int length = utf8_sequence(bytes, i);
    if (length > 0) {
      text.append(bytes, i, static_cast<std::size_t>(length));
      i += static_cast<std::size_t>(length);
    } else {
      text += "\xEF\xBF\xBD";  // U+FFFD
      i += static_cast<std::size_t>(-length);
    }
  }
  return text;
}

std::string Tokenizer::display_text(std::span<const std::int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::uint32_t> run;  // ids the tokenizer knows, decoded together
  std::string out;
  const auto flush = [&] {
    out += decode_text(run, skip_special_tokens);
    run.clear();
  };
  for (const std::int32_t id : ids) {
    const auto u = static_cast<std::uint32_t>(id);
    bool known = u < vocab_size();
    if (known) {
      try {
        (void)decode(std::span<const std::uint32_t>(&u, 1));
      } catch (const core::InputError&) {
        known = false;
      }
    }
    if (known) {
      run.push_back(u);
    } else {
      flush();
      out += "\xEF\xBF\xBD";  // U+FFFD
    }
  }
  flush();
  return out;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  return std::make_unique<BpeTokenizer>(spec);
}

}  // namespace text
