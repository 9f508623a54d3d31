// make_shards: text corpora -> token shards (format in docs/formats.md) for training and validation.
//   make_shards INPUT... --tokenizer byte|PATH/tokenizer.json --train-out train.tok
//               [--val-out val.tok (--val-fraction F | --val-every K)] [--jsonl-field text]
//               [--separator TEXT | --separator-id ID] [--threads N] [--progress]
// Documents: a plain-text input is one document; with --jsonl-field each non-blank line of a JSONL
// input is one (the string under that key). Documents go to the shards in input order, consecutive
// documents of a shard separated by the separator ids (a BPE tokenizer's "<|endoftext|>" by default).
// The inputs stream through in chunks cut at line boundaries (plain text: only where the BPE
// pre-tokenizer splits anyway, so the ids equal one encode call over the whole document); worker
// threads with one tokenizer each encode the chunks and a writer appends them in order, so memory
// stays bounded by the chunks in flight. Ids are stored as u16 when the vocabulary fits, else u32.
// Validation split: every K-th document (--val-every, decided while streaming) or the last tokens
// (--val-fraction, moved out of the training file at the end). A progress line (bytes/s, ETA) goes
// to stderr when it is a terminal or with --progress.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cctype>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"
#include "core/standard_streams.h"
#include "text/token_shard.h"
#include "text/tokenizer.h"
#include "text/unicode_text.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string errno_text() { return std::strerror(errno); }

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// --- inputs -------------------------------------------------------------------------------------

struct Input {
  std::string path;        // "-" for standard input
  std::uint64_t size = 0;  // bytes, 0 when unknown (a pipe)
  bool size_known = false;
};

Input check_input(const std::string& path) {
  Input input{path};
  if (path == "-") return input;
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) throw core::InputError("cannot open input '" + path + "': " + errno_text());
  if (S_ISDIR(info.st_mode)) throw core::InputError("input '" + path + "' is a folder, not a file");
  if (S_ISREG(info.st_mode)) {
    input.size = static_cast<std::uint64_t>(info.st_size);
    input.size_known = true;
  }
  return input;
}

// Two spellings of one file (`t.bin`, `./t.bin`, a link) must count as one: an existing file by
// device and inode, one still to be made by its resolved path.
struct FileIdentity {
  bool exists = false;
  dev_t device = 0;
  ino_t inode = 0;
  fs::path resolved;
  bool operator==(const FileIdentity& o) const {
    return exists && o.exists ? device == o.device && inode == o.inode : resolved == o.resolved;
  }
};

FileIdentity identity_of(const std::string& path) {
  FileIdentity id;
  struct stat info {};
  if (::stat(path.c_str(), &info) == 0) {
    id.exists = true;
    id.device = info.st_dev;
    id.inode = info.st_ino;
  }
  std::error_code ec;
  id.resolved = fs::weakly_canonical(fs::absolute(path), ec);
  if (ec) id.resolved = fs::absolute(path).lexically_normal();
  return id;
}

// An output must not be an input or the other output, nor a folder: checked before anything is
// written, so no corpus is overwritten and no run fails at its last rename.
void check_outputs(const std::vector<std::string>& inputs, const std::string& train_out, const std::string& val_out) {
  std::vector<std::pair<std::string, std::string>> outputs = {{"--train-out", train_out}};
  if (!val_out.empty()) outputs.emplace_back("--val-out", val_out);
  for (const auto& [option, path] : outputs) {
    struct stat info {};
    if (::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
      throw core::InputError(option + " " + path + ": is a folder; give a file name");
    }
    const FileIdentity id = identity_of(path);
    for (const std::string& input : inputs) {
      if (input != "-" && identity_of(input) == id) {
        throw core::InputError(option + " " + path + ": is the input " + input + " (it would be overwritten)");
      }
    }
  }
  if (outputs.size() == 2 && identity_of(train_out) == identity_of(val_out)) {
    throw core::InputError("--train-out " + train_out + " and --val-out " + val_out + " name the same file");
  }
}

