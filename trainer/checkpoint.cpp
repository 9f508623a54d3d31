// Checkpoint writing, verification and restoring (see checkpoint.h and docs/formats.md).
#include "trainer/checkpoint.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"
#include "comm/single_rank.h"
#include "models/model_config.h"
#include "models/registry.h"

namespace trainer {

namespace fs = std::filesystem;
using nlohmann::json;

static_assert(std::endian::native == std::endian::little, "checkpoint files are written in host order");

namespace {

constexpr char kFormat[] = "llmtrain-checkpoint";
constexpr int kFormatVersion = 2;
constexpr char kManifestName[] = "manifest.json";
constexpr char kDoneName[] = "DONE";
constexpr char kFileMagic[8] = {'L', 'L', 'M', 'C', 'K', 'P', 'T', '1'};
constexpr std::uint32_t kFileVersion = 1;
constexpr std::size_t kFileHeaderBytes = 64;
constexpr std::size_t kStagingChunkBytes = std::size_t{32} << 20;

// The 64-byte header in front of every buffer file; all fields little-endian.
struct FileHeader {
  std::uint32_t element_bytes = 0;  // bytes per element of the buffer's dtype
  std::int64_t range_begin = 0;     // global element range of the slab this file belongs to
  std::int64_t range_end = 0;
  std::uint64_t payload_bytes = 0;  // bytes after the header
  std::uint32_t elementwise = 0;    // 1: element i of the payload is global element range_begin + i

  std::array<unsigned char, kFileHeaderBytes> encode() const {
    std::array<unsigned char, kFileHeaderBytes> out{};
    std::memcpy(out.data(), kFileMagic, 8);
    std::memcpy(out.data() + 8, &kFileVersion, 4);
    std::memcpy(out.data() + 12, &element_bytes, 4);
    std::memcpy(out.data() + 16, &range_begin, 8);
    std::memcpy(out.data() + 24, &range_end, 8);
    std::memcpy(out.data() + 32, &payload_bytes, 8);
    std::memcpy(out.data() + 40, &elementwise, 4);
    return out;
  }
};

std::string errno_text() { return std::strerror(errno); }

// Test hook for the fault tests (tests/trainer/run_fault_campaign.sh): with
// LLMTRAIN_TEST_KILL_IN_CHECKPOINT=R:S rank R kills itself (SIGKILL) once it has written its files
// of the checkpoint of step S, before the manifest and DONE exist, as a crash during a save would.
void kill_if_test_asks(int rank, std::int64_t step) {
  const char* spec = std::getenv("LLMTRAIN_TEST_KILL_IN_CHECKPOINT");
  int kill_rank = -1;
  long long kill_step = -1;
  if (spec == nullptr || std::sscanf(spec, "%d:%lld", &kill_rank, &kill_step) != 2) return;
  if (kill_rank != rank || kill_step != step) return;
  spdlog::warn("LLMTRAIN_TEST_KILL_IN_CHECKPOINT: rank {} kills itself in the checkpoint of step {}", rank, step);
  spdlog::default_logger()->flush();
  ::kill(::getpid(), SIGKILL);
}

std::string hex32(std::uint32_t value) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", value);
  return buf;
}

// A file written with plain POSIX calls and fsynced before it is closed; the CRC32C of every byte
// written is kept.
class SyncedFile {
 public:
  explicit SyncedFile(fs::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw core::Error("cannot create " + path_.string() + ": " + errno_text());
  }
  ~SyncedFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  SyncedFile(const SyncedFile&) = delete;
  SyncedFile& operator=(const SyncedFile&) = delete;

  void write(const void* data, std::size_t bytes) {
    crc_ = crc32c(crc_, data, bytes);
    written_ += bytes;
    const auto* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::write(fd_, p, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw core::Error("cannot write " + path_.string() + ": " + errno_text());
      p += n;
      bytes -= static_cast<std::size_t>(n);
    }
  }
  void finish() {
    if (::fsync(fd_) != 0) throw core::Error("cannot fsync " + path_.string() + ": " + errno_text());
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw core::Error("cannot close " + path_.string() + ": " + errno_text());
  }
  std::uint32_t crc() const { return crc_; }
  std::uint64_t written() const { return written_; }

 private:
  fs::path path_;
  int fd_ = -1;
  std::uint32_t crc_ = 0;
  std::uint64_t written_ = 0;
};

void fsync_directory(const fs::path& directory) {
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw core::Error("cannot open directory " + directory.string() + ": " + errno_text());
  const int status = ::fsync(fd);
  ::close(fd);
  if (status != 0) throw core::Error("cannot fsync directory " + directory.string() + ": " + errno_text());
}

void write_text_file(const fs::path& path, const std::string& text) {
  SyncedFile file(path);
  file.write(text.data(), text.size());
  file.finish();
}

std::string read_text_file(const fs::path& path) {
  std::string out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw core::InputError(path.string() + ": cannot open (" + errno_text() + ")");
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      throw core::InputError(path.string() + ": cannot read (" + errno_text() + ")");
    }
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

// Reads `bytes` at `offset` of an open file; throws core::InputError naming `path` on a short read.
void read_exact(int fd, const fs::path& path, std::uint64_t offset, void* out, std::size_t bytes) {
  auto* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw core::InputError(path.string() + ": cannot read (" + errno_text() + ")");
    if (n == 0)
      throw core::InputError(path.string() + ": truncated (ends before byte " + std::to_string(offset + bytes) + ")");
    p += n;
    offset += static_cast<std::uint64_t>(n);
    bytes -= static_cast<std::size_t>(n);
  }
}

