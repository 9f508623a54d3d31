// Training checkpoints (format in docs/formats.md, "Checkpoints"): OUT/checkpoints/step_NNNNNNNN/
// holding manifest.json, one binary file per slab buffer (master weights, each optimizer state
// buffer) and a DONE marker. A checkpoint is written into step_NNNNNNNN.tmp, every file and the
// directory fsynced, DONE written last, then renamed into place; a crash at any point leaves the
// complete checkpoints untouched. Every file carries the global element range it holds, so a run
// with another world size can read it. Files are checked with CRC32C (Castagnoli) on load.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "core/buffer.h"
#include "core/crc32c.h"
#include "core/device.h"
#include "optim/optimizer.h"
#include "optim/slab_layout.h"
#include "trainer/config.h"
#include "text/sampler.h"

namespace trainer {

// Where a run stands between two optimizer steps: everything besides the slab and optimizer
// buffers that a resumed run needs to continue exactly.
struct TrainingProgress {
  std::int64_t step = 0;         // optimizer steps taken; also the schedule position
  std::int64_t tokens_seen = 0;  // training tokens consumed over all ranks
  std::uint64_t sampler_seed = 0;
  text::SamplerCursor sampler;
  // The logging window open at the save (steps since the last log line and their loss sum), so a
  // resumed run logs the same averages as an uninterrupted one.
  std::int64_t window_steps = 0;
  double window_loss = 0;
  // What cuts the data into batches: another value on resume changes the data order.
  std::int64_t seq_len = 0;       // 0: not recorded (checkpoints of earlier versions)
  std::int64_t global_batch = 0;  // sequences per step
  // Wall time of the run up to the save, over all its resumes: metrics' elapsed_s continues.
  double elapsed_s = 0;

  bool operator==(const TrainingProgress&) const = default;
};

// A checkpoint whose DONE marker, manifest, layout and file checksums were verified.
struct VerifiedCheckpoint {
  std::filesystem::path directory;
  nlohmann::json manifest;
  TrainingProgress progress;
};

// OUT/checkpoints
std::filesystem::path checkpoints_root(const RunConfig& config);
// `root`/step_NNNNNNNN (8 digits)
std::filesystem::path checkpoint_directory(const std::filesystem::path& root, std::int64_t step);

// CRC32C of file contents (core/crc32c.h).
using core::crc32c;

// Writes the checkpoint of `progress.step` under `root` and returns its directory; every rank of
// `communicator` (none: a single rank) calls it and writes its shard's files, rank 0 the manifest
// and DONE once all files are written. On cuda the buffers stream through pinned host chunks. A
// directory of the same step is replaced only once the new one is complete. Throws core::Error on
// I/O failure (on every rank).
std::filesystem::path save_checkpoint(const std::filesystem::path& root, const RunConfig& config,
                                      const TrainingProgress& progress, optim::Optimizer& optimizer,
                                      const core::DeviceContext& context, comm::Communicator* communicator = nullptr);

// Deletes the complete checkpoints (those with DONE) under `root` except the newest `keep_last`;
// 0 keeps all. Incomplete directories are left alone.
void prune_checkpoints(const std::filesystem::path& root, std::int64_t keep_last);

// The manifest of a checkpoint directory, parsed only after its checksum (recorded in DONE)
// matched: nothing of it is trusted before. core::InputError naming the file otherwise.
nlohmann::json read_verified_manifest(const std::filesystem::path& directory);

// The model a manifest records: family and shape (checked against the family's table), the
// config.json keys the run started from, and the tokenizer its data was made with ("byte", a
// path, or empty when not recorded). Manifests written before the model interface recorded a
// Qwen3 config.json object; they read as that. core::InputError naming `where` and the key.
struct ManifestModel {
  std::string family;
  nlohmann::ordered_json shape;  // a models::Shape, in the family table's order
  nlohmann::json hf_config;
  std::string tokenizer;
};
ManifestModel manifest_model_of(const nlohmann::json& manifest, const std::string& where);

// A step directory as given, or the newest complete one under a run directory or its checkpoints/.
std::filesystem::path newest_checkpoint_directory(const std::filesystem::path& path);

// Checks `directory`: DONE present, the manifest's checksum (recorded in DONE), the slab layout
// against `layout` (names, shapes, offsets), the optimizer type, and every listed file's size and,
// with `file_contents`, header and CRC32C. Throws core::InputError naming the offending file and
// what is wrong.
VerifiedCheckpoint verify_checkpoint(const std::filesystem::path& directory, const optim::SlabLayout& layout,
                                     const std::string& optimizer_type, bool file_contents = true);

// The checkpoint a run resumes from under config.checkpoint.resume:
//   never: none; PATH: that checkpoint, verified (core::InputError when it does not verify);
//   auto:  the newest verified one under checkpoints_root(config), falling back to older ones with
//          a warning for each that does not verify; none when there are none; core::InputError
//          when checkpoints exist but none verifies.
// With a communicator of several ranks every rank calls it; rank 0 alone reads the files through
// and the others take its choice (and its error, if any).
std::optional<VerifiedCheckpoint> select_checkpoint(const RunConfig& config, const optim::SlabLayout& layout,
                                                    comm::Communicator* communicator = nullptr);

// Restores a verified checkpoint into `optimizer` and its slab: master weights (the global range
// the slab owns, gathered from the files that cover it), every optimizer state buffer, the step
// counters, the mirror (rewritten from the master weights) and zero gradients. Returns the
// progress to continue from. Throws core::InputError when a buffer does not match.
TrainingProgress load_checkpoint(const VerifiedCheckpoint& checkpoint, optim::Optimizer& optimizer,
                                 const core::DeviceContext& context);

// The fp32 master weights of global range `range`, gathered from a verified checkpoint's files
// into host memory (what export tools read). Throws core::InputError when the files do not
// cover the range.
core::Buffer read_master_weights(const VerifiedCheckpoint& checkpoint, optim::Range range);

}  // namespace trainer
