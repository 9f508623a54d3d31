// TensorBoard event files: hand-encoded protobuf messages (field numbers of TensorFlow's event.proto,
// summary.proto, tensor.proto) in TFRecord framing, and the reader that checks them.
#include "trainer/tensorboard.h"

#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>

#include <fcntl.h>
#include <unistd.h>

#include "core/crc32c.h"
#include "core/error.h"

static_assert(std::endian::native == std::endian::little, "event files are framed in host order");

namespace trainer {
namespace fs = std::filesystem;

namespace {

// Protobuf wire types.
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;
// TensorFlow DataType values.
constexpr int kDtFloat = 1, kDtDouble = 2, kDtString = 7;
constexpr int kSessionStart = 1;

// TFRecord's checksum: the CRC32C rotated right by 15 bits plus a constant.
std::uint32_t masked_crc(const void* data, std::size_t bytes) {
  const std::uint32_t crc = core::crc32c(0, data, bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

void put_varint(std::string& out, std::uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<char>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<char>(value));
}

void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, (static_cast<std::uint64_t>(field) << 3) | static_cast<std::uint64_t>(wire_type));
}

void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

template <typename T>
void put_fixed(std::string& out, int field, T value) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8);
  put_key(out, field, sizeof(T) == 4 ? kFixed32 : kFixed64);
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  out.append(raw, sizeof(T));
}

// Event{wall_time = 1, step = 2} followed by `what` (one field of the `what` oneof, already encoded).
std::string event(double wall_time, std::int64_t step, const std::string& what) {
  std::string out;
  put_fixed(out, 1, wall_time);
  if (step != 0) {
    put_key(out, 2, kVarint);
    put_varint(out, static_cast<std::uint64_t>(step));
  }
  return out + what;
}

// Event.summary (5) holding one Summary.value (1).
std::string summary_of(const std::string& value) {
  std::string summary;
  put_bytes(summary, 1, value);
  std::string what;
  put_bytes(what, 5, summary);
  return what;
}

std::atomic<int> files_opened{0};

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

// --- reading ---

class Reader {
 public:
  Reader(std::string_view bytes, const std::string& where) : p_(bytes), where_(where) {}
  bool done() const { return p_.empty(); }

  std::uint64_t varint() {
    std::uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_.empty()) fail("truncated varint");
      const auto byte = static_cast<unsigned char>(p_.front());
      p_.remove_prefix(1);
      value |= static_cast<std::uint64_t>(byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) return value;
    }
    fail("varint longer than 10 bytes");
  }
  template <typename T>
  T fixed() {
    if (p_.size() < sizeof(T)) fail("truncated fixed-width field");
    T value;
    std::memcpy(&value, p_.data(), sizeof(T));
    p_.remove_prefix(sizeof(T));
    return value;
  }
  std::string_view bytes() {
    const std::uint64_t n = varint();
    if (n > p_.size()) fail("length-delimited field runs past its message");
    const std::string_view out = p_.substr(0, n);
    p_.remove_prefix(n);
    return out;
  }
  void skip(int wire_type) {
    switch (wire_type) {
      case kVarint: varint(); break;
      case kFixed64: fixed<std::uint64_t>(); break;
      case kLengthDelimited: bytes(); break;
      case kFixed32: fixed<std::uint32_t>(); break;
      default: fail("unsupported wire type " + std::to_string(wire_type));
    }
  }
  // The next field's (number, wire type).
  std::pair<int, int> key() {
    const std::uint64_t k = varint();
    return {static_cast<int>(k >> 3), static_cast<int>(k & 7)};
  }
  [[noreturn]] void fail(const std::string& what) const { throw core::InputError(where_ + ": " + what); }
  const std::string& where() const { return where_; }

 private:
  std::string_view p_;
  const std::string& where_;
};

// Repeated float / double: packed (one length-delimited run) or one value per field.
template <typename T>
void read_repeated(Reader& r, int wire_type, std::vector<double>& out) {
  if (wire_type == kLengthDelimited) {
    const std::string_view run = r.bytes();
    if (run.size() % sizeof(T) != 0) r.fail("packed field of " + std::to_string(run.size()) + " bytes");
    for (std::size_t i = 0; i < run.size(); i += sizeof(T)) {
      T v;
      std::memcpy(&v, run.data() + i, sizeof(T));
      out.push_back(v);
    }
  } else {
    out.push_back(r.fixed<T>());
  }
}

// A field's key as one number (what the wire format writes: number << 3 | wire type), for switch.
constexpr std::uint64_t key_of(int field, int wire) { return static_cast<std::uint64_t>(field) << 3 | wire; }

