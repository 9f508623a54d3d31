// Fuzz target: the run config (YAML file plus command-line overrides) as the trainer reads it.
// Input: the YAML text, then optionally "=== overrides" with one SECTION.KEY=VALUE per line.
// Runs in a scratch folder holding train.bin, val.bin (token shards) and tokenizer.json, so
// configs can name real data files. A config that parses must keep the invariants the training
// loop relies on (bounded tokens per micro-batch and micro-batches per step) and must read back
// equal from its resolved YAML.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "core/error.h"
#include "fuzz_support.h"
#include "optim/slab_layout.h"
#include "text/token_shard.h"
#include "trainer/config.h"

namespace {

std::unique_ptr<fuzz::Scratch> scratch;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  scratch = std::make_unique<fuzz::Scratch>();
  if (::chdir(scratch->path().c_str()) != 0) std::abort();
  const std::vector<std::uint32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
  text::write_token_shard("train.bin", tokens, text::TokenDtype::u16);
  text::write_token_shard("val.bin", tokens, text::TokenDtype::u32);
  fuzz::write_file("tokenizer.json", "{}");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const fuzz::Files files = fuzz::split_files(data, size, "config.yaml");
  const std::string& yaml = files.front().second;
  std::vector<std::string> overrides;
  if (const std::string* text = fuzz::find_file(files, "overrides")) {
    std::istringstream lines(*text);
    for (std::string line; std::getline(lines, line);) overrides.push_back(line);
  }
  trainer::RunConfig config;
  try {
    config = trainer::parse_run_config(yaml, "fuzz.yaml", overrides);
  } catch (const core::Error& e) {
    fuzz::refused(e);
    return 0;
  }
  // What the training loop assumes of a config that was accepted.
  if (config.data.seq_len < 1 || config.training.micro_batch_size < 1)
    fuzz::finding("fuzz_config", "accepted a non-positive size");
  if (config.training.micro_batch_size > (std::int64_t{1} << 31) / config.data.seq_len) {
    fuzz::finding("fuzz_config", "accepted micro_batch_size x seq_len beyond 2^31 tokens");
  }
  for (int world : {1, 2, 3, 8}) {
    try {
      trainer::validate_for_world(config, world);
    } catch (const core::Error& e) {
      fuzz::refused(e);
      continue;
    }
    const std::int64_t steps = trainer::accumulation_steps(config, world);
    if (steps < 1 || steps > (1 << 16))
      fuzz::finding("fuzz_config", "accepted " + std::to_string(steps) + " micro-batches per step");
  }
  try {
    const auto spec = trainer::model_spec(config);
    const optim::SlabLayout layout(spec->parameters(), 1);
    if (layout.total_elements() < 1) fuzz::finding("fuzz_config", "accepted a model without parameters");
  } catch (const core::Error& e) {
    fuzz::refused(e);
  }
  // The resolved YAML reads back as the same config.
  const std::string resolved = trainer::resolved_yaml(config);
  trainer::RunConfig again;
  try {
    again = trainer::parse_run_config(resolved, "resolved.yaml", {});
  } catch (const core::Error& e) {
    fuzz::finding("fuzz_config", std::string("the resolved config does not read back: ") + e.what() + "\n" + resolved);
  }
  if (!(again == config)) {
    fuzz::finding("fuzz_config", "the resolved config reads back different:\n" + resolved + "\nread back:\n" +
                                     trainer::resolved_yaml(again));
  }
  return 0;
}
