// TensorBoard event files without TensorFlow or a protobuf library: TensorBoardWriter encodes the
// Event / Summary messages by hand and frames them as TFRecords (u64 length, masked CRC32C of the
// length, data, masked CRC32C of the data). Scalars are Summary values with `simple_value`, text
// samples tensor summaries of the "text" plugin (a scalar string tensor, shown on the Text
// dashboard and rendered as Markdown). read_tensorboard_events parses such a file back, checking
// both checksums of every record; tests use it on our files and on files of the tensorboard package.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace trainer {

// Seconds since the Unix epoch, as event files store them.
double unix_time_now();

// One event file, written in the order of the calls. Steps are the caller's: the writer neither
// invents nor reorders them. Not thread-safe.
class TensorBoardWriter {
 public:
  // Creates `directory` (and its parents) and a new file in it,
  // events.out.tfevents.<unix seconds, 10 digits>.<host>.<pid>.<n> (n counts the files this process
  // opened; an existing name is never reused). Its first records are the file version
  // "brain.Event:2" and a SessionLog START at `first_step`, the first step the run will log (1 for a
  // new run, the checkpoint's step + 1 on resume): TensorBoard then drops the points that earlier
  // files of the folder hold at steps >= `first_step` (logged after that checkpoint by a run that
  // died), so a resumed run's curves have no repeated steps. Throws core::Error naming the path
  // when the file cannot be created.
  TensorBoardWriter(const std::filesystem::path& directory, std::int64_t first_step);
  ~TensorBoardWriter();  // flushes and closes (errors ignored: call flush() to see them)
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // A scalar point of the `tag` curve (stored as float32, the Scalars dashboard's precision).
  void add_scalar(std::string_view tag, std::int64_t step, double value, double wall_time = unix_time_now());
  // A text sample under `tag` (UTF-8; the Text dashboard renders it as Markdown).
  void add_text(std::string_view tag, std::int64_t step, std::string_view text, double wall_time = unix_time_now());
  // Hands the buffered records to the operating system; throws core::Error when a write failed.
  void flush();

  const std::filesystem::path& path() const { return path_; }

 private:
  void write_record(const std::string& event);

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  int error_ = 0;  // errno of the first failed write
};

// A Summary.Value as read back: its tag, plugin name and payload.
struct TensorBoardValue {
  std::string tag;
  std::string plugin;                       // metadata.plugin_data.plugin_name, "" when absent
  std::optional<float> simple_value;        // set for simple_value scalars
  int tensor_dtype = 0;                     // TensorProto dtype (1 float, 2 double, 7 string); 0: no tensor
  std::vector<double> tensor_numbers;       // float_val, double_val or tensor_content of float / double tensors
  std::vector<std::string> tensor_strings;  // string_val
};

// An Event as read back; fields a record does not have keep their defaults.
struct TensorBoardEvent {
  double wall_time = 0;
  std::int64_t step = 0;
  std::string file_version;  // "brain.Event:2" in a file's first record
  int session_status = 0;    // SessionLog status (1 START, 2 STOP, 3 CHECKPOINT); 0 without one
  std::vector<TensorBoardValue> values;
};

// Every record of the event file at `path`, in file order. Throws core::InputError naming the file
// and the record's byte offset for a truncated record, a length or data checksum mismatch, or a
// malformed message.
std::vector<TensorBoardEvent> read_tensorboard_events(const std::filesystem::path& path);

}  // namespace trainer
