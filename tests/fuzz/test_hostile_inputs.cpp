// Hostile inputs to the file readers, each refused with a core::InputError that names the file
// and the key: token ids that wrap the vocabulary size, a checkpoint manifest with zero attention
// heads (and one whose checksum does not match), batch sizes whose products overflow or whose
// step never ends. The fuzz corpora (tests/fuzz/corpus) hold the inputs the fuzzers found.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include "core/crc32c.h"
#include "core/error.h"
#include "text/token_shard.h"
#include "text/tokenizer.h"
#include "trainer/config.h"
#include "trainer/pretrained.h"

namespace fs = std::filesystem;

namespace {

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

std::string hex32(std::uint32_t value) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", value);
  return buf;
}

// The message of the core::InputError `f` throws; a failure when it throws nothing or another type.
template <typename F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const core::InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted";
  return "";
}

class HostileInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("llmtrain_hostile_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The small BPE fixture with `edit` applied, written to the test folder.
  fs::path tokenizer_with(const std::function<void(nlohmann::json&)>& edit) const {
    nlohmann::json j = nlohmann::json::parse(read_text(fs::path(LLMTRAIN_FIXTURES_DIR) / "tokenizer/small_bpe.json"));
    edit(j);
    const fs::path path = dir_ / "tokenizer.json";
    write_text(path, j.dump());
    return path;
  }

  // A config for the byte-level tiny model over a real shard, `training` as its training section.
  std::string config_with_training(const std::string& training) const {
    const std::vector<std::uint32_t> tokens(64, 7);
    text::write_token_shard(dir_ / "train.bin", tokens, text::TokenDtype::u16);
    return "run:\n  output_dir: " + (dir_ / "run").string() +
           "\ndevice: cpu\nmodel:\n  preset: qwen3-tiny\n  vocab_size: 256\n"
           "data:\n  train: " +
           (dir_ / "train.bin").string() +
           "\n  seq_len: 64\n"
           "training:\n" +
           training;
  }

  fs::path dir_;
};

TEST_F(HostileInputs, TokenizerIdsThatWrapTheVocabularyAreRefused) {
  // -1 and 4294967295 wrapped the vocabulary size to 0 (writes out of bounds); 4294967294 asked
  // for a vocabulary of 2^32 - 1 entries (std::bad_alloc).
  for (const nlohmann::json& id : {nlohmann::json(-1), nlohmann::json(4294967295u), nlohmann::json(4294967294u)}) {
    const fs::path in_vocab = tokenizer_with([&](nlohmann::json& j) { j["model"]["vocab"]["Ġ"] = id; });
    std::string message = refusal([&] { text::BpeTokenizer tokenizer(in_vocab); });
    EXPECT_NE(message.find(in_vocab.string()), std::string::npos) << message;
    EXPECT_NE(message.find("id"), std::string::npos) << message;
    const fs::path added = tokenizer_with([&](nlohmann::json& j) { j["added_tokens"][0]["id"] = id; });
    message = refusal([&] { text::BpeTokenizer tokenizer(added); });
    EXPECT_NE(message.find("added_tokens"), std::string::npos) << message;
  }
  // The fixture itself loads.
  text::BpeTokenizer fine(tokenizer_with([](nlohmann::json&) {}));
  EXPECT_EQ(fine.vocab_size(), 300u);
}

TEST_F(HostileInputs, ALongWordEncodesInLinearithmicTime) {
  // Merges a+a, aa+aa, ... up to 256 letters (ids 400..407). The rescan after every merge made a
  // word of n letters cost n^2: 40000 letters took 3.5 s, a megabyte without spaces half an hour.
  const fs::path path = tokenizer_with([](nlohmann::json& j) {
    std::string token = "a";
    for (int id = 400; id < 408; ++id) {
      j["model"]["vocab"][token + token] = id;
      j["model"]["merges"].push_back(token + " " + token);
      token += token;
    }
  });
  text::BpeTokenizer tokenizer(path);
  const std::uint32_t a = tokenizer.encode("a").at(0);
  const std::size_t letters = std::size_t{1} << 18;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<std::uint32_t> ids = tokenizer.encode(std::string(letters, 'a'));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(ids, std::vector<std::uint32_t>(letters / 256, 407u));
  EXPECT_LT(seconds, 10.0);  // 0.1 s in a release build; the rescan took minutes
  // Either side of the plain loop's piece length, the lowest rank first and the leftmost of equals.
  EXPECT_EQ(tokenizer.encode(std::string(64, 'a')), std::vector<std::uint32_t>{405u});
  EXPECT_EQ(tokenizer.encode(std::string(65, 'a')), (std::vector<std::uint32_t>{405u, a}));
  EXPECT_EQ(tokenizer.encode(std::string(67, 'a')), (std::vector<std::uint32_t>{405u, 400u, a}));
  EXPECT_EQ(tokenizer.encode(std::string(63, 'a')), (std::vector<std::uint32_t>{404u, 403u, 402u, 401u, 400u, a}));
}