// Where a chunk of a plain-text document may end so that encoding the pieces separately gives the
// ids of one encode call: right after a '\n' that is followed by whitespace other than line breaks
// and then a non-whitespace character. The Qwen2 pre-tokenizer always ends a piece there (the
// line-break alternative stops at the last line break of a whitespace run), NFC composes nothing
// across it, and no added token spans it (checked when the tokenizer is loaded).
class PlainTextCuts {
 public:
  // Inside a line, a piece of the pre-tokenizer always ends between an ASCII letter and a space
  // followed by an ASCII letter (" word" starts a piece whatever precedes it) and between two
  // ASCII digits (each digit is a piece); NFC composes nothing across them. The last such
  // position in `text` at or after `from`, or npos: for lines too long to hold whole.
  static std::size_t last_in_line(std::string_view text, std::size_t from) {
    const auto letter = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); };
    const auto digit = [](char c) { return c >= '0' && c <= '9'; };
    for (std::size_t i = text.size() - 1; i > from && i > 0; --i) {
      if (digit(text[i - 1]) && digit(text[i])) return i;
      if (text[i] == ' ' && i + 1 < text.size() && letter(text[i - 1]) && letter(text[i + 1])) return i;
    }
    return std::string_view::npos;
  }

  // The last cut position in `text` at or after `from` (and > 0), or npos.
  static std::size_t last(std::string_view text, std::size_t from) {
    for (std::size_t i = text.size(); i-- > from;) {
      if (text[i] != '\n' || i + 1 >= text.size()) continue;
      if (i + 1 > from && safe_after_newline(text, i + 1)) return i + 1;
    }
    return std::string_view::npos;
  }

 private:
  static bool safe_after_newline(std::string_view text, std::size_t p) {
    while (p < text.size()) {
      char32_t c = 0;
      const std::size_t n = decode(text, p, c);
      if (n == 0) return false;  // invalid or cut UTF-8: not here
      if (c == U'\n' || c == U'\r') return false;
      if (!text::unicode::is_whitespace(c)) return true;
      p += n;
    }
    return false;  // whitespace up to the end of what is read: unknown yet
  }
  // Bytes of the UTF-8 sequence at `p` (its code point in `c`), 0 when invalid or incomplete.
  static std::size_t decode(std::string_view s, std::size_t p, char32_t& c) {
    const auto b0 = static_cast<unsigned char>(s[p]);
    if (b0 < 0x80) {
      c = b0;
      return 1;
    }
    const std::size_t n = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : b0 >= 0xC2 ? 2 : 0;
    if (n == 0 || b0 > 0xF4 || p + n > s.size()) return 0;
    c = b0 & (0x7F >> n);
    for (std::size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[p + k]);
      if ((b & 0xC0) != 0x80) return 0;
      c = (c << 6) | (b & 0x3F);
    }
    return n;
  }
};

enum class InputKind { plain_text, jsonl };

// Where chunks of an input may end: after any line (JSONL), anywhere (byte tokenizer), at a
// PlainTextCuts position (BPE; inside long lines too, or only at lines when an added token could
// span a cut inside one), or only at the end of the input.
enum class Cuts { lines, anywhere, plain_text, plain_text_lines, none };

// A piece of one input, cut at a line (JSONL) or safe (plain text) boundary.
struct Chunk {
  std::uint64_t sequence = 0;
  std::size_t input = 0;
  std::string bytes;
  std::uint64_t offset = 0;      // of bytes[0] in the input
  std::uint64_t first_line = 1;  // line number of bytes[0]
  bool starts_input = false;
  bool ends_input = false;
};

// Reads one input and cuts it into chunks of about `target` bytes.
class ChunkReader {
 public:
  ChunkReader(const Input& input, Cuts cuts, std::size_t target) : input_(input), cuts_(cuts), target_(target) {
    if (input.path == "-") {
      fd_ = STDIN_FILENO;
    } else {
      fd_ = ::open(input.path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd_ < 0) throw core::InputError("cannot open input '" + input.path + "': " + errno_text());
      owned_ = true;
    }
  }
  ~ChunkReader() {
    if (owned_) ::close(fd_);
  }
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;

  // The next chunk, or nothing once the input's last chunk was returned.
  std::optional<Chunk> next() {
    if (finished_) return std::nullopt;
    fill(target_);
    std::size_t cut = buffer_.size();
    if (!eof_) {
      std::size_t searched = 0;
      while ((cut = find_cut(searched)) == std::string::npos && !eof_) {
        // A line longer than a chunk is cut inside, where that is safe, so memory stays bounded.
        if (cuts_ == Cuts::plain_text && buffer_.size() >= target_ &&
            (cut = PlainTextCuts::last_in_line(buffer_, searched > 2 ? searched - 2 : 0)) != std::string::npos) {
          break;
        }
        searched = buffer_.size();
        fill(buffer_.size() + target_);
      }
      if (cut == std::string::npos) cut = buffer_.size();
    }
    Chunk chunk;
    chunk.bytes.assign(buffer_, 0, cut);
    buffer_.erase(0, cut);
    chunk.offset = offset_;
    chunk.first_line = line_;
    chunk.starts_input = !started_;
    chunk.ends_input = eof_ && buffer_.empty();
    offset_ += cut;
    line_ += static_cast<std::uint64_t>(std::count(chunk.bytes.begin(), chunk.bytes.end(), '\n'));
    started_ = true;
    finished_ = chunk.ends_input;
    return chunk;
  }