// Two pinned host chunks and their events: device buffers go to and from files through them.
class PinnedStaging {
 public:
  explicit PinnedStaging(const core::DeviceContext& context) : context_(context) {
    if (!context.is_cuda()) return;
    for (int i = 0; i < 2; ++i) {
      chunks_[i] = core::Buffer(core::Device::cpu(), kStagingChunkBytes, /*pinned=*/true);
      CUDA_CHECK(cudaEventCreateWithFlags(&ready_[i], cudaEventDisableTiming));
    }
  }
  ~PinnedStaging() {
    for (cudaEvent_t e : ready_) {
      if (e) (void)cudaEventDestroy(e);
    }
  }
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  // Appends `bytes` of `source` (device memory on cuda) to `file`: the copy of the next chunk
  // overlaps the write of the current one.
  void write(SyncedFile& file, const void* source, std::size_t bytes) {
    if (!context_.is_cuda()) {
      file.write(source, bytes);
      return;
    }
    const auto* src = static_cast<const char*>(source);
    const std::size_t chunks = (bytes + kStagingChunkBytes - 1) / kStagingChunkBytes;
    auto enqueue = [&](std::size_t i) {
      const std::size_t n = std::min(kStagingChunkBytes, bytes - i * kStagingChunkBytes);
      core::copy_bytes(chunks_[i % 2].data(), src + i * kStagingChunkBytes, n, context_.stream());
      CUDA_CHECK(cudaEventRecord(ready_[i % 2], context_.stream()));
    };
    if (chunks > 0) enqueue(0);
    for (std::size_t i = 0; i < chunks; ++i) {
      if (i + 1 < chunks) enqueue(i + 1);
      CUDA_CHECK(cudaEventSynchronize(ready_[i % 2]));
      file.write(chunks_[i % 2].data(), std::min(kStagingChunkBytes, bytes - i * kStagingChunkBytes));
    }
  }

  // Reads `bytes` at `offset` of the open file into `destination` (device memory on cuda).
  void read(int fd, const fs::path& path, std::uint64_t offset, void* destination, std::size_t bytes) {
    if (!context_.is_cuda()) {
      read_exact(fd, path, offset, destination, bytes);
      return;
    }
    auto* dst = static_cast<char*>(destination);
    for (std::size_t done = 0; done < bytes; done += kStagingChunkBytes) {
      const std::size_t n = std::min(kStagingChunkBytes, bytes - done);
      read_exact(fd, path, offset + done, chunks_[0].data(), n);
      core::copy_bytes(dst + done, chunks_[0].data(), n, context_.stream());
      context_.synchronize();
    }
  }

 private:
  const core::DeviceContext& context_;
  core::Buffer chunks_[2];
  cudaEvent_t ready_[2] = {nullptr, nullptr};
};

// One buffer of the slab or the optimizer as a checkpoint file: the entries of `pieces` (in
// this rank's buffer) that this rank writes.
struct BufferToSave {
  std::string name;  // "master" or the optimizer's state buffer name
  std::string kind;  // master | optimizer_state
  core::DType dtype;
  const core::Buffer* buffer;
  std::vector<optim::StatePiece> pieces;
  std::int64_t elements_per_entry = 1;
};

// The pieces of `state` (or the per-element default over `owned`) that the rank whose shard is
// `shard` writes: element pieces cut to the shard, whole pieces by the shard holding their start.
// Ranks that hold the same state (ZeRO-0 replicas, a tensor's Adafactor statistics on every rank
// that owns part of it) thereby write it exactly once between them.
std::vector<optim::StatePiece> pieces_to_write(const std::vector<optim::StatePiece>& pieces, std::int64_t per_entry,
                                               optim::Range shard) {
  std::vector<optim::StatePiece> out;
  for (const optim::StatePiece& p : pieces) {
    if (p.whole) {
      if (p.global.begin >= shard.begin && p.global.begin < shard.end) out.push_back(p);
      continue;
    }
    const optim::Range cut = p.global.intersect(shard);
    if (cut.empty()) continue;
    out.push_back({cut, p.entry_offset + (cut.begin - p.global.begin) / per_entry, cut.size() / per_entry, false});
  }
  return out;
}

std::vector<optim::StatePiece> default_pieces(optim::Range owned, std::int64_t per_entry) {
  return {{owned, 0, owned.size() / per_entry, false}};
}

json write_buffer_file(const fs::path& directory, const BufferToSave& b, optim::Range shard, int rank,
                       PinnedStaging& staging) {
  const std::string file_name =
      (b.kind == "master" ? std::string("master") : "state." + b.name) + ".rank" + std::to_string(rank) + ".bin";
  const std::size_t entry_bytes = core::dtype_size(b.dtype);
  FileHeader header;
  header.element_bytes = static_cast<std::uint32_t>(entry_bytes);
  header.range_begin = shard.begin;
  header.range_end = shard.end;
  json pieces = json::array();
  std::uint64_t payload_entries = 0;
  for (const optim::StatePiece& p : b.pieces) {
    pieces.push_back({p.global.begin, p.global.end, payload_entries, p.entries, p.whole});
    payload_entries += static_cast<std::uint64_t>(p.entries);
  }
  header.payload_bytes = payload_entries * entry_bytes;
  header.elementwise =
      b.elements_per_entry == 1 && b.pieces.size() == 1 && !b.pieces[0].whole && b.pieces[0].global == shard;
  SyncedFile file(directory / file_name);
  const auto encoded = header.encode();
  file.write(encoded.data(), encoded.size());
  for (const optim::StatePiece& p : b.pieces) {
    staging.write(file,
                  static_cast<const char*>(b.buffer->data()) + static_cast<std::size_t>(p.entry_offset) * entry_bytes,
                  static_cast<std::size_t>(p.entries) * entry_bytes);
  }
  file.finish();
  return {{"buffer", b.name},
          {"kind", b.kind},
          {"path", file_name},
          {"dtype", std::string(core::dtype_name(b.dtype))},
          {"range", {shard.begin, shard.end}},
          {"elements_per_entry", b.elements_per_entry},
          {"pieces", pieces},
          {"elementwise", header.elementwise == 1},
          {"payload_bytes", header.payload_bytes},
          {"file_bytes", file.written()},
          {"crc32c", hex32(file.crc())}};
}

