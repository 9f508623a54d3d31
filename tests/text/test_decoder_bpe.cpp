// Turning generated ids back into text (text::Tokenizer::decode_text), as Hugging Face's
// decode(skip_special_tokens=True) does for byte-level BPE:
// - decode_text(encode(text)) == NFC(text) for the tokenizer fixtures' texts with the committed
//   small BPE (tests/fixtures/tokenizer/small_bpe.json), and, when present, with the Qwen3
//   tokenizer and for all of the KJV text (LLMTRAIN_QWEN3_TOKENIZER / LLMTRAIN_KJV, else
//   ../shared/data/{qwen3-tokenizer/tokenizer.json,kjv.txt} beside the repository; skipped without);
// - special added tokens are left out unless asked for, non-special added tokens kept;
// - ill-formed UTF-8 (a token boundary inside a character, stray bytes) becomes U+FFFD, one per
//   maximal ill-formed subsequence, and the result is always valid UTF-8.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "text/tokenizer.h"
#include "support/test_support.h"
#include "text/unicode_text.h"

namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(LLMTRAIN_FIXTURES_DIR) / "tokenizer";
const fs::path kRepositoryRoot = fs::path(LLMTRAIN_FIXTURES_DIR).parent_path().parent_path();
const std::string kReplacement = "\xEF\xBF\xBD";

std::string nfc(const std::string& text) {
  return text::unicode::encode_utf8(text::unicode::nfc(text::unicode::decode_utf8(text, "test text")));
}

bool valid_utf8(const std::string& text) {
  try {
    text::unicode::decode_utf8(text, "decoded text");
    return true;
  } catch (const core::InputError&) {
    return false;
  }
}

// Removes every occurrence of `token`.
std::string without(std::string text, const std::string& token) {
  for (std::size_t at; (at = text.find(token)) != std::string::npos;) text.erase(at, token.size());
  return text;
}

// The fixture texts: the torture text and a few short ones.
std::vector<std::string> fixture_texts() {
  return {test::read_file(kFixtures / "torture.txt"),
          "",
          " ",
          "Hello world",
          "  \n\n  trailing  ",
          "It's 2024: \u4e2d\u6587 \U0001f600!",
          "e\u0301 A\u030a \u212b",  // NFC composes these
          "'''s'S 123456 \t\r\n"};
}

std::unique_ptr<text::BpeTokenizer> small_bpe() {
  return std::make_unique<text::BpeTokenizer>(kFixtures / "small_bpe.json");
}

text::BpeTokenizer* qwen3() {
  static std::unique_ptr<text::BpeTokenizer> tokenizer = [] {
    const auto path =
        test::find_data("LLMTRAIN_QWEN3_TOKENIZER", kRepositoryRoot / "../shared/data/qwen3-tokenizer/tokenizer.json");
    return path ? std::make_unique<text::BpeTokenizer>(*path) : nullptr;
  }();
  return tokenizer.get();
}

// decode_text(encode(text)) is NFC(text), with the special tokens left out by default.
void check_round_trip(text::Tokenizer& tokenizer, const std::string& text, const std::vector<std::string>& specials,
                      const std::string& what) {
  const auto ids = tokenizer.encode(text);
  const std::string expected = nfc(text);
  EXPECT_EQ(tokenizer.decode_text(ids, false), expected) << what << ": keeping special tokens";
  std::string skipped = expected;
  for (const auto& s : specials) skipped = without(skipped, s);
  EXPECT_EQ(tokenizer.decode_text(ids), skipped) << what << ": skipping special tokens";
}

TEST(DecoderBpe, SmallBpeRoundTripsFixtureTexts) {
  auto tokenizer = small_bpe();
  int i = 0;
  for (const std::string& text : fixture_texts()) {
    check_round_trip(*tokenizer, text, {"<|endoftext|>"}, "small_bpe text " + std::to_string(i++));
  }
}

TEST(DecoderBpe, SpecialTokensSkippedUnlessAsked) {
  auto tokenizer = small_bpe();
  const auto eos = tokenizer->added_token_id("<|endoftext|>");
  ASSERT_GE(eos, 0);
  EXPECT_TRUE(tokenizer->is_special(static_cast<std::uint32_t>(eos)));
  const auto ids = tokenizer->encode("a<|endoftext|>b<|endoftext|>");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), static_cast<std::uint32_t>(eos)), 2);
  EXPECT_EQ(tokenizer->decode_text(ids), "ab");
  EXPECT_EQ(tokenizer->decode_text(ids, false), "a<|endoftext|>b<|endoftext|>");
  const std::vector<std::uint32_t> only = {static_cast<std::uint32_t>(eos)};
  EXPECT_EQ(tokenizer->decode_text(only), "");
  // An id outside the vocabulary is an error, as for decode().
  const std::vector<std::uint32_t> unknown = {tokenizer->vocab_size()};
  EXPECT_THROW(tokenizer->decode_text(unknown), core::InputError);
  // The byte tokenizer has no special tokens.
  text::ByteTokenizer bytes;
  const auto byte_ids = bytes.encode("<|endoftext|>");
  EXPECT_EQ(bytes.decode_text(byte_ids), "<|endoftext|>");
}