TEST_F(HostileInputs, ManifestWithoutAttentionHeadsIsRefusedAfterItsChecksum) {
  // A manifest of the first format (the model as a config.json object) with no heads and no head_dim.
  const fs::path step = dir_ / "step_00000004";
  fs::create_directories(step);
  nlohmann::json config = nlohmann::json::parse(read_text(fs::path(LLMTRAIN_FIXTURES_DIR) / "qwen3/tied/config.json"));
  config["num_attention_heads"] = 0;
  config.erase("head_dim");
  const std::string manifest =
      nlohmann::json{{"format", "llmtrain-checkpoint"}, {"version", 2}, {"model", config}}.dump(2);
  write_text(step / "manifest.json", manifest);
  write_text(step / "DONE", "crc32c " + hex32(core::crc32c(0, manifest.data(), manifest.size())) + "\n");
  std::string message = refusal([&] { (void)trainer::load_pretrained(step.string()); });
  EXPECT_NE(message.find((step / "manifest.json").string()), std::string::npos) << message;
  EXPECT_NE(message.find("num_attention_heads"), std::string::npos) << message;

  // The same bytes under a DONE of other contents: refused for the checksum before anything is read.
  write_text(step / "DONE", "crc32c 00000000\n");
  message = refusal([&] { (void)trainer::load_pretrained(step.string()); });
  EXPECT_NE(message.find("checksum mismatch"), std::string::npos) << message;
  write_text(step / "manifest.json", "{\"model\": [[[[");
  message = refusal([&] { (void)trainer::load_pretrained(step.string()); });
  EXPECT_NE(message.find("checksum mismatch"), std::string::npos) << message;
}

TEST_F(HostileInputs, MicroBatchWhoseTokenCountOverflowsIsRefused) {
  // micro_batch_size x seq_len wrapped to 0 and the batch read wrote into an empty buffer.
  const std::string yaml = config_with_training("  micro_batch_size: 4611686018427387904\n  max_steps: 2\n");
  const std::string message = refusal([&] { (void)trainer::parse_run_config(yaml, "hostile.yaml", {}); });
  EXPECT_NE(message.find("hostile.yaml"), std::string::npos) << message;
  EXPECT_NE(message.find("training.micro_batch_size"), std::string::npos) << message;
  const std::string overridden = refusal([&] {
    (void)trainer::parse_run_config(config_with_training("  micro_batch_size: 1\n  max_steps: 2\n"), "hostile.yaml",
                                    {"training.micro_batch_size=4611686018427387904"});
  });
  EXPECT_NE(overridden.find("training.micro_batch_size"), std::string::npos) << overridden;
}

TEST_F(HostileInputs, GlobalBatchOfBillionsOfMicroBatchesIsRefused) {
  // 6442450944 sequences per step at micro_batch_size 1: a step that never ends.
  const std::string yaml =
      config_with_training("  micro_batch_size: 1\n  global_batch_size: 6442450944\n  max_steps: 2\n");
  const std::string message = refusal([&] { (void)trainer::parse_run_config(yaml, "hostile.yaml", {}); });
  EXPECT_NE(message.find("hostile.yaml"), std::string::npos) << message;
  EXPECT_NE(message.find("training.global_batch_size"), std::string::npos) << message;
  // The largest accepted global batch still ends: at most 65536 micro-batches per rank per step.
  const trainer::RunConfig ok = trainer::parse_run_config(
      config_with_training("  micro_batch_size: 1\n  global_batch_size: 65536\n  max_steps: 2\n"), "hostile.yaml", {});
  EXPECT_EQ(trainer::accumulation_steps(ok, 1), 65536);
}

}  // namespace