json layout_json(const optim::SlabLayout& layout) {
  json tensors = json::array();
  for (const optim::SlabTensor& t : layout.tensors()) {
    tensors.push_back({{"name", t.spec.name}, {"shape", t.spec.shape}, {"offset", t.offset}, {"numel", t.numel}});
  }
  // The logical tensors the optimizer state is laid out by (parts of fused tensors separate).
  json parameters = json::array();
  for (const optim::SlabTensor& t : layout.parameters()) {
    parameters.push_back({{"name", t.spec.name}, {"offset", t.offset}, {"numel", t.numel}});
  }
  return {{"world_size", layout.world_size()},
          {"used_elements", layout.used_elements()},
          {"total_elements", layout.total_elements()},
          {"tensors", tensors},
          {"parameters", parameters}};
}

json optimizer_json(const optim::OptimizerConfig& c) {
  json j = {{"type", c.type},
            {"lr", c.lr},
            {"beta1", c.beta1},
            {"beta2", c.beta2},
            {"eps", c.eps},
            {"weight_decay", c.weight_decay},
            {"grad_clip", c.grad_clip},
            {"nonfinite", optim::nonfinite_policy_name(c.nonfinite)}};
  if (c.type == "adamw8bit") {
    j["adamw8bit"] = {
        {"min_8bit_size", c.adamw8bit.min_8bit_size},
        {"quantization", c.adamw8bit.quantization == optim::Quantization::linear ? "linear" : "companded"}};
  }
  if (c.type == "adafactor") {
    const optim::AdafactorConfig& a = c.adafactor;
    j["adafactor"] = {{"eps1", a.eps1},
                      {"eps2", a.eps2},
                      {"clip_threshold", a.clip_threshold},
                      {"decay_rate", a.decay_rate},
                      {"beta1", a.beta1 ? json(*a.beta1) : json(nullptr)},
                      {"relative_step", a.relative_step},
                      {"scale_parameter", a.scale_parameter},
                      {"warmup_init", a.warmup_init},
                      {"eps1_mode", a.eps1_mode == optim::Eps1Mode::add ? "add" : "clamp"},
                      {"decay_scale", a.decay_scale == optim::DecayScale::lr ? "lr" : "alpha"}};
  }
  if (c.type == "muon") {
    const optim::MuonConfig& m = c.muon;
    j["muon"] = {{"lr", m.lr},
                 {"momentum", m.momentum},
                 {"nesterov", m.nesterov},
                 {"ns_steps", m.ns_steps},
                 {"eps", m.eps},
                 {"weight_decay", m.weight_decay ? json(*m.weight_decay) : json(nullptr)},
                 {"adjust_lr", m.adjust_lr == optim::MuonAdjustLr::original ? "original" : "match_rms_adamw"}};
  }
  return j;
}

// An integer field of a manifest as T. Anything else, a float included (converting one outside
// T's range is undefined), throws json::type_error, which callers report as a malformed manifest.
template <typename T>
T integer(const json& value) {
  if (value.is_number_unsigned()) {
    const auto v = value.get<std::uint64_t>();
    if (std::cmp_less_equal(v, std::numeric_limits<T>::max())) return static_cast<T>(v);
  } else if (value.is_number_integer()) {
    const auto v = value.get<std::int64_t>();
    if (std::in_range<T>(v)) return static_cast<T>(v);
  }
  throw json::type_error::create(302, "expected an integer in the range of its field, got " + value.dump(), &value);
}

// Steps beyond this are refused (a run of a million steps per second would need 30 years).
constexpr std::int64_t kMaxStep = 1'000'000'000'000'000;

// Step of a directory named step_NNNNNNNN (at least 8 digits), else -1.
std::int64_t step_of(const fs::path& directory) {
  const std::string name = directory.filename().string();
  if (name.size() < 13 || name.size() > 23 || name.compare(0, 5, "step_") != 0) return -1;  // <= 18 digits: no overflow
  std::int64_t step = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

// The directories of saves that never finished under `root` (step_NNNNNNNN.tmp), newest first.
std::vector<fs::path> unfinished_writes(const fs::path& root) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 4 && name.ends_with(".tmp") &&
        step_of(entry.path().parent_path() / name.substr(0, name.size() - 4)) >= 0 && entry.is_directory(ec)) {
      out.push_back(entry.path());
    }
  }
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}

// Checkpoint directories under `root`, newest first.
std::vector<fs::path> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<std::int64_t, fs::path>> found;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return {};
  for (const fs::directory_entry& entry : fs::directory_iterator(root)) {
    const std::int64_t step = step_of(entry.path());
    if (step >= 0 && entry.is_directory()) found.emplace_back(step, entry.path());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<fs::path> out;
  for (auto& [step, path] : found) out.push_back(std::move(path));
  return out;
}

void check_layout(const fs::path& manifest_path, const json& saved, const optim::SlabLayout& layout) {
  const json& tensors = saved.at("tensors");
  const auto mismatch = [&](const std::string& what) {
    throw core::InputError(manifest_path.string() + ": the checkpoint is of another model: " + what);
  };
  if (tensors.size() != layout.tensors().size()) {
    mismatch(std::to_string(tensors.size()) + " tensors in the checkpoint, " + std::to_string(layout.tensors().size()) +
             " in the configured model");
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const optim::SlabTensor& t = layout.tensors()[i];
    const std::string name = tensors[i].at("name").get<std::string>();
    core::Shape shape;
    for (const json& d : tensors[i].at("shape")) shape.push_back(integer<std::int64_t>(d));
    const auto offset = integer<std::int64_t>(tensors[i].at("offset"));
    if (name != t.spec.name || shape != t.spec.shape || offset != t.offset) {
      mismatch("tensor " + std::to_string(i) + " is " + name + " " + core::shape_str(shape) + " at element " +
               std::to_string(offset) + " in the checkpoint but " + t.spec.name + " " + core::shape_str(t.spec.shape) +
               " at element " + std::to_string(t.offset) + " in the configured model");
    }
  }
  if (saved.contains("parameters")) {
    const json& parameters = saved.at("parameters");
    bool same = parameters.size() == layout.parameters().size();
    for (std::size_t i = 0; same && i < parameters.size(); ++i) {
      const optim::SlabTensor& t = layout.parameters()[i];
      same = parameters[i].at("name").get<std::string>() == t.spec.name &&
             integer<std::int64_t>(parameters[i].at("offset")) == t.offset;
    }
    if (!same) mismatch("its optimizer tensors (the parts of fused tensors) differ from the configured model's");
  }
  if (integer<std::int64_t>(saved.at("used_elements")) != layout.used_elements()) {
    mismatch("the slab holds " + saved.at("used_elements").dump() + " elements in the checkpoint, " +
             std::to_string(layout.used_elements()) + " in the configured model");
  }
}