 private:
  void fill(std::size_t want) {
    while (!eof_ && buffer_.size() < want) {
      const std::size_t old = buffer_.size();
      buffer_.resize(want);
      const ssize_t n = ::read(fd_, buffer_.data() + old, want - old);
      if (n < 0 && errno == EINTR) {
        buffer_.resize(old);
        continue;
      }
      if (n < 0) throw core::InputError("reading input '" + input_.path + "': " + errno_text());
      buffer_.resize(old + static_cast<std::size_t>(n));
      if (n == 0) eof_ = true;
    }
  }
  // The last cut position in buffer_, npos if none yet; [0, from) held none when last searched.
  std::size_t find_cut(std::size_t from) const {
    switch (cuts_) {
      case Cuts::lines: {
        if (from >= buffer_.size()) return std::string::npos;
        const void* nl = ::memrchr(buffer_.data() + from, '\n', buffer_.size() - from);
        return nl == nullptr ? std::string::npos
                             : static_cast<std::size_t>(static_cast<const char*>(nl) - buffer_.data()) + 1;
      }
      case Cuts::anywhere: return buffer_.empty() ? std::string::npos : buffer_.size();
      case Cuts::plain_text:
      case Cuts::plain_text_lines:
        // A candidate's check may need bytes read after it: look again a little before `from`.
        return PlainTextCuts::last(buffer_, from > 4096 ? from - 4096 : 0);
      case Cuts::none: break;
    }
    return std::string::npos;
  }

  const Input& input_;
  Cuts cuts_;
  std::size_t target_;
  int fd_ = -1;
  bool owned_ = false;
  std::string buffer_;
  bool eof_ = false, started_ = false, finished_ = false;
  std::uint64_t offset_ = 0, line_ = 1;
};

// --- encoding -----------------------------------------------------------------------------------

struct Encoded {
  std::vector<std::uint32_t> ids;
  std::vector<std::size_t> document_ends;  // JSONL: end of each document's ids in `ids`
  std::exception_ptr error;
};

std::string chunk_place(const Input& input, const Chunk& chunk) {
  return "input '" + input.path + "' (bytes " + std::to_string(chunk.offset) + ".." +
         std::to_string(chunk.offset + chunk.bytes.size()) + ")";
}

Encoded encode_chunk(text::Tokenizer& tokenizer, const Chunk& chunk, const Input& input, InputKind kind,
                     const std::string& field) {
  Encoded out;
  if (kind == InputKind::plain_text) {
    try {
      out.ids = tokenizer.encode(chunk.bytes);
    } catch (const core::InputError& e) {
      throw core::InputError(chunk_place(input, chunk) + ": " + e.what());
    }
    return out;
  }
  std::string_view rest(chunk.bytes);
  std::uint64_t line = chunk.first_line;
  while (!rest.empty()) {
    const std::size_t nl = rest.find('\n');
    const std::string_view text_line = rest.substr(0, nl);
    rest.remove_prefix(nl == std::string_view::npos ? rest.size() : nl + 1);
    const std::uint64_t number = line++;
    if (text_line.find_first_not_of(" \t\r") == std::string_view::npos) continue;  // blank line
    const std::string where = input.path + ":" + std::to_string(number);
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(text_line);
    } catch (const nlohmann::json::exception& e) {
      throw core::InputError(where + ": not a JSON line (" + e.what() + ")");
    }
    const auto it = record.is_object() ? record.find(field) : record.end();
    if (it == record.end()) throw core::InputError(where + ": no key '" + field + "' in this JSON line");
    if (!it->is_string()) throw core::InputError(where + ": '" + field + "' is " + it->type_name() + ", not a string");
    try {
      const auto ids = tokenizer.encode(it->get_ref<const std::string&>());
      out.ids.insert(out.ids.end(), ids.begin(), ids.end());
    } catch (const core::InputError& e) {
      throw core::InputError(where + ": " + e.what());
    }
    out.document_ends.push_back(out.ids.size());
  }
  return out;
}

// --- output -------------------------------------------------------------------------------------

