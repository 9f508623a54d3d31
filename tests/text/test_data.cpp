// Training data: token shards (round trip, refused headers and sizes), the window sampler
// (determinism, rank disjointness, epoch coverage, cursor save/restore), the byte tokenizer, NFC,
// and the Qwen3 BPE tokenizer against Hugging Face `tokenizers` ids (tests/fixtures/tokenizer,
// written by make_tokenizer_fixture.py). The Qwen3 tests need tokenizer.json and the KJV text:
// LLMTRAIN_QWEN3_TOKENIZER / LLMTRAIN_KJV, else ../shared/data/{qwen3-tokenizer/tokenizer.json,kjv.txt}
// beside the repository; without them they skip and say why.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <unistd.h>

#include "core/error.h"
#include "text/sampler.h"
#include "text/token_shard.h"
#include "text/tokenizer.h"
#include "support/test_support.h"
#include "text/unicode_text.h"

namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(LLMTRAIN_FIXTURES_DIR) / "tokenizer";
const fs::path kRepositoryRoot = fs::path(LLMTRAIN_FIXTURES_DIR).parent_path().parent_path();

std::optional<fs::path> qwen3_tokenizer_path() {
  return test::find_data("LLMTRAIN_QWEN3_TOKENIZER", kRepositoryRoot / "../shared/data/qwen3-tokenizer/tokenizer.json");
}
std::optional<fs::path> kjv_path() {
  return test::find_data("LLMTRAIN_KJV", kRepositoryRoot / "../shared/data/kjv.txt");
}

// The Qwen3 tokenizer, loaded once for the suite.
text::BpeTokenizer* qwen3() {
  static std::unique_ptr<text::BpeTokenizer> tokenizer = [] {
    const auto path = qwen3_tokenizer_path();
    return path ? std::make_unique<text::BpeTokenizer>(*path) : nullptr;
  }();
  return tokenizer.get();
}

#define REQUIRE_QWEN3_TOKENIZER()                                                                \
  do {                                                                                           \
    if (qwen3() == nullptr) {                                                                    \
      GTEST_SKIP() << "Qwen3 tokenizer.json not found: set LLMTRAIN_QWEN3_TOKENIZER or provide " \
                      "../shared/data/qwen3-tokenizer/tokenizer.json beside the repository";     \
    }                                                                                            \
  } while (0)

// SHA-256 (FIPS 180-4) of a byte string, as lowercase hex.
std::string sha256_hex(const unsigned char* data, std::size_t size) {
  static constexpr std::uint32_t k[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
      0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
      0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
      0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
      0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
      0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
      0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
      0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
  std::uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::vector<unsigned char> message(data, data + size);
  message.push_back(0x80);
  while (message.size() % 64 != 56) message.push_back(0);
  const std::uint64_t bits = static_cast<std::uint64_t>(size) * 8;
  for (int i = 7; i >= 0; --i) message.push_back(static_cast<unsigned char>(bits >> (8 * i)));
  const auto rotr = [](std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); };
  for (std::size_t block = 0; block < message.size(); block += 64) {
    std::uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      const unsigned char* p = &message[block + 4 * static_cast<std::size_t>(i)];
      w[i] = (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) | p[3];
    }
    for (int i = 16; i < 64; ++i) {
      const std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      const std::uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
  }
  std::string hex;
  for (std::uint32_t word : h) {
    char part[9];
    std::snprintf(part, sizeof part, "%08x", word);
    hex += part;
  }
  return hex;
}

// A fresh folder per test.
class DataFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("llmtrain_test_data_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes a shard, then lets `edit` change its bytes.
  fs::path edited_shard(const std::string& name, const std::function<void(std::string&)>& edit) {
    const fs::path path = dir_ / name;
    const std::vector<std::uint32_t> tokens = {1, 2, 3, 4, 5};
    text::write_token_shard(path, tokens, text::TokenDtype::u16);
    std::string bytes = test::read_file(path);
    edit(bytes);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    return path;
  }

  // The message of the core::InputError that opening `path` throws.
  static std::string open_error(const fs::path& path) {
    try {
      text::TokenShard shard(path);
    } catch (const core::InputError& e) {
      return e.what();
    }
    return "(no error)";
  }

  fs::path dir_;
};

