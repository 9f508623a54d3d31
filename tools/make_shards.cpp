// make_shards: text files -> token shards (format in docs/formats.md) for training and validation.
//   make_shards INPUT.txt [MORE.txt ...] --tokenizer byte|PATH/tokenizer.json
//               --train-out train.tok [--val-out val.tok --val-fraction 0.05] [--separator TEXT]
// The files are tokenized one by one and concatenated in order (with the ids of --separator between
// them, e.g. '<|endoftext|>'); the last round(val_fraction * count) tokens form the validation shard,
// the rest the training shard. Ids are stored as u16 when the vocabulary fits, else u32.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/error.h"
#include "text/token_shard.h"
#include "text/tokenizer.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw core::InputError("cannot open input '" + path + "'");
  std::ostringstream content;
  content << file.rdbuf();
  return std::move(content).str();
}

const char* dtype_name(text::TokenDtype dtype) { return dtype == text::TokenDtype::u16 ? "u16" : "u32"; }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"text files -> token shards (train and validation)"};
  std::vector<std::string> inputs;
  std::string tokenizer_spec = "byte", train_out, val_out, separator;
  double val_fraction = 0.0;
  app.add_option("inputs", inputs, "text files, tokenized in order")->required()->check(CLI::ExistingFile);
  app.add_option("--tokenizer", tokenizer_spec, "'byte' or the path of a Hugging Face tokenizer.json")->capture_default_str();
  app.add_option("--train-out", train_out, "training shard to write")->required();
  app.add_option("--val-out", val_out, "validation shard to write (needed when --val-fraction > 0)");
  app.add_option("--val-fraction", val_fraction, "fraction of the tokens, taken from the end, for validation")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--separator", separator, "text whose ids go between consecutive files (e.g. '<|endoftext|>')");
  CLI11_PARSE(app, argc, argv);

  try {
    if (val_fraction > 0.0 && val_out.empty()) throw core::InputError("--val-fraction > 0 needs --val-out");
    auto tokenizer = text::make_tokenizer(tokenizer_spec);
    std::vector<std::uint32_t> tokens;
    std::uint64_t text_bytes = 0;
    for (std::size_t f = 0; f < inputs.size(); ++f) {
      if (f > 0 && !separator.empty()) {
        const auto ids = tokenizer->encode(separator);
        tokens.insert(tokens.end(), ids.begin(), ids.end());
      }
      const std::string text = read_file(inputs[f]);
      text_bytes += text.size();
      const auto ids = tokenizer->encode(text);
      tokens.insert(tokens.end(), ids.begin(), ids.end());
      std::printf("%s: %zu bytes -> %zu tokens\n", inputs[f].c_str(), text.size(), ids.size());
    }
    const auto val_count = static_cast<std::size_t>(std::llround(val_fraction * static_cast<double>(tokens.size())));
    const std::size_t train_count = tokens.size() - val_count;
    const text::TokenDtype dtype = text::smallest_token_dtype(tokenizer->vocab_size());
    const std::span<const std::uint32_t> all(tokens);
    text::write_token_shard(train_out, all.first(train_count), dtype);
    std::printf("tokenizer %s (vocab %u), %llu bytes -> %zu tokens (%.3f bytes/token), dtype %s\n",
                tokenizer->name().c_str(), tokenizer->vocab_size(), static_cast<unsigned long long>(text_bytes),
                tokens.size(), tokens.empty() ? 0.0 : static_cast<double>(text_bytes) / static_cast<double>(tokens.size()),
                dtype_name(dtype));
    std::printf("train: %zu tokens -> %s\n", train_count, train_out.c_str());
    if (!val_out.empty()) {
      text::write_token_shard(val_out, all.last(val_count), dtype);
      std::printf("val:   %zu tokens -> %s\n", val_count, val_out.c_str());
    }
  } catch (const core::Error& e) {
    std::fprintf(stderr, "make_shards: %s\n", e.what());
    return 1;
  }
  return 0;
}