// Calls take(r, field, wire) for each field of the message `bytes`, `r` at the field's value; a
// field it does not take (returns false) is skipped.
template <typename Take>
void for_each_field(std::string_view bytes, const std::string& where, Take take) {
  Reader r(bytes, where);
  while (!r.done()) {
    const auto [field, wire] = r.key();
    if (!take(r, field, wire)) r.skip(wire);
  }
}

void read_tensor(std::string_view bytes, const std::string& where, TensorBoardValue& value) {
  std::string_view content;
  for_each_field(bytes, where, [&](Reader& r, int field, int wire) {
    switch (key_of(field, wire)) {
      case key_of(1, kVarint): value.tensor_dtype = static_cast<int>(r.varint()); return true;
      case key_of(4, kLengthDelimited): content = r.bytes(); return true;
      case key_of(5, kFixed32):
      case key_of(5, kLengthDelimited): read_repeated<float>(r, wire, value.tensor_numbers); return true;
      case key_of(6, kFixed64):
      case key_of(6, kLengthDelimited): read_repeated<double>(r, wire, value.tensor_numbers); return true;
      case key_of(8, kLengthDelimited): value.tensor_strings.emplace_back(r.bytes()); return true;
      default: return false;
    }
  });
  if (!content.empty()) {
    const std::size_t width = value.tensor_dtype == kDtFloat ? 4 : value.tensor_dtype == kDtDouble ? 8 : 0;
    if (width == 0) return;  // other dtypes: not decoded
    if (content.size() % width != 0) {
      Reader(bytes, where).fail("tensor_content of " + std::to_string(content.size()) + " bytes");
    }
    for (std::size_t i = 0; i < content.size(); i += width) {
      if (width == 4) {
        float v;
        std::memcpy(&v, content.data() + i, 4);
        value.tensor_numbers.push_back(v);
      } else {
        double v;
        std::memcpy(&v, content.data() + i, 8);
        value.tensor_numbers.push_back(v);
      }
    }
  }
}

// SummaryMetadata: the plugin's name (PluginData.plugin_name).
std::string read_plugin_name(std::string_view metadata, const std::string& where) {
  std::string name;
  for_each_field(metadata, where, [&](Reader& r, int field, int wire) {
    if (key_of(field, wire) != key_of(1, kLengthDelimited)) return false;
    for_each_field(r.bytes(), where, [&](Reader& plugin, int plugin_field, int plugin_wire) {
      if (key_of(plugin_field, plugin_wire) != key_of(1, kLengthDelimited)) return false;
      name = plugin.bytes();
      return true;
    });
    return true;
  });
  return name;
}

TensorBoardValue read_value(std::string_view bytes, const std::string& where) {
  TensorBoardValue value;
  for_each_field(bytes, where, [&](Reader& r, int field, int wire) {
    switch (key_of(field, wire)) {
      case key_of(1, kLengthDelimited): value.tag = r.bytes(); return true;
      case key_of(2, kFixed32): value.simple_value = r.fixed<float>(); return true;
      case key_of(8, kLengthDelimited): read_tensor(r.bytes(), where, value); return true;
      case key_of(9, kLengthDelimited): value.plugin = read_plugin_name(r.bytes(), where); return true;
      default: return false;
    }
  });
  return value;
}

TensorBoardEvent read_event(std::string_view bytes, const std::string& where) {
  TensorBoardEvent event;
  for_each_field(bytes, where, [&](Reader& r, int field, int wire) {
    switch (key_of(field, wire)) {
      case key_of(1, kFixed64): event.wall_time = r.fixed<double>(); return true;
      case key_of(2, kVarint): event.step = static_cast<std::int64_t>(r.varint()); return true;
      case key_of(3, kLengthDelimited): event.file_version = r.bytes(); return true;
      case key_of(5, kLengthDelimited):  // Summary: its values
        for_each_field(r.bytes(), where, [&](Reader& summary, int summary_field, int summary_wire) {
          if (key_of(summary_field, summary_wire) != key_of(1, kLengthDelimited)) return false;
          event.values.push_back(read_value(summary.bytes(), where));
          return true;
        });
        return true;
      case key_of(7, kLengthDelimited):  // LogMessage: the session status
        for_each_field(r.bytes(), where, [&](Reader& log, int log_field, int log_wire) {
          if (key_of(log_field, log_wire) != key_of(1, kVarint)) return false;
          event.session_status = static_cast<int>(log.varint());
          return true;
        });
        return true;
      default: return false;
    }
  });
  return event;
}

}  // namespace

double unix_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