TEST_F(DataFiles, ShardRoundTripU16AndU32) {
  std::vector<std::uint32_t> small(1000), large(1000);
  for (std::uint32_t i = 0; i < 1000; ++i) {
    small[i] = (i * 7919u) % 65536u;
    large[i] = i * 151643u + 65536u;
  }
  text::write_token_shard(dir_ / "small.tok", small, text::TokenDtype::u16);
  text::write_token_shard(dir_ / "sub" / "large.tok", large, text::TokenDtype::u32);
  EXPECT_EQ(fs::file_size(dir_ / "small.tok"), text::kTokenShardHeaderBytes + 2000);
  EXPECT_EQ(fs::file_size(dir_ / "sub" / "large.tok"), text::kTokenShardHeaderBytes + 4000);
  EXPECT_EQ(test::read_file(dir_ / "small.tok").substr(0, 8), "LLMTOKS1");

  for (const auto& [name, expected, dtype] : {std::tuple{"small.tok", small, text::TokenDtype::u16},
                                              std::tuple{"sub/large.tok", large, text::TokenDtype::u32}}) {
    text::TokenShard shard(dir_ / name);
    EXPECT_EQ(shard.dtype(), dtype);
    ASSERT_EQ(shard.size(), expected.size());
    std::vector<std::uint32_t> all(expected.size());
    shard.read(0, all);
    EXPECT_EQ(all, expected);
    EXPECT_EQ(shard[999], expected[999]);
    std::vector<std::int32_t> inputs(16), targets(16);
    shard.read_window(100, inputs, targets);
    for (std::size_t i = 0; i < 16; ++i) {
      EXPECT_EQ(inputs[i], static_cast<std::int32_t>(expected[100 + i]));
      EXPECT_EQ(targets[i], static_cast<std::int32_t>(expected[101 + i]));
    }
    EXPECT_THROW(shard.read_window(1000 - 16, inputs, targets), core::Error);
  }
  // Rewriting replaces the file in place and leaves no temporary behind.
  text::write_token_shard(dir_ / "small.tok", std::vector<std::uint32_t>{}, text::TokenDtype::u16);
  EXPECT_EQ(text::TokenShard(dir_ / "small.tok").size(), 0u);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 2);
}