// A token shard written as it grows: a temporary file beside `path` with a header whose count is
// filled in at the end (fsync, then rename over `path`); removed if never finished.
class ShardStream {
 public:
  ShardStream(fs::path path, text::TokenDtype dtype) : path_(std::move(path)), dtype_(dtype) {
    if (path_.has_parent_path()) fs::create_directories(path_.parent_path());
    temporary_ = path_;
    temporary_ += ".tmp." + std::to_string(::getpid());
    fd_ = ::open(temporary_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw core::Error("creating " + temporary_.string() + ": " + errno_text());
    write_header(0);
    buffer_.reserve(kBufferBytes);
  }
  ~ShardStream() {
    if (fd_ >= 0) ::close(fd_);
    if (!finished_) {
      std::error_code ignored;
      fs::remove(temporary_, ignored);
    }
  }
  ShardStream(const ShardStream&) = delete;
  ShardStream& operator=(const ShardStream&) = delete;

  // Ids < the vocabulary size, which fits the dtype.
  void append(const std::uint32_t* ids, std::size_t n) {
    const std::size_t width = static_cast<std::size_t>(dtype_);
    for (std::size_t done = 0; done < n;) {
      const std::size_t take = std::min(n - done, (kBufferBytes - buffer_.size()) / width + 1);
      const std::size_t old = buffer_.size();
      buffer_.resize(old + take * width);
      char* out = buffer_.data() + old;
      if (width == 4) {
        std::memcpy(out, ids + done, take * 4);
      } else {
        for (std::size_t i = 0; i < take; ++i) {
          const auto id = static_cast<std::uint16_t>(ids[done + i]);
          std::memcpy(out + 2 * i, &id, 2);
        }
      }
      done += take;
      if (buffer_.size() >= kBufferBytes) flush();
    }
    count_ += n;
  }
  std::uint64_t count() const { return count_; }
  std::uint64_t documents = 0;

  // Moves the last `tail` tokens into `to` (streamed through a buffer), leaving count() - tail.
  void move_tail(std::uint64_t tail, ShardStream& to) {
    flush();
    const std::size_t width = static_cast<std::size_t>(dtype_);
    const std::uint64_t keep = count_ - tail;
    std::uint64_t position = text::kTokenShardHeaderBytes + keep * width;
    const std::uint64_t end = text::kTokenShardHeaderBytes + count_ * width;
    std::vector<char> block(kBufferBytes);
    std::vector<std::uint32_t> ids;
    while (position < end) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(block.size(), end - position));
      read_at(block.data(), n, position);
      ids.resize(n / width);
      for (std::size_t i = 0; i < ids.size(); ++i) {
        if (width == 2) {
          std::uint16_t id;
          std::memcpy(&id, block.data() + i * 2, 2);
          ids[i] = id;
        } else {
          std::memcpy(&ids[i], block.data() + i * 4, 4);
        }
      }
      to.append(ids.data(), ids.size());
      position += n;
    }
    if (::ftruncate(fd_, static_cast<off_t>(text::kTokenShardHeaderBytes + keep * width)) != 0) {
      throw core::Error("truncating " + temporary_.string() + ": " + errno_text());
    }
    count_ = keep;
  }

  // Header count, fsync, rename over the target.
  void finish() {
    flush();
    write_header(count_);
    if (::fsync(fd_) != 0) throw core::Error("fsync " + temporary_.string() + ": " + errno_text());
    ::close(fd_);
    fd_ = -1;
    std::error_code ec;
    fs::rename(temporary_, path_, ec);
    if (ec) throw core::Error("renaming " + temporary_.string() + " to " + path_.string() + ": " + ec.message());
    finished_ = true;
  }

 private:
  static constexpr std::size_t kBufferBytes = std::size_t{8} << 20;

  void write_at(const void* data, std::size_t bytes, std::uint64_t position) {
    const auto* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::pwrite(fd_, p, bytes, static_cast<off_t>(position));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw core::Error("writing " + temporary_.string() + ": " + errno_text());
      p += n;
      bytes -= static_cast<std::size_t>(n);
      position += static_cast<std::uint64_t>(n);
    }
  }
  void read_at(void* data, std::size_t bytes, std::uint64_t position) {
    auto* p = static_cast<char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::pread(fd_, p, bytes, static_cast<off_t>(position));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw core::Error("reading back " + temporary_.string() + ": " + errno_text());
      p += n;
      bytes -= static_cast<std::size_t>(n);
      position += static_cast<std::uint64_t>(n);
    }
  }
  void write_header(std::uint64_t count) {
    unsigned char header[text::kTokenShardHeaderBytes];
    const std::uint32_t version = text::kTokenShardVersion;
    const auto dtype_code = static_cast<std::uint32_t>(dtype_);
    std::memcpy(header, text::kTokenShardMagic, 8);
    std::memcpy(header + 8, &version, 4);
    std::memcpy(header + 12, &dtype_code, 4);
    std::memcpy(header + 16, &count, 8);
    write_at(header, sizeof header, 0);
  }
  void flush() {
    write_at(buffer_.data(), buffer_.size(), written_);
    written_ += buffer_.size();
    buffer_.clear();
  }

  fs::path path_, temporary_;
  text::TokenDtype dtype_;
  int fd_ = -1;
  bool finished_ = false;
  std::string buffer_;
  std::uint64_t written_ = text::kTokenShardHeaderBytes;
  std::uint64_t count_ = 0;
};

// --- progress -----------------------------------------------------------------------------------

std::string format_bytes(double bytes) {
  char out[32];
  if (bytes >= 1e9)
    std::snprintf(out, sizeof out, "%.2f GB", bytes / 1e9);
  else
    std::snprintf(out, sizeof out, "%.1f MB", bytes / 1e6);
  return out;
}