// The file a manifest entry lists: a name inside the step directory, never a path that leads out
// of it ("../x", "/etc/passwd"), which the checksum of a crafted manifest would not stop.
fs::path listed_file(const fs::path& directory, const json& entry) {
  const std::string name = entry.at("path").get<std::string>();
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
    throw core::InputError((directory / kManifestName).string() + ": files: path '" + name +
                           "' is not a file name inside the checkpoint directory");
  }
  return directory / name;
}

// Checks one buffer file against its manifest entry: present, size, and with `contents` its
// header and CRC32C.
void verify_buffer_file(const fs::path& directory, const json& entry, bool contents) {
  const fs::path path = listed_file(directory, entry);
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) throw core::InputError(path.string() + ": missing (listed in manifest.json)");
  const auto expected_bytes = integer<std::uint64_t>(entry.at("file_bytes"));
  const std::uint64_t size = fs::file_size(path);
  if (size != expected_bytes) {
    throw core::InputError(path.string() + ": " + (size < expected_bytes ? "truncated" : "too long") + ": " +
                           std::to_string(size) + " bytes, manifest.json says " + std::to_string(expected_bytes));
  }
  if (!contents) return;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw core::InputError(path.string() + ": cannot open (" + errno_text() + ")");
  std::vector<char> buf(std::size_t{8} << 20);
  std::uint32_t crc = 0;
  std::array<unsigned char, kFileHeaderBytes> header{};
  try {
    read_exact(fd, path, 0, header.data(), std::min<std::uint64_t>(size, kFileHeaderBytes));
    for (std::uint64_t offset = 0; offset < size; offset += buf.size()) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), size - offset));
      read_exact(fd, path, offset, buf.data(), n);
      crc = crc32c(crc, buf.data(), n);
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  if (hex32(crc) != entry.at("crc32c").get<std::string>()) {
    throw core::InputError(path.string() + ": checksum mismatch (crc32c " + hex32(crc) + ", manifest.json says " +
                           entry.at("crc32c").get<std::string>() + "): the file is corrupt");
  }
  const std::array<std::int64_t, 2> range = {integer<std::int64_t>(entry.at("range").at(0)),
                                             integer<std::int64_t>(entry.at("range").at(1))};
  if (std::memcmp(header.data(), kFileMagic, 8) != 0 || std::memcmp(header.data() + 16, &range[0], 8) != 0 ||
      std::memcmp(header.data() + 24, &range[1], 8) != 0) {
    throw core::InputError(path.string() + ": the header does not match its manifest.json entry");
  }
}

core::DType dtype_from_name(const fs::path& manifest_path, const std::string& name) {
  for (core::DType t :
       {core::DType::f32, core::DType::f64, core::DType::bf16, core::DType::f16, core::DType::i8, core::DType::u8,
        core::DType::i32, core::DType::u32, core::DType::i64, core::DType::u64, core::DType::u16}) {
    if (core::dtype_name(t) == name) return t;
  }
  throw core::InputError(manifest_path.string() + ": unknown dtype '" + name + "'");
}

// Fills the entries `needed` of `destination` from the files of `buffer_name`. Element pieces
// take their overlap with every saved piece; whole pieces need a saved piece of the same range.
// Elements at or beyond `saved_total` (the saving run's tail padding) are left as they are (zero).
void gather_pieces(const VerifiedCheckpoint& checkpoint, const std::string& buffer_name, core::Buffer& destination,
                   std::size_t entry_bytes, std::int64_t per_entry, const std::vector<optim::StatePiece>& needed,
                   PinnedStaging& staging) {
  const fs::path manifest_path = checkpoint.directory / kManifestName;
  const auto saved_total = integer<std::int64_t>(checkpoint.manifest.at("layout").at("total_elements"));
  std::vector<std::int64_t> covered(needed.size(), 0);
  for (const json& entry : checkpoint.manifest.at("files")) {
    if (entry.at("buffer") != buffer_name) continue;
    if (integer<std::int64_t>(entry.at("elements_per_entry")) != per_entry) {
      throw core::InputError(manifest_path.string() + ": '" + buffer_name + "' has " +
                             entry.at("elements_per_entry").dump() + " elements per entry in the checkpoint, " +
                             std::to_string(per_entry) + " in the run");
    }
    const fs::path path = listed_file(checkpoint.directory, entry);
    const std::uint64_t file_bytes =
        std::min<std::uint64_t>(integer<std::uint64_t>(entry.at("file_bytes")), std::uint64_t{1} << 62);
    const auto file_entries =
        static_cast<std::int64_t>((file_bytes - std::min<std::uint64_t>(file_bytes, kFileHeaderBytes)) / entry_bytes);
    int fd = -1;
    try {
      for (const json& saved_piece : entry.at("pieces")) {
        const optim::Range saved{integer<std::int64_t>(saved_piece.at(0)), integer<std::int64_t>(saved_piece.at(1))};
        const auto file_entry = integer<std::int64_t>(saved_piece.at(2));
        const auto saved_entries = integer<std::int64_t>(saved_piece.at(3));
        const bool saved_whole = saved_piece.at(4).get<bool>();
        // Within the slab and within the file (its size verified), so no offset below overflows.
        if (saved.begin < 0 || saved.end < saved.begin || saved.end > saved_total || file_entry < 0 ||
            saved_entries < 0 || saved_entries > file_entries || file_entry > file_entries - saved_entries) {
          throw core::InputError(manifest_path.string() + ": files: " + entry.at("path").get<std::string>() +
                                 ": piece " + saved_piece.dump() + " lies outside the slab or the file");
        }
        for (std::size_t i = 0; i < needed.size(); ++i) {
          const optim::StatePiece& want = needed[i];
          std::int64_t from = 0, to = 0, entries = 0;
          if (want.whole || saved_whole) {
            if (!(want.whole && saved_whole && want.global == saved && want.entries == saved_entries) ||
                covered[i] > 0) {
              continue;
            }
            from = file_entry;
            to = want.entry_offset;
            entries = want.entries;
            covered[i] = want.global.size();
          } else {
            const optim::Range overlap = saved.intersect(want.global);
            if (overlap.empty()) continue;
            from = file_entry + (overlap.begin - saved.begin) / per_entry;
            to = want.entry_offset + (overlap.begin - want.global.begin) / per_entry;
            entries = overlap.size() / per_entry;
            covered[i] += overlap.size();
          }
          if (fd < 0) {
            fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
            if (fd < 0) throw core::InputError(path.string() + ": cannot open (" + errno_text() + ")");
          }
          staging.read(fd, path, kFileHeaderBytes + static_cast<std::uint64_t>(from) * entry_bytes,
                       static_cast<char*>(destination.data()) + static_cast<std::size_t>(to) * entry_bytes,
                       static_cast<std::size_t>(entries) * entry_bytes);
        }
      }
    } catch (...) {
      if (fd >= 0) ::close(fd);
      throw;
    }
    if (fd >= 0) ::close(fd);
  }
  for (std::size_t i = 0; i < needed.size(); ++i) {
    const optim::Range want = needed[i].global;
    const std::int64_t expected = needed[i].whole ? want.size() : want.intersect({0, saved_total}).size();
    if (covered[i] != expected) {
      throw core::InputError(manifest_path.string() + ": the files of '" + buffer_name + "' cover " +
                             std::to_string(covered[i]) + " of the " + std::to_string(expected) +
                             " elements of global range [" + std::to_string(want.begin) + ", " +
                             std::to_string(want.end) + ")");
    }
  }
}