TEST_F(DataFiles, WriterRefusesIdsBeyondU16) {
  const std::vector<std::uint32_t> tokens = {1, 70000};
  try {
    text::write_token_shard(dir_ / "x.tok", tokens, text::TokenDtype::u16);
    FAIL() << "expected core::InputError";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit the u16 dtype"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir_ / "x.tok"));
  EXPECT_EQ(text::smallest_token_dtype(256), text::TokenDtype::u16);
  EXPECT_EQ(text::smallest_token_dtype(65536), text::TokenDtype::u16);
  EXPECT_EQ(text::smallest_token_dtype(151669), text::TokenDtype::u32);
}

TEST_F(DataFiles, ShardRefusesWrongMagic) {
  const fs::path path = edited_shard("magic.tok", [](std::string& b) { b[3] = 'X'; });
  const std::string message = open_error(path);
  EXPECT_NE(message.find(path.string()), std::string::npos) << message;
  EXPECT_NE(message.find("wrong magic"), std::string::npos) << message;
}

TEST_F(DataFiles, ShardRefusesUnknownVersion) {
  const fs::path path = edited_shard("version.tok", [](std::string& b) { b[8] = 7; });
  const std::string message = open_error(path);
  EXPECT_NE(message.find("unknown version 7"), std::string::npos) << message;
}

TEST_F(DataFiles, ShardRefusesUnknownDtype) {
  const fs::path path = edited_shard("dtype.tok", [](std::string& b) { b[12] = 3; });
  const std::string message = open_error(path);
  EXPECT_NE(message.find(path.string()), std::string::npos) << message;
  EXPECT_NE(message.find("unknown token dtype 3"), std::string::npos) << message;
}

TEST_F(DataFiles, ShardRefusesTruncatedFiles) {
  const fs::path body = edited_shard("body.tok", [](std::string& b) { b.resize(b.size() - 1); });
  std::string message = open_error(body);
  EXPECT_NE(message.find(body.string()), std::string::npos) << message;
  EXPECT_NE(message.find("is truncated: header says 5 tokens of 2 bytes, file holds 9 bytes"), std::string::npos)
      << message;

  const fs::path header = edited_shard("header.tok", [](std::string& b) { b.resize(10); });
  message = open_error(header);
  EXPECT_NE(message.find("is truncated: 10 bytes, shorter than the 24-byte header"), std::string::npos) << message;

  const fs::path longer = edited_shard("longer.tok", [](std::string& b) { b += "xy"; });
  message = open_error(longer);
  EXPECT_NE(message.find("has trailing bytes"), std::string::npos) << message;

  message = open_error(dir_ / "missing.tok");
  EXPECT_NE(message.find("cannot open token shard"), std::string::npos) << message;
}

// All windows a sampler hands out over `steps` steps, per rank.
std::vector<std::vector<std::uint64_t>> draw(std::uint64_t tokens, std::int64_t seq_len, int world, std::uint64_t seed,
                                             std::uint64_t steps) {
  std::vector<std::vector<std::uint64_t>> out(static_cast<std::size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    text::Sampler sampler(tokens, seq_len, world, rank, seed);
    for (std::uint64_t s = 0; s < steps; ++s) out[static_cast<std::size_t>(rank)].push_back(sampler.next());
  }
  return out;
}

TEST(Sampler, SameSeedSameOrderOtherSeedOtherOrder) {
  const auto a = draw(100001, 64, 2, 42, 200);
  const auto b = draw(100001, 64, 2, 42, 200);
  const auto c = draw(100001, 64, 2, 43, 200);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // Not the identity order.
  std::vector<std::uint64_t> sorted = a[0];
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(sorted, a[0]);
}

TEST(Sampler, RanksDisjointAndEpochCovered) {
  for (const auto& [tokens, seq_len, world] : {std::tuple{100001ull, 64ll, 4}, std::tuple{5000ull, 7ll, 3},
                                               std::tuple{65ull, 64ll, 1}, std::tuple{1000ull, 1ll, 8}}) {
    text::Sampler probe(tokens, seq_len, world, 0, 9);
    const std::uint64_t windows = (tokens - 1) / static_cast<std::uint64_t>(seq_len);
    ASSERT_EQ(probe.windows(), windows);
    const std::uint64_t steps = probe.steps_per_epoch();
    ASSERT_EQ(steps, windows / static_cast<std::uint64_t>(world));
    // Two epochs: each is a disjoint cover of steps * world windows, and the orders differ.
    const auto drawn = draw(tokens, seq_len, world, 9, 2 * steps);
    for (int epoch = 0; epoch < 2; ++epoch) {
      std::set<std::uint64_t> seen;
      for (const auto& rank : drawn) {
        for (std::uint64_t s = 0; s < steps; ++s) {
          const std::uint64_t start = rank[static_cast<std::size_t>(epoch) * steps + s];
          EXPECT_EQ(start % static_cast<std::uint64_t>(seq_len), 0u);
          EXPECT_LE(start + static_cast<std::uint64_t>(seq_len) + 1, tokens);
          EXPECT_TRUE(seen.insert(start).second) << "window at " << start << " drawn twice in epoch " << epoch;
        }
      }
      EXPECT_EQ(seen.size(), steps * static_cast<std::uint64_t>(world));
    }
    if (steps > 4) {
      EXPECT_NE(std::vector(drawn[0].begin(), drawn[0].begin() + static_cast<std::ptrdiff_t>(steps)),
                std::vector(drawn[0].begin() + static_cast<std::ptrdiff_t>(steps), drawn[0].end()));
    }
  }
}

TEST(Sampler, CursorSaveRestoreContinuesIdentically) {
  text::Sampler original(20000, 16, 2, 1, 1234);
  for (int i = 0; i < 1000; ++i) original.next();  // past the first epoch (624 steps)
  const nlohmann::json saved = original.cursor();
  EXPECT_EQ(saved.dump(), R"({"epoch":1,"position":752})");

  text::Sampler resumed(20000, 16, 2, 1, 1234);
  resumed.restore(saved.get<text::SamplerCursor>());
  EXPECT_EQ(resumed.cursor(), original.cursor());
  for (int i = 0; i < 2000; ++i) ASSERT_EQ(resumed.next(), original.next()) << "step " << i;

  EXPECT_THROW(resumed.restore(text::SamplerCursor{0, 1250}), core::InputError);
  EXPECT_THROW((void)nlohmann::json::parse(R"({"epoch": -1, "position": 0})").get<text::SamplerCursor>(),
               core::InputError);
  EXPECT_THROW((void)nlohmann::json::parse(R"({"epoch": 1})").get<text::SamplerCursor>(), core::InputError);
}

TEST(Sampler, RefusesBadArguments) {
  EXPECT_THROW(text::Sampler(100, 0, 1, 0, 1), core::InputError);
  EXPECT_THROW(text::Sampler(100, 8, 2, 2, 1), core::InputError);
  EXPECT_THROW(text::Sampler(100, 8, 0, 0, 1), core::InputError);
  try {
    text::Sampler(33, 16, 4, 0, 1);
    FAIL() << "expected core::InputError";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("fewer than the 4 ranks"), std::string::npos) << e.what();
  }
}