TEST(DecoderBpe, IllFormedUtf8BecomesReplacementCharacters) {
  text::ByteTokenizer bytes;
  const auto decode = [&](const std::string& raw) { return bytes.decode_text(bytes.encode(raw)); };
  const std::string r = kReplacement;
  EXPECT_EQ(decode("plain \u00e9\u4e2d\U0001f600"), "plain \u00e9\u4e2d\U0001f600");
  EXPECT_EQ(decode("\xff"), r);
  EXPECT_EQ(decode("a\xe2\x82"), "a" + r);  // a truncated 3-byte sequence: one replacement
  EXPECT_EQ(decode("\xe2\x82"
                   "A"),
            r + "A");
  EXPECT_EQ(decode("\xf0\x9f\x98"), r);                  // a truncated emoji
  EXPECT_EQ(decode("\xed\xa0\x80"), r + r + r);          // a surrogate: ED is its own maximal subpart
  EXPECT_EQ(decode("\xc0\xaf"), r + r);                  // overlong
  EXPECT_EQ(decode("\xf4\x90\x80\x80"), r + r + r + r);  // above U+10FFFF
  EXPECT_EQ(decode("\x80"
                   "b\xbf"),
            r + "b" + r);                        // stray continuation bytes
  EXPECT_EQ(decode("\xe0\x80\x80"), r + r + r);  // E0 needs A0..BF next

  // Random byte strings: always valid UTF-8, and unchanged when they were valid already.
  std::mt19937_64 rng(12345);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string raw(rng() % 12, '\0');
    for (char& c : raw) c = static_cast<char>(rng() % 4 == 0 ? rng() % 128 : 0x80 + rng() % 128);
    const std::string out = decode(raw);
    ASSERT_TRUE(valid_utf8(out)) << trial;
    if (valid_utf8(raw)) {
      ASSERT_EQ(out, raw) << trial;
    }
  }
}

TEST(DecoderBpe, TokenBoundaryInsideACharacter) {
  // Prefixes of the ids of multi-byte text: decode_text gives the valid prefix of the bytes and a
  // U+FFFD for an unfinished character, never invalid UTF-8.
  auto tokenizer = small_bpe();
  const std::string text = "\u4e2d\u6587\u6d4b\u8bd5 \U0001f600\U0001f44d\U0001f3fd caf\u00e9";
  const auto ids = tokenizer->encode(text);
  bool saw_partial = false;
  for (std::size_t k = 0; k <= ids.size(); ++k) {
    const std::vector<std::uint32_t> prefix(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k));
    const std::string raw = tokenizer->decode(prefix), shown = tokenizer->decode_text(prefix);
    ASSERT_TRUE(valid_utf8(shown)) << "prefix " << k;
    if (valid_utf8(raw)) {
      EXPECT_EQ(shown, raw) << "prefix " << k;
    } else {
      saw_partial = true;
      EXPECT_NE(shown.find(kReplacement), std::string::npos) << "prefix " << k;
      EXPECT_EQ(text.rfind(shown.substr(0, shown.find(kReplacement)), 0), 0u) << "prefix " << k;
    }
  }
  EXPECT_TRUE(saw_partial) << "the small BPE split no character across tokens: the test lost its point";
  EXPECT_EQ(tokenizer->decode_text(ids), text);
}

TEST(DecoderBpe, Qwen3TokenizerRoundTripsFixtureTexts) {
  if (qwen3() == nullptr) {
    GTEST_SKIP() << "SKIPPED: Qwen3 tokenizer.json not found: set LLMTRAIN_QWEN3_TOKENIZER or provide "
                    "../shared/data/qwen3-tokenizer/tokenizer.json beside the repository";
  }
  // Qwen3's special added tokens (the chat and fim markers); <think> and <tool_call> are added
  // tokens that are not special, so they stay.
  std::vector<std::string> specials;
  for (std::uint32_t id = 151643; id < qwen3()->vocab_size(); ++id) {
    if (qwen3()->is_special(id)) specials.push_back(qwen3()->decode(std::vector<std::uint32_t>{id}));
  }
  EXPECT_FALSE(specials.empty());
  int i = 0;
  for (const std::string& text : fixture_texts())
    check_round_trip(*qwen3(), text, specials, "qwen3 text " + std::to_string(i++));
  const auto ids = qwen3()->encode("<|im_start|>user\nhi<|im_end|><think>x</think><|endoftext|>");
  EXPECT_EQ(qwen3()->decode_text(ids), "user\nhi<think>x</think>");
}

TEST(DecoderBpe, KjvRoundTrips) {
  const auto kjv = test::find_data("LLMTRAIN_KJV", kRepositoryRoot / "../shared/data/kjv.txt");
  if (!kjv) GTEST_SKIP() << "SKIPPED: KJV text not found: set LLMTRAIN_KJV or provide ../shared/data/kjv.txt";
  const std::string text = test::read_file(*kjv);
  ASSERT_GT(text.size(), 1000000u);
  auto small = small_bpe();
  check_round_trip(*small, text, {"<|endoftext|>"}, "kjv, small_bpe");
  if (qwen3() != nullptr) {
    check_round_trip(*qwen3(), text, {}, "kjv, qwen3");
  } else {
    std::printf("[ decoder  ] the Qwen3 tokenizer is absent: kjv checked with the small BPE only\n");
  }
}

}  // namespace