// The model a checkpoint holds: family, shape, the config.json keys the run started from (carried
// into exports) and the tokenizer the run's data was made with (path and CRC32C of the file).
json manifest_model(const RunConfig& config) {
  const models::Family& family = models::family(config.model.arch);
  json model = {{"family", config.model.arch}, {"shape", models::weights_shape(family, config.model.shape)}};
  if (!config.model.carried_hf_config.is_null()) model["hf_config"] = config.model.carried_hf_config;
  if (config.data.tokenizer != "byte") {
    const std::string text = read_text_file(config.data.tokenizer);
    model["tokenizer"] = {{"path", fs::absolute(config.data.tokenizer).string()},
                          {"crc32c", hex32(crc32c(0, text.data(), text.size()))}};
  } else {
    model["tokenizer"] = {{"path", "byte"}};
  }
  return model;
}

}  // namespace

fs::path checkpoints_root(const RunConfig& config) { return fs::path(config.run.output_dir) / "checkpoints"; }

fs::path checkpoint_directory(const fs::path& root, std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return root / name;
}

fs::path save_checkpoint(const fs::path& root, const RunConfig& config, const TrainingProgress& progress,
                         optim::Optimizer& optimizer, const core::DeviceContext& context,
                         comm::Communicator* communicator) {
  comm::SingleRankCommunicator single;
  comm::Communicator& comm = communicator ? *communicator : single;
  const auto started = std::chrono::steady_clock::now();
  optim::Slab& slab = optimizer.slab();
  const fs::path final_dir = checkpoint_directory(root, progress.step);
  const fs::path temp_dir = fs::path(final_dir.string() + ".tmp");
  if (comm.rank() == 0) {
    fs::create_directories(root);
    fs::remove_all(temp_dir);
    fs::create_directory(temp_dir);
  }
  comm.barrier("checkpoint directory");
  context.synchronize();
  const optim::StepScalars scalars = optimizer.step_scalars();

  // Each rank writes the part of every buffer that falls in its shard of the layout; with ZeRO-0
  // every rank holds everything and the shards split the writing. A failure is reported to rank 0
  // instead of thrown at once, so no rank waits for one that gave up.
  const optim::Range shard = slab.layout().shard(comm.rank());
  const optim::Range owned = slab.owned();
  std::vector<BufferToSave> buffers;
  buffers.push_back(
      {"master", "master", core::DType::f32, &slab.master(), pieces_to_write(default_pieces(owned, 1), 1, shard), 1});
  for (const optim::StateBuffer& st : optimizer.state_buffers()) {
    buffers.push_back({st.name, "optimizer_state", st.dtype, st.buffer,
                       pieces_to_write(st.entries(owned), st.elements_per_entry, shard), st.elements_per_entry});
  }
  std::string report;
  try {
    PinnedStaging staging(context);
    json files = json::array();
    for (const BufferToSave& b : buffers) files.push_back(write_buffer_file(temp_dir, b, shard, comm.rank(), staging));
    report = files.dump();
  } catch (const std::exception& e) {
    report = std::string("!rank ") + std::to_string(comm.rank()) + ": " + e.what();
  }
  kill_if_test_asks(comm.rank(), progress.step);
  const std::vector<std::string> reports = comm.gather_strings(report, 0, "checkpoint file list");

  std::string outcome = "ok";
  if (comm.rank() == 0) {
    try {
      json files = json::array();
      for (const std::string& r : reports) {
        if (!r.empty() && r[0] == '!') throw core::Error(r.substr(1));
        for (json& f : json::parse(r)) files.push_back(std::move(f));
      }
      const json manifest = {
          {"format", kFormat},
          {"version", kFormatVersion},
          {"checksum", "crc32c"},
          {"step", progress.step},
          {"tokens_seen", progress.tokens_seen},
          {"schedule",
           {{"type", schedule_type_name(config.schedule.type)},
            {"position", progress.step},
            {"max_steps", config.training.max_steps},
            {"warmup_steps", config.schedule.warmup_steps}}},
          {"rng", {{"run_seed", config.run.seed}, {"sampler_seed", progress.sampler_seed}}},
          {"sampler", progress.sampler},
          {"log_window", {{"steps", progress.window_steps}, {"loss_sum", progress.window_loss}}},
          {"data_order", {{"seq_len", progress.seq_len}, {"global_batch", progress.global_batch}}},
          {"elapsed_s", progress.elapsed_s},
          {"world_size", slab.layout().world_size()},
          {"zero_stage", slab.zero_stage()},
          {"layout", layout_json(slab.layout())},
          {"optimizer", optimizer_json(optimizer.config())},
          {"step_scalars", {{"step", scalars.step}, {"skipped", scalars.skipped}}},
          {"files", files},
          {"config_yaml", resolved_yaml(config)},
          {"model", manifest_model(config)},  // what export_hf and init_from read
      };
      const std::string manifest_text = manifest.dump(2) + "\n";
      write_text_file(temp_dir / kManifestName, manifest_text);
      write_text_file(temp_dir / kDoneName,
                      "crc32c " + hex32(crc32c(0, manifest_text.data(), manifest_text.size())) + "\n");
      fsync_directory(temp_dir);

      std::error_code ec;
      if (fs::exists(final_dir, ec)) {
        const fs::path replaced = fs::path(final_dir.string() + ".replaced");
        fs::remove_all(replaced);
        fs::rename(final_dir, replaced);
        fs::rename(temp_dir, final_dir);
        fsync_directory(root);
        fs::remove_all(replaced);
      } else {
        fs::rename(temp_dir, final_dir);
      }
      fsync_directory(root);
    } catch (const std::exception& e) {
      // Nothing of a failed save stays behind (a full disk gets its space back); a replaced
      // checkpoint of the same step goes back into place.
      std::error_code ec;
      fs::remove_all(temp_dir, ec);
      const fs::path replaced = fs::path(final_dir.string() + ".replaced");
      if (!fs::exists(final_dir, ec) && fs::is_directory(replaced, ec)) fs::rename(replaced, final_dir, ec);
      outcome = "checkpoint of step " + std::to_string(progress.step) + " not saved: " + e.what() + " (" +
                temp_dir.filename().string() + " removed; the earlier checkpoints in " + root.string() +
                " are untouched)";
    }
  }
  outcome = comm.broadcast_string(outcome, 0, "checkpoint outcome");
  if (outcome != "ok") throw core::Error(outcome);
  if (comm.rank() == 0) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::uintmax_t bytes = 0;
    for (const auto& entry : fs::directory_iterator(final_dir)) {
      if (entry.is_regular_file()) bytes += entry.file_size();
    }
    spdlog::info("checkpoint: step {} saved to {}: {:.2f} GB in {:.2f} s ({:.2f} GB/s)", progress.step,
                 final_dir.string(), static_cast<double>(bytes) / 1e9, seconds,
                 static_cast<double>(bytes) / 1e9 / std::max(seconds, 1e-9));
  }
  return final_dir;
}