TEST(ByteTokenizer, RoundTripsEveryByte) {
  text::ByteTokenizer tokenizer;
  std::string text;
  for (int b = 0; b < 256; ++b) text.push_back(static_cast<char>(b));
  text += "Hello \xff\x00 world";
  const auto ids = tokenizer.encode(text);
  ASSERT_EQ(ids.size(), text.size());
  EXPECT_EQ(ids[200], 200u);
  EXPECT_EQ(tokenizer.decode(ids), text);
  EXPECT_EQ(tokenizer.vocab_size(), 256u);
  const std::vector<std::uint32_t> bad = {65, 256};
  EXPECT_THROW(tokenizer.decode(bad), core::InputError);
  EXPECT_EQ(text::make_tokenizer("byte")->name(), "byte");
}

TEST(Unicode, ClassesAndNfc) {
  using text::unicode::decode_utf8;
  using text::unicode::encode_utf8;
  EXPECT_TRUE(text::unicode::is_letter(U'\u4e2d'));
  EXPECT_TRUE(text::unicode::is_letter(U'\u00e9'));
  EXPECT_FALSE(text::unicode::is_letter(U'\u0301'));
  EXPECT_TRUE(text::unicode::is_number(U'\u2167'));
  EXPECT_TRUE(text::unicode::is_number(U'\u00bd'));
  EXPECT_TRUE(text::unicode::is_whitespace(U'\u3000'));
  EXPECT_FALSE(text::unicode::is_whitespace(U'\u200b'));
  const auto nfc = [](const char* s) { return encode_utf8(text::unicode::nfc(decode_utf8(s, "test"))); };
  EXPECT_EQ(nfc("e\u0301"), "\u00e9");
  EXPECT_EQ(nfc("\u212b"), "\u00c5");                     // singleton decomposition
  EXPECT_EQ(nfc("\u1e9b\u0323"), "\u1e9b\u0323");         // the UAX #15 example
  EXPECT_EQ(nfc("a\u0323\u0302"), nfc("a\u0302\u0323"));  // canonical ordering
  EXPECT_EQ(nfc("a\u0302\u0323"), "\u1ead");
  EXPECT_EQ(nfc("\u1100\u1161\u11a8"), "\uac01");  // Hangul L V T
  EXPECT_EQ(nfc("\u0958"), "\u0915\u093c");        // composition exclusion
  EXPECT_THROW(decode_utf8("ab\xc3", "text"), core::InputError);
  EXPECT_THROW(decode_utf8("\xed\xa0\x80", "text"), core::InputError);  // a surrogate
  EXPECT_THROW(decode_utf8("\xc0\xaf", "text"), core::InputError);      // overlong
}