std::string format_duration(double seconds) {
  const auto s = static_cast<long long>(std::max(0.0, seconds) + 0.5);
  char out[32];
  std::snprintf(out, sizeof out, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  return out;
}

// A progress line on stderr: redrawn in place on a terminal, else a line every 10 s.
class Progress {
 public:
  Progress(bool enabled, std::optional<std::uint64_t> total)
      : enabled_(enabled), terminal_(::isatty(STDERR_FILENO) != 0), total_(total), start_(Clock::now()) {}

  void update(std::uint64_t done, bool final = false) {
    if (!enabled_) return;
    const double elapsed = seconds_since(start_);
    if (!final && elapsed - last_ < (terminal_ ? 0.25 : 10.0)) return;
    last_ = elapsed;
    const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
    std::string line;
    if (total_ && *total_ > 0) {
      const double fraction = std::min(1.0, static_cast<double>(done) / static_cast<double>(*total_));
      constexpr int kWidth = 30;
      const int filled = static_cast<int>(fraction * kWidth);
      line = "[" + std::string(static_cast<std::size_t>(filled), '#') +
             std::string(static_cast<std::size_t>(kWidth - filled), '.') + "] ";
      char figures[160];
      std::snprintf(
          figures, sizeof figures, "%5.1f%%  %s / %s  %s/s  ETA %s", 100 * fraction,
          format_bytes(static_cast<double>(done)).c_str(), format_bytes(static_cast<double>(*total_)).c_str(),
          format_bytes(rate).c_str(),
          rate > 0 ? format_duration(static_cast<double>(*total_ - std::min(done, *total_)) / rate).c_str() : "?");
      line += figures;
    } else {
      line = format_bytes(static_cast<double>(done)) + "  " + format_bytes(rate) + "/s";
    }
    std::fprintf(stderr, terminal_ ? "\r\033[K%s%s" : "%s%s", line.c_str(), terminal_ && !final ? "" : "\n");
    std::fflush(stderr);
  }
  // Clears the line before other output on a shared terminal.
  void clear() {
    if (enabled_ && terminal_) std::fprintf(stderr, "\r\033[K");
  }

 private:
  bool enabled_, terminal_;
  std::optional<std::uint64_t> total_;
  Clock::time_point start_;
  double last_ = -1e9;
};

// --- tokenizers ---------------------------------------------------------------------------------

// The "added_tokens" array of a tokenizer.json (already checked by BpeTokenizer), parsed alone: the
// first occurrence of the key, which the Hugging Face serialisation puts before the vocabulary.
nlohmann::json added_tokens(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const std::size_t key = text.find("\"added_tokens\"");
  const std::size_t open = key == std::string::npos ? key : text.find_first_not_of(" \t\r\n:", key + 14);
  if (open != std::string::npos && text[open] == '[') {
    bool in_string = false, escaped = false;
    int depth = 0;
    for (std::size_t i = open; i < text.size(); ++i) {
      const char c = text[i];
      if (in_string) {
        if (escaped)
          escaped = false;
        else if (c == '\\')
          escaped = true;
        else if (c == '"')
          in_string = false;
      } else if (c == '"') {
        in_string = true;
      } else if (c == '[' || c == '{') {
        ++depth;
      } else if ((c == ']' || c == '}') && --depth == 0) {
        const nlohmann::json array = nlohmann::json::parse(text.substr(open, i + 1 - open), nullptr, false);
        if (array.is_array()) return array;
        break;
      }
    }
  }
  const nlohmann::json root = nlohmann::json::parse(text, nullptr, false);
  return root.is_object() && root.contains("added_tokens") ? root.at("added_tokens") : nlohmann::json::array();
}

// Whether an added token could span a plain-text cut (a '\n' before its last byte).
bool added_token_spans_line_break(const std::string& path) {
  for (const auto& token : added_tokens(path)) {
    const std::string content = token.is_object() ? token.value("content", std::string()) : std::string();
    const std::size_t nl = content.find('\n');
    if (nl != std::string::npos && nl + 1 < content.size()) return true;
  }
  return false;
}

// Whether an added token could span a cut inside a line (it holds a space or two ASCII digits).
bool added_token_spans_line_cut(const std::string& path) {
  for (const auto& token : added_tokens(path)) {
    const std::string content = token.is_object() ? token.value("content", std::string()) : std::string();
    if (content.find(' ') != std::string::npos) return true;
    for (std::size_t i = 1; i < content.size(); ++i) {
      if (std::isdigit(static_cast<unsigned char>(content[i - 1])) &&
          std::isdigit(static_cast<unsigned char>(content[i])))
        return true;
    }
  }
  return false;
}

// A tokenizer for one more thread: a copy of the loaded one (cheaper than parsing the file again).
std::unique_ptr<text::Tokenizer> copy_of(const text::Tokenizer& tokenizer) {
  if (const auto* bpe = dynamic_cast<const text::BpeTokenizer*>(&tokenizer))
    return std::make_unique<text::BpeTokenizer>(*bpe);
  return std::make_unique<text::ByteTokenizer>();
}

// --- the pipeline -------------------------------------------------------------------------------

struct Options {
  std::vector<Input> inputs;
  InputKind kind = InputKind::plain_text;
  std::string jsonl_field;
  std::string tokenizer_spec;
  std::vector<std::uint32_t> separator;
  std::string train_out, val_out;
  double val_fraction = 0.0;
  std::uint64_t val_every = 0;
  unsigned threads = 1;
  std::size_t chunk_bytes = std::size_t{2} << 20;
  bool progress = false;
  Cuts cuts = Cuts::plain_text;
};

struct InputStats {
  std::uint64_t bytes = 0, documents = 0, tokens = 0;
};

// Reader (the calling thread) -> workers (one tokenizer each) -> writer (input order).
class Pipeline {
 public:
  // `prototype` is copied by each worker and must not be used meanwhile.
  Pipeline(const Options& options, const text::Tokenizer& prototype)
      : options_(options), prototype_(prototype), max_in_flight_(2 * static_cast<std::size_t>(options.threads) + 2) {}

  void run(ShardStream& train, ShardStream* val, std::vector<InputStats>& stats) {
    train_ = &train;
    val_ = val;
    stats_ = &stats;
    std::optional<std::uint64_t> total = std::uint64_t{0};
    for (const Input& input : options_.inputs) {
      if (input.size_known && total)
        *total += input.size;
      else
        total.reset();
    }
    progress_.emplace(options_.progress, total);
    for (unsigned t = 0; t < options_.threads; ++t) workers_.emplace_back([this] { work(); });
    std::thread writer([this] { write(); });
    try {
      read();
    } catch (...) {
      fail(std::current_exception());
    }
    {
      std::lock_guard lock(mutex_);
      reading_done_ = true;
    }
    work_ready_.notify_all();
    done_ready_.notify_all();
    for (auto& w : workers_) w.join();
    writer.join();
    if (error_) std::rethrow_exception(error_);
    progress_->update(bytes_written_, true);
  }

 private:
  void fail(std::exception_ptr error) {
    {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = error;
    }
    work_ready_.notify_all();
    done_ready_.notify_all();
    space_ready_.notify_all();
  }

  void read() {
    for (std::size_t i = 0; i < options_.inputs.size(); ++i) {
      ChunkReader reader(options_.inputs[i], options_.cuts, options_.chunk_bytes);
      while (auto chunk = reader.next()) {
        chunk->input = i;
        std::unique_lock lock(mutex_);
        space_ready_.wait(lock, [&] { return in_flight_ < max_in_flight_ || error_; });
        if (error_) return;
        chunk->sequence = chunks_read_++;
        ++in_flight_;
        pending_.push_back(std::move(*chunk));
        lock.unlock();
        work_ready_.notify_one();
      }
    }
  }

  void work() {
    try {
      const std::unique_ptr<text::Tokenizer> tokenizer = copy_of(prototype_);
      while (true) {
        Chunk chunk;
        {
          std::unique_lock lock(mutex_);
          work_ready_.wait(lock, [&] { return !pending_.empty() || reading_done_ || error_; });
          if (error_ || pending_.empty()) return;
          chunk = std::move(pending_.front());
          pending_.pop_front();
        }
        Encoded encoded;
        try {
          encoded = encode_chunk(*tokenizer, chunk, options_.inputs[chunk.input], options_.kind, options_.jsonl_field);
        } catch (...) {
          encoded.error = std::current_exception();
        }
        {
          std::lock_guard lock(mutex_);
          finished_.emplace(chunk.sequence, std::make_pair(std::move(chunk), std::move(encoded)));
        }
        done_ready_.notify_all();
      }
    } catch (...) {
      fail(std::current_exception());
    }
  }

  void write() {
    try {
      for (std::uint64_t next = 0;; ++next) {
        std::pair<Chunk, Encoded> item;
        {
          std::unique_lock lock(mutex_);
          done_ready_.wait(
              lock, [&] { return finished_.count(next) > 0 || (reading_done_ && next == chunks_read_) || error_; });
          if (error_ || finished_.count(next) == 0) return;
          auto node = finished_.extract(next);
          item = std::move(node.mapped());
        }
        if (item.second.error) std::rethrow_exception(item.second.error);
        append(item.first, item.second);
        {
          std::lock_guard lock(mutex_);
          --in_flight_;
        }
        space_ready_.notify_one();
      }
    } catch (...) {
      fail(std::current_exception());
    }
  }

  void begin_document() {
    const bool to_val =
        val_ != nullptr && options_.val_every > 0 && documents_ % options_.val_every == options_.val_every - 1;
    ++documents_;
    current_ = to_val ? val_ : train_;
    if (current_->documents++ > 0 && !options_.separator.empty()) {
      current_->append(options_.separator.data(), options_.separator.size());
    }
  }

  void append(const Chunk& chunk, const Encoded& encoded) {
    InputStats& stats = (*stats_)[chunk.input];
    if (options_.kind == InputKind::plain_text) {
      if (chunk.starts_input) {
        begin_document();
        ++stats.documents;
      }
      current_->append(encoded.ids.data(), encoded.ids.size());
    } else {
      std::size_t begin = 0;
      for (const std::size_t end : encoded.document_ends) {
        begin_document();
        current_->append(encoded.ids.data() + begin, end - begin);
        begin = end;
      }
      stats.documents += encoded.document_ends.size();
    }
    stats.bytes += chunk.bytes.size();
    stats.tokens += encoded.ids.size();
    bytes_written_ += chunk.bytes.size();
    if (chunk.ends_input) {
      const Input& input = options_.inputs[chunk.input];
      progress_->clear();
      if (options_.kind == InputKind::plain_text) {
        std::printf("%s: %llu bytes -> %llu tokens\n", input.path.c_str(), static_cast<unsigned long long>(stats.bytes),
                    static_cast<unsigned long long>(stats.tokens));
      } else {
        std::printf("%s: %llu bytes, %llu documents -> %llu tokens\n", input.path.c_str(),
                    static_cast<unsigned long long>(stats.bytes), static_cast<unsigned long long>(stats.documents),
                    static_cast<unsigned long long>(stats.tokens));
      }
      std::fflush(stdout);
    }
    progress_->update(bytes_written_);
  }

  const Options& options_;
  const text::Tokenizer& prototype_;
  const std::size_t max_in_flight_;
  std::optional<Progress> progress_;
  std::vector<std::thread> workers_;

  std::mutex mutex_;
  std::condition_variable work_ready_, done_ready_, space_ready_;
  std::deque<Chunk> pending_;
  std::map<std::uint64_t, std::pair<Chunk, Encoded>> finished_;
  std::uint64_t chunks_read_ = 0;
  std::size_t in_flight_ = 0;  // read, not yet written
  bool reading_done_ = false;
  std::exception_ptr error_;

  // Writer thread only.
  ShardStream* train_ = nullptr;
  ShardStream* val_ = nullptr;
  ShardStream* current_ = nullptr;
  std::vector<InputStats>* stats_ = nullptr;
  std::uint64_t documents_ = 0;
  std::uint64_t bytes_written_ = 0;
};

const char* dtype_name(text::TokenDtype dtype) { return dtype == text::TokenDtype::u16 ? "u16" : "u32"; }

std::string ids_text(const std::vector<std::uint32_t>& ids) {
  std::string out = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out + "]";
}

}  // namespace

