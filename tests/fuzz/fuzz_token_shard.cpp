// Fuzz target: a token shard (24-byte header, then ids) opened, read in windows and sampled as
// the training loop does. Input: the shard's bytes, then optionally "=== sampler" with
// "SEQ_LEN WORLD RANK SEED EPOCH POSITION" (defaults 4 1 0 7 0 0).
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "fuzz_support.h"
#include "text/sampler.h"
#include "text/token_shard.h"

namespace {

std::unique_ptr<fuzz::Scratch> scratch;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  scratch = std::make_unique<fuzz::Scratch>();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fuzz::Files files = fuzz::split_files(data, size, "shard.bin");
  const auto path = scratch->fresh() / "shard.bin";
  fuzz::write_file(path, files.front().second);
  long long seq_len = 4, world = 1, rank = 0;
  unsigned long long seed = 7, epoch = 0, position = 0;
  if (const std::string* text = fuzz::find_file(files, "sampler")) {
    std::istringstream in(*text);
    in >> seq_len >> world >> rank >> seed >> epoch >> position;
  }
  try {
    const text::TokenShard shard(path);
    if (shard.size() * static_cast<std::uint64_t>(shard.dtype()) + text::kTokenShardHeaderBytes !=
        files.front().second.size()) {
      fuzz::finding("fuzz_token_shard", "the shard's count does not match its size");
    }
    std::vector<std::uint32_t> all(shard.size());
    shard.read(0, all);
    if (world < 1 || world > 64 || seq_len < 1 || seq_len > 4096) return 0;
    text::Sampler sampler(shard.size(), seq_len, static_cast<int>(world), static_cast<int>(rank), seed);
    // A cursor as a checkpoint stores it, read through its JSON form.
    const nlohmann::json cursor_json = {{"epoch", epoch}, {"position", position}};
    sampler.restore(cursor_json.get<text::SamplerCursor>());
    std::vector<std::int32_t> inputs(static_cast<std::size_t>(seq_len)), targets(inputs.size());
    for (int step = 0; step < 8; ++step) {
      const std::uint64_t start = sampler.next();
      shard.read_window(start, inputs, targets);
    }
  } catch (const core::Error& e) {
    fuzz::refused(e);
  }
  return 0;
}