void prune_checkpoints(const fs::path& root, std::int64_t keep_last) {
  if (keep_last <= 0) return;
  std::int64_t complete = 0;
  for (const fs::path& dir : list_checkpoints(root)) {
    std::error_code ec;
    if (!fs::is_regular_file(dir / kDoneName, ec)) continue;
    if (++complete > keep_last) {
      fs::remove_all(dir);
      spdlog::info("checkpoint: removed {} (keep_last {})", dir.string(), keep_last);
    }
  }
}

json read_verified_manifest(const fs::path& directory) {
  const fs::path manifest_path = directory / kManifestName;
  std::error_code ec;
  if (!fs::is_directory(directory, ec)) throw core::InputError(directory.string() + ": not a checkpoint directory");
  if (!fs::is_regular_file(directory / kDoneName, ec)) {
    throw core::InputError((directory / kDoneName).string() + ": missing: the checkpoint is incomplete");
  }
  if (!fs::is_regular_file(manifest_path, ec)) throw core::InputError(manifest_path.string() + ": missing");
  const std::string manifest_text = read_text_file(manifest_path);
  const std::string done = read_text_file(directory / kDoneName);
  const std::string manifest_crc = hex32(crc32c(0, manifest_text.data(), manifest_text.size()));
  if (done != "crc32c " + manifest_crc + "\n") {
    // A manifest cut short (a full disk, a copy that stopped) no longer parses to its end.
    std::string what = "the manifest is corrupt";
    try {
      const json parsed = json::parse(manifest_text);
      (void)parsed;
    } catch (const json::parse_error& e) {
      if (e.byte >= manifest_text.size()) {
        what = "the manifest is truncated (its JSON ends early, at byte " + std::to_string(manifest_text.size()) + ")";
      }
    }
    throw core::InputError(manifest_path.string() + ": checksum mismatch (crc32c " + manifest_crc + ", DONE says '" +
                           done.substr(0, done.find('\n')) + "'): " + what);
  }
  return models::read_json_file(manifest_path);
}