TEST(Qwen3Tokenizer, TortureTextParity) {
  REQUIRE_QWEN3_TOKENIZER();
  const std::string text = test::read_file(kFixtures / "torture.txt");
  std::vector<std::uint32_t> expected;
  std::ifstream ids(kFixtures / "torture.ids");
  for (std::uint32_t id; ids >> id;) expected.push_back(id);
  ASSERT_FALSE(expected.empty());
  const auto actual = qwen3()->encode(text);
  std::size_t first_difference = 0;
  while (first_difference < std::min(actual.size(), expected.size()) &&
         actual[first_difference] == expected[first_difference]) {
    ++first_difference;
  }
  EXPECT_EQ(actual, expected) << "first difference at id " << first_difference << " of " << expected.size();
  // Decoding gives the NFC form of the text.
  EXPECT_EQ(qwen3()->decode(actual),
            text::unicode::encode_utf8(text::unicode::nfc(text::unicode::decode_utf8(text, "torture"))));
}

TEST(Qwen3Tokenizer, KjvHashParity) {
  REQUIRE_QWEN3_TOKENIZER();
  const auto kjv = kjv_path();
  if (!kjv)
    GTEST_SKIP() << "KJV text not found: set LLMTRAIN_KJV or provide ../shared/data/kjv.txt beside the repository";
  std::ifstream reference(kFixtures / "kjv_sha256_ids.txt");
  std::string key, expected_hash;
  std::size_t expected_count = 0;
  reference >> key >> expected_count >> key >> expected_hash;
  const std::string text = test::read_file(*kjv);
  const auto ids = qwen3()->encode(text);
  EXPECT_EQ(ids.size(), expected_count);
  EXPECT_EQ(sha256_hex(reinterpret_cast<const unsigned char*>(ids.data()), ids.size() * 4), expected_hash);
  EXPECT_EQ(qwen3()->decode(ids), text);
}

TEST(Qwen3Tokenizer, AddedTokensAndRoundTrip) {
  REQUIRE_QWEN3_TOKENIZER();
  EXPECT_EQ(qwen3()->vocab_size(), 151669u);
  EXPECT_EQ(qwen3()->added_token_id("<|endoftext|>"), 151643);
  EXPECT_EQ(qwen3()->added_token_id("<|nope|>"), -1);
  const auto ids = qwen3()->encode("<|im_start|>user\nHi<|im_end|><|endoftext|>");
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids.front(), 151644u);
  EXPECT_EQ(ids[ids.size() - 2], 151645u);
  EXPECT_EQ(ids.back(), 151643u);
  for (const char* text : {"", " ", "Hello world", "  \n\n  trailing  ", "It's 2024: \u4e2d\u6587 \U0001f600!",
                           "<think>a</think>", "'''s'S 123456 \t\r\n"}) {
    EXPECT_EQ(qwen3()->decode(qwen3()->encode(text)), text) << text;
  }
  EXPECT_THROW(qwen3()->encode("bad \xff utf-8"), core::InputError);
  const std::vector<std::uint32_t> unknown = {151669};
  EXPECT_THROW(qwen3()->decode(unknown), core::InputError);
}

TEST_F(DataFiles, TokenizerFileRefusedWithReason) {
  std::ofstream(dir_ / "tokenizer.json") << R"({"model": {"type": "WordPiece", "vocab": {}}, "normalizer": null})";
  try {
    text::BpeTokenizer tokenizer(dir_ / "tokenizer.json");
    FAIL() << "expected core::InputError";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("is not BPE"), std::string::npos) << e.what();
  }
  EXPECT_THROW(text::BpeTokenizer(dir_ / "absent.json"), core::InputError);
}

}  // namespace