int main(int argc, char** argv) {
  const core::ClosedStreams closed = core::guard_standard_streams();
  CLI::App app{"text corpora -> token shards (train and validation); docs/data.md has examples"};
  app.footer(
      "Documents: each plain-text INPUT is one document; with --jsonl-field KEY each non-blank line of\n"
      "every INPUT is a JSON object and the string under KEY is one document. '-' reads standard input\n"
      "(e.g. `zcat corpus.jsonl.gz | make_shards - ...`). Documents keep the input order; consecutive\n"
      "documents of a shard are separated by the separator ids.\n\n"
      "Validation split (both deterministic, independent of --threads):\n"
      "  --val-every K     documents K, 2K, 3K, ... (counting from 1: document index i, from 0, goes to\n"
      "                    validation when i % K == K - 1), decided while streaming\n"
      "  --val-fraction F  the last round(F * N) of all N tokens (the tail is moved out of the training\n"
      "                    file at the end)");
  std::vector<std::string> input_paths;
  Options options;
  std::string separator_text;
  std::int64_t separator_id = -1;
  std::size_t chunk_kib = 2048;
  unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  app.add_option("inputs", input_paths, "text or JSONL files (or '-' for standard input), read in order")->required();
  app.add_option("--tokenizer", options.tokenizer_spec, "'byte' or the path of a Hugging Face tokenizer.json")
      ->default_val("byte");
  app.add_option("--train-out", options.train_out, "training shard to write")->required();
  app.add_option("--val-out", options.val_out, "validation shard to write (needed with --val-fraction or --val-every)");
  auto* fraction = app.add_option("--val-fraction", options.val_fraction,
                                  "fraction of the tokens, taken from the end, for validation");
  auto* every = app.add_option("--val-every", options.val_every, "every K-th document goes to validation");
  fraction->excludes(every);
  app.add_option("--jsonl-field", options.jsonl_field, "inputs are JSONL; the document is the string under this key");
  auto* text_option = app.add_option("--separator", separator_text,
                                     "text whose ids go between documents (default: '<|endoftext|>' for a BPE "
                                     "tokenizer that has it, none for 'byte'; '' for none)");
  auto* id_option = app.add_option("--separator-id", separator_id, "one id to put between documents instead");
  text_option->excludes(id_option);
  auto* threads_option = app.add_option("--threads", threads, "encoding threads (default: all cores)");
  app.add_option("--chunk-kib", chunk_kib, "bytes of input per work item, in KiB (tuning and tests)")
      ->capture_default_str();
  app.add_flag("--progress", options.progress, "progress bar on stderr even when it is not a terminal");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;  // usage errors exit 2, as in the other tools
  }

  try {
    // NaN passes any range comparison, so it is named first.
    if (fraction->count() > 0 && !(options.val_fraction >= 0.0 && options.val_fraction <= 1.0)) {
      throw core::InputError("--val-fraction: expected a number in [0, 1], got " + fraction->as<std::string>());
    }
    if (every->count() > 0 && options.val_every < 1)
      throw core::InputError("--val-every: expected a whole number >= 1, got 0");
    if (id_option->count() > 0 && separator_id < 0) {
      throw core::InputError("--separator-id: expected an id >= 0, got " + std::to_string(separator_id));
    }
    // Each thread holds a tokenizer and chunks in flight: thousands would only exhaust memory.
    if (threads_option->count() > 0 && (threads < 1 || threads > 1024)) {
      throw core::InputError("--threads: expected a whole number in [1, 1024], got " + std::to_string(threads));
    }
    if (chunk_kib < 1 || chunk_kib > (std::size_t{1} << 20)) {
      throw core::InputError("--chunk-kib: expected a whole number in [1, 1048576] (1 GiB), got " +
                             std::to_string(chunk_kib));
    }
    if (app.get_option("--jsonl-field")->count() > 0 && options.jsonl_field.empty()) {
      throw core::InputError("--jsonl-field: expected a key name, got ''");
    }
    if (std::count(input_paths.begin(), input_paths.end(), "-") > 0 && closed.in) {
      throw core::InputError("'-' reads standard input, which is closed");
    }
    if ((options.val_fraction > 0.0 || options.val_every > 0) && options.val_out.empty()) {
      throw core::InputError("--val-fraction and --val-every need --val-out");
    }
    for (const std::string& path : input_paths) options.inputs.push_back(check_input(path));
    if (std::count(input_paths.begin(), input_paths.end(), "-") > 1) throw core::InputError("'-' given twice");
    check_outputs(input_paths, options.train_out, options.val_out);
    options.kind = options.jsonl_field.empty() ? InputKind::plain_text : InputKind::jsonl;
    options.cuts = options.kind == InputKind::jsonl   ? Cuts::lines
                   : options.tokenizer_spec == "byte" ? Cuts::anywhere
                                                      : Cuts::plain_text;
    options.threads = threads;
    options.chunk_bytes = chunk_kib * 1024;
    options.progress = options.progress || ::isatty(STDERR_FILENO) != 0;

    const auto start = Clock::now();
    auto tokenizer = text::make_tokenizer(options.tokenizer_spec);
    if (auto* bpe = dynamic_cast<text::BpeTokenizer*>(tokenizer.get())) {
      if (text_option->count() == 0 && id_option->count() == 0) {
        if (const std::int64_t id = bpe->added_token_id("<|endoftext|>"); id >= 0) {
          options.separator = {static_cast<std::uint32_t>(id)};
        }
      }
      if (options.kind == InputKind::plain_text && added_token_spans_line_break(options.tokenizer_spec)) {
        options.cuts = Cuts::none;
        std::fprintf(stderr,
                     "make_shards: an added token of %s contains a line break: each plain-text document is "
                     "encoded whole by one thread\n",
                     options.tokenizer_spec.c_str());
      } else if (options.kind == InputKind::plain_text && added_token_spans_line_cut(options.tokenizer_spec)) {
        options.cuts = Cuts::plain_text_lines;
      }
    }
    if (text_option->count() > 0) options.separator = tokenizer->encode(separator_text);
    if (id_option->count() > 0) {
      if (static_cast<std::uint64_t>(separator_id) >= tokenizer->vocab_size()) {
        throw core::InputError("--separator-id " + std::to_string(separator_id) + " is outside the vocabulary of " +
                               std::to_string(tokenizer->vocab_size()) + " ids");
      }
      options.separator = {static_cast<std::uint32_t>(separator_id)};
    }
    const std::string tokenizer_name = tokenizer->name();
    const std::uint32_t vocab_size = tokenizer->vocab_size();
    const text::TokenDtype dtype = text::smallest_token_dtype(vocab_size);

    ShardStream train(options.train_out, dtype);
    std::optional<ShardStream> val;
    if (!options.val_out.empty()) val.emplace(options.val_out, dtype);
    std::vector<InputStats> stats(options.inputs.size());
    Pipeline pipeline(options, *tokenizer);
    pipeline.run(train, options.val_every > 0 ? &*val : nullptr, stats);

    std::uint64_t bytes = 0, documents = 0;
    for (const InputStats& s : stats) {
      bytes += s.bytes;
      documents += s.documents;
    }
    const std::uint64_t all = train.count() + (val ? val->count() : 0);
    if (options.val_fraction > 0.0) {
      const auto tail = static_cast<std::uint64_t>(std::llround(options.val_fraction * static_cast<double>(all)));
      train.move_tail(tail, *val);
    }
    const double seconds = seconds_since(start);
    std::printf("tokenizer %s (vocab %u), %llu bytes -> %llu tokens (%.3f bytes/token), dtype %s\n",
                tokenizer_name.c_str(), vocab_size, static_cast<unsigned long long>(bytes),
                static_cast<unsigned long long>(all),
                all == 0 ? 0.0 : static_cast<double>(bytes) / static_cast<double>(all), dtype_name(dtype));
    std::printf("%llu documents, separator %s, %u threads, %.2f s (%.1f MB/s)\n",
                static_cast<unsigned long long>(documents), ids_text(options.separator).c_str(), options.threads,
                seconds, seconds > 0 ? static_cast<double>(bytes) / seconds / 1e6 : 0.0);
    train.finish();
    std::printf("train: %llu tokens -> %s\n", static_cast<unsigned long long>(train.count()),
                options.train_out.c_str());
    if (val) {
      val->finish();
      std::printf("val:   %llu tokens -> %s\n", static_cast<unsigned long long>(val->count()), options.val_out.c_str());
    }
    core::finish_standard_output();
  } catch (const core::InputError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "make_shards: %s\n", e.what());
    return 2;
  } catch (const core::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "make_shards: %s\n", e.what());
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "make_shards: %s\n", e.what());
    return 1;
  }
  return 0;
}