ManifestModel manifest_model_of(const json& manifest, const std::string& where) {
  if (!manifest.is_object() || !manifest.contains("model") || !manifest["model"].is_object()) {
    throw core::InputError(where + ": model: missing or not a mapping");
  }
  const json& m = manifest["model"];
  ManifestModel out;
  if (m.contains("family")) {
    if (!m["family"].is_string()) throw core::InputError(where + ": model.family: expected a string");
    out.family = m["family"].get<std::string>();
    const models::Family& family = models::family(out.family);
    if (!m.contains("shape") || !m["shape"].is_object()) throw core::InputError(where + ": model.shape: missing");
    models::Shape shape = models::base_shape(family, "");
    for (const models::ConfigField& f : family.fields()) {
      if (!f.shape) continue;
      if (m["shape"].contains(f.key)) {
        shape[f.key] = m["shape"][f.key];
        continue;
      }
      // A manifest written before the field existed reads it as config.json does an absent key.
      if (f.hf_default.is_null()) throw core::InputError(where + ": model.shape." + f.key + ": missing");
      shape[f.key] = f.hf_default;
    }
    models::check_shape(family, shape, where);
    out.shape = models::weights_shape(family, shape);
    if (m.contains("hf_config")) out.hf_config = m["hf_config"];
    if (m.contains("tokenizer") && m["tokenizer"].is_object() && m["tokenizer"].contains("path") &&
        m["tokenizer"]["path"].is_string()) {
      out.tokenizer = m["tokenizer"]["path"].get<std::string>();
    }
  } else {
    // Manifests written before the model interface hold a Qwen3 config.json object.
    const models::Family& family = models::family_of_hf_config(m, where + ": model");
    out.family = family.name();
    out.shape = models::weights_shape(
        family, models::shape_from_hf(family, m, where + ": model", models::base_shape(family, "")));
  }
  return out;
}

fs::path newest_checkpoint_directory(const fs::path& path) {
  std::error_code ec;
  if (fs::is_regular_file(path / kManifestName, ec)) return path;
  const fs::path root = fs::is_directory(path / "checkpoints", ec) ? path / "checkpoints" : path;
  for (const fs::path& dir : list_checkpoints(root)) {
    if (fs::is_regular_file(dir / kDoneName, ec)) return dir;
  }
  if (root == path / "checkpoints" || fs::is_regular_file(path / "config.yaml", ec)) {
    throw core::InputError(path.string() + ": the run has no complete checkpoint yet (the first is written after " +
                           "checkpoint.every steps; a step directory is complete once it has DONE)");
  }
  throw core::InputError(path.string() + ": no complete checkpoint (a step directory with DONE) found");
}

VerifiedCheckpoint verify_checkpoint(const fs::path& directory, const optim::SlabLayout& layout,
                                     const std::string& optimizer_type, bool file_contents) {
  const fs::path manifest_path = directory / kManifestName;
  const json manifest = read_verified_manifest(directory);
  VerifiedCheckpoint out;
  out.directory = directory;
  try {
    out.manifest = manifest;
    const json& m = out.manifest;
    if (m.at("format") != kFormat || m.at("version") != kFormatVersion) {
      throw core::InputError(manifest_path.string() + ": not a version " + std::to_string(kFormatVersion) + " " +
                             kFormat + " manifest");
    }
    check_layout(manifest_path, m.at("layout"), layout);
    const std::string saved_type = m.at("optimizer").at("type").get<std::string>();
    if (saved_type != optimizer_type) {
      throw core::InputError(manifest_path.string() + ": the checkpoint holds " + saved_type +
                             " optimizer state but the run uses optimizer.type " + optimizer_type);
    }
    // Written before fused tensors (q/k/v, gate/up) were separate tensors to the optimizers:
    // AdamW's state is elementwise and carries over; Adafactor's statistics and adamw8bit's
    // per-tensor choice of 8-bit state were made over the fused matrices.
    if (!m.at("layout").contains("parameters") && layout.has_parts() && saved_type != "adamw") {
      throw core::InputError(manifest_path.string() + ": this checkpoint's " + saved_type +
                             " state treats q/k/v and gate/up as one tensor each, which this version keeps "
                             "separate; resume it with the version that wrote it, or start a new run from its "
                             "weights with model.init_from: " +
                             directory.string());
    }
    for (const json& entry : m.at("files")) verify_buffer_file(directory, entry, file_contents);
    out.progress.step = integer<std::int64_t>(m.at("step"));
    const std::int64_t named = step_of(directory);
    if (out.progress.step < 0 || out.progress.step > kMaxStep || (named >= 0 && out.progress.step != named)) {
      throw core::InputError(manifest_path.string() + ": step " + std::to_string(out.progress.step) +
                             (named >= 0 ? " does not match the directory's step " + std::to_string(named)
                                         : " is out of range [0, " + std::to_string(kMaxStep) + "]"));
    }
    out.progress.tokens_seen = integer<std::int64_t>(m.at("tokens_seen"));
    if (out.progress.tokens_seen < 0) throw core::InputError(manifest_path.string() + ": tokens_seen is negative");
    if (m.contains("log_window")) {
      out.progress.window_steps = integer<std::int64_t>(m["log_window"].at("steps"));
      out.progress.window_loss = m["log_window"].at("loss_sum").get<double>();
      if (out.progress.window_steps < 0 || out.progress.window_steps > out.progress.step) {
        throw core::InputError(manifest_path.string() + ": log_window.steps out of range [0, step]");
      }
    }
    if (m.contains("data_order")) {
      out.progress.seq_len = integer<std::int64_t>(m["data_order"].at("seq_len"));
      out.progress.global_batch = integer<std::int64_t>(m["data_order"].at("global_batch"));
    }
    if (m.contains("elapsed_s")) {
      const json& elapsed = m["elapsed_s"];
      if (!elapsed.is_number() || !(elapsed.get<double>() >= 0 && elapsed.get<double>() < 1e12)) {
        throw core::InputError(manifest_path.string() + ": elapsed_s: expected seconds in [0, 1e12), got " +
                               elapsed.dump());
      }
      out.progress.elapsed_s = elapsed.get<double>();
    }
    out.progress.sampler_seed = integer<std::uint64_t>(m.at("rng").at("sampler_seed"));
    out.progress.sampler = m.at("sampler").get<text::SamplerCursor>();
  } catch (const json::exception& e) {
    throw core::InputError(manifest_path.string() + ": malformed manifest: " + e.what());
  }
  return out;
}