TensorBoardWriter::TensorBoardWriter(const fs::path& directory, std::int64_t first_step) {
  std::error_code ec;
  fs::create_directories(directory, ec);
  if (ec) throw core::Error("cannot create the TensorBoard folder " + directory.string() + ": " + ec.message());
  const double now = unix_time_now();
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%010lld", static_cast<long long>(now));
  const std::string stem =
      std::string("events.out.tfevents.") + seconds + "." + host_name() + "." + std::to_string(::getpid()) + ".";
  int fd = -1;
  for (int attempt = 0; attempt < 1000 && fd < 0; ++attempt) {
    path_ = directory / (stem + std::to_string(files_opened.fetch_add(1)));
    fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) throw core::Error("cannot create the event file " + path_.string() + ": " + std::strerror(errno));
  file_ = ::fdopen(fd, "wb");
  if (file_ == nullptr) {
    ::close(fd);
    throw core::Error("cannot open the event file " + path_.string() + ": " + std::strerror(errno));
  }
  std::string version;
  put_bytes(version, 3, "brain.Event:2");
  write_record(event(now, 0, version));
  std::string log;
  put_key(log, 1, kVarint);
  put_varint(log, kSessionStart);
  std::string start;
  put_bytes(start, 7, log);
  write_record(event(now, first_step, start));
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void TensorBoardWriter::add_scalar(std::string_view tag, std::int64_t step, double value, double wall_time) {
  std::string v;
  put_bytes(v, 1, tag);
  put_fixed(v, 2, static_cast<float>(value));
  write_record(event(wall_time, step, summary_of(v)));
}

void TensorBoardWriter::add_text(std::string_view tag, std::int64_t step, std::string_view text, double wall_time) {
  std::string plugin;
  put_bytes(plugin, 1, "text");
  std::string metadata;
  put_bytes(metadata, 1, plugin);
  std::string tensor;  // dtype string, shape [] (present and empty), one string value
  put_key(tensor, 1, kVarint);
  put_varint(tensor, kDtString);
  put_bytes(tensor, 2, "");
  put_bytes(tensor, 8, text);
  std::string v;
  put_bytes(v, 1, tag);
  put_bytes(v, 9, metadata);
  put_bytes(v, 8, tensor);
  write_record(event(wall_time, step, summary_of(v)));
}

void TensorBoardWriter::write_record(const std::string& event) {
  char header[12];
  const std::uint64_t length = event.size();
  std::memcpy(header, &length, 8);
  const std::uint32_t length_crc = masked_crc(header, 8);
  std::memcpy(header + 8, &length_crc, 4);
  const std::uint32_t data_crc = masked_crc(event.data(), event.size());
  if (std::fwrite(header, 1, sizeof header, file_) != sizeof header ||
      std::fwrite(event.data(), 1, event.size(), file_) != event.size() || std::fwrite(&data_crc, 1, 4, file_) != 4) {
    if (error_ == 0) error_ = errno != 0 ? errno : EIO;
  }
}

void TensorBoardWriter::flush() {
  if (std::fflush(file_) != 0 && error_ == 0) error_ = errno != 0 ? errno : EIO;
  if (error_ != 0) throw core::Error("writing the event file " + path_.string() + " failed: " + std::strerror(error_));
}

std::vector<TensorBoardEvent> read_tensorboard_events(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw core::InputError("cannot open the event file " + path.string());
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<TensorBoardEvent> events;
  std::size_t offset = 0;
  while (offset < bytes.size()) {
    const std::string where = path.string() + ": record at byte " + std::to_string(offset);
    if (bytes.size() - offset < 12) throw core::InputError(where + ": truncated header");
    std::uint64_t length;
    std::uint32_t length_crc;
    std::memcpy(&length, bytes.data() + offset, 8);
    std::memcpy(&length_crc, bytes.data() + offset + 8, 4);
    if (masked_crc(bytes.data() + offset, 8) != length_crc)
      throw core::InputError(where + ": length checksum mismatch");
    if (length > bytes.size() - offset - 12 || bytes.size() - offset - 12 - length < 4) {
      throw core::InputError(where + ": truncated (" + std::to_string(length) + "-byte record)");
    }
    const std::string_view data(bytes.data() + offset + 12, length);
    std::uint32_t data_crc;
    std::memcpy(&data_crc, bytes.data() + offset + 12 + length, 4);
    if (masked_crc(data.data(), data.size()) != data_crc) throw core::InputError(where + ": data checksum mismatch");
    events.push_back(read_event(data, where));
    offset += 12 + length + 4;
  }
  return events;
}

}  // namespace trainer