namespace {

std::optional<VerifiedCheckpoint> select_verified(const RunConfig& config, const optim::SlabLayout& layout) {
  const std::string& resume = config.checkpoint.resume;
  if (resume == "never") return std::nullopt;
  if (resume != "auto") return verify_checkpoint(resume, layout, config.optimizer.type);
  const fs::path root = checkpoints_root(config);
  const std::vector<fs::path> candidates = list_checkpoints(root);
  // Every directory passed over, with the reason: the log says why the one taken was taken.
  std::vector<std::string> skipped;
  for (const fs::path& dir : unfinished_writes(root)) {
    skipped.push_back(dir.filename().string() + ": incomplete step (its write never finished)");
    spdlog::warn("checkpoint {} is an incomplete step: its write never finished (a crash or a failed save); skipped",
                 dir.string());
  }
  std::string newest_problem;
  for (const fs::path& dir : candidates) {
    try {
      VerifiedCheckpoint verified = verify_checkpoint(dir, layout, config.optimizer.type);
      std::string passed_over;
      for (const std::string& s : skipped) passed_over += "; skipped " + s;
      spdlog::info("checkpoint: resume: auto takes {} (step {}), the newest intact checkpoint{}", dir.string(),
                   verified.progress.step, passed_over);
      return verified;
    } catch (const core::InputError& e) {
      if (newest_problem.empty()) newest_problem = e.what();
      skipped.push_back(dir.filename().string() + ": " + e.what());
      spdlog::warn("checkpoint {} is unusable: {}; falling back to the previous checkpoint", dir.string(), e.what());
    }
  }
  if (candidates.empty() && !skipped.empty()) {
    spdlog::warn("checkpoint: no complete checkpoint in {} (only incomplete steps): starting afresh", root.string());
  }
  if (!candidates.empty()) {
    throw core::InputError("checkpoint.resume: auto: none of the " + std::to_string(candidates.size()) +
                           " checkpoints in " + root.string() + " verifies (newest: " + newest_problem +
                           "); name one with checkpoint.resume=PATH or start afresh in another run.output_dir");
  }
  return std::nullopt;
}

}  // namespace

std::optional<VerifiedCheckpoint> select_checkpoint(const RunConfig& config, const optim::SlabLayout& layout,
                                                    comm::Communicator* communicator) {
  if (communicator == nullptr || communicator->world() == 1) return select_verified(config, layout);
  // Rank 0 reads every file once; the others take its choice ("=" directory, "-" none, "!" error)
  // and check only the manifest, the layout and the file sizes.
  std::string choice;
  std::optional<VerifiedCheckpoint> selected;
  if (communicator->rank() == 0) {
    try {
      selected = select_verified(config, layout);
      choice = selected ? "=" + selected->directory.string() : "-";
    } catch (const core::InputError& e) {
      choice = std::string("!") + e.what();
    }
  }
  choice = communicator->broadcast_string(choice, 0, "checkpoint selection");
  if (choice[0] == '!') throw core::InputError(choice.substr(1));
  if (communicator->rank() == 0 || choice == "-") return selected;
  return verify_checkpoint(choice.substr(1), layout, config.optimizer.type, /*file_contents=*/false);
}

TrainingProgress load_checkpoint(const VerifiedCheckpoint& checkpoint, optim::Optimizer& optimizer,
                                 const core::DeviceContext& context) {
  const fs::path manifest_path = checkpoint.directory / kManifestName;
  optim::Slab& slab = optimizer.slab();
  const optim::Range owned = slab.owned();
  PinnedStaging staging(context);
  try {
    slab.master().fill_bytes(0, context.stream());
    gather_pieces(checkpoint, "master", slab.master(), sizeof(float), 1, default_pieces(owned, 1), staging);
    for (const optim::StateBuffer& state : optimizer.state_buffers()) {
      const json* found = nullptr;
      for (const json& entry : checkpoint.manifest.at("files")) {
        if (entry.at("kind") == "optimizer_state" && entry.at("buffer") == state.name) found = &entry;
      }
      if (found == nullptr) {
        throw core::InputError(manifest_path.string() + ": no optimizer state '" + state.name + "' in the checkpoint");
      }
      const core::DType saved = dtype_from_name(manifest_path, found->at("dtype").get<std::string>());
      if (saved != state.dtype) {
        throw core::InputError(manifest_path.string() + ": optimizer state '" + state.name + "' is " +
                               std::string(core::dtype_name(saved)) + " in the checkpoint, " +
                               std::string(core::dtype_name(state.dtype)) + " in the run");
      }
      state.buffer->fill_bytes(0, context.stream());
      gather_pieces(checkpoint, state.name, *state.buffer, core::dtype_size(state.dtype), state.elements_per_entry,
                    state.entries(owned), staging);
    }
    optim::StepScalars scalars;
    scalars.step = integer<long long>(checkpoint.manifest.at("step_scalars").at("step"));
    scalars.skipped = integer<long long>(checkpoint.manifest.at("step_scalars").at("skipped"));
    slab.grad().fill_bytes(0, context.stream());
    slab.write_mirror(context);
    context.synchronize();
    optimizer.restore_step_scalars(scalars);
  } catch (const json::exception& e) {
    throw core::InputError(manifest_path.string() + ": malformed manifest: " + e.what());
  }
  spdlog::info("checkpoint: resumed from {} at step {} (saved by {} ranks)", checkpoint.directory.string(),
               checkpoint.progress.step, checkpoint.manifest.value("world_size", json()).dump());
  return checkpoint.progress;
}

core::Buffer read_master_weights(const VerifiedCheckpoint& checkpoint, optim::Range range) {
  const core::DeviceContext cpu(core::Device::cpu());
  PinnedStaging staging(cpu);  // plain reads on the cpu
  core::Buffer master(core::Device::cpu(), static_cast<std::size_t>(range.size()) * sizeof(float));
  master.fill_bytes(0, nullptr);
  try {
    gather_pieces(checkpoint, "master", master, sizeof(float), 1, default_pieces(range, 1), staging);
  } catch (const json::exception& e) {
    throw core::InputError((checkpoint.directory / kManifestName).string() + ": malformed manifest: " + e.what());
  }
  return master;
}

}  // namespace trainer
