// tools/make_shards on corpora, run as a program: a plain-text file's ids equal one encode call over
// the whole text for any chunk size and thread count (byte tokenizer; the Qwen3 tokenizer on the
// torture text, KJV and cut-boundary corner cases when present), many files and JSONL documents
// with their separator ids (the end-of-text id by default for BPE, --separator, --separator-id,
// none), the --val-every and --val-fraction splits, byte-identical shards with 1 and many threads,
// standard input, one long line cut inside in bounded memory, and bad inputs refused with a message naming the file
// (and line), leaving no temporary file and an existing output untouched.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "text/token_shard.h"
#include "support/test_support.h"
#include "text/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using Ids = std::vector<std::uint32_t>;

const fs::path kFixtures = fs::path(LLMTRAIN_FIXTURES_DIR) / "tokenizer";
const fs::path kRepositoryRoot = fs::path(LLMTRAIN_FIXTURES_DIR).parent_path().parent_path();
const fs::path kSmallBpe = kFixtures / "small_bpe.json";  // 300 ids, "<|endoftext|>" = 299
constexpr std::uint32_t kSmallEndOfText = 299;

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct Result {
  int status = -1;
  std::string output;  // stdout and stderr
};

// Runs make_shards with `args` and `stdin_file` as standard input.
Result make_shards(const std::vector<std::string>& args, const std::string& stdin_file = "/dev/null") {
  std::string command = quoted(LLMTRAIN_MAKE_SHARDS);
  for (const std::string& a : args) {
    command += ' ';
    command += quoted(a);
  }
  command += " < ";
  command += quoted(stdin_file);
  command += " 2>&1";
  Result result;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) result.output.append(buffer, n);
  const int status = ::pclose(pipe);
  result.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

Ids shard_ids(const fs::path& path) {
  text::TokenShard shard(path);
  Ids ids(shard.size());
  shard.read(0, ids);
  return ids;
}

Ids concat(const std::vector<Ids>& documents, const Ids& separator) {
  Ids out;
  for (std::size_t d = 0; d < documents.size(); ++d) {
    if (d > 0) out.insert(out.end(), separator.begin(), separator.end());
    out.insert(out.end(), documents[d].begin(), documents[d].end());
  }
  return out;
}

std::string json_line(const std::string& key, const std::string& text) {
  std::string out = "{\"id\": 7, \"" + key + "\": \"";
  for (unsigned char c : text) {
    if (c == '"' || c == '\\')
      out += std::string("\\") + static_cast<char>(c);
    else if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else if (c < 0x20) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", c);
      out += escape;
    } else
      out += static_cast<char>(c);
  }
  return out + "\"}";
}

// Text whose cut positions and pre-tokenizer pieces are awkward: whitespace runs with and without
// line breaks, CRLF, Unicode spaces and marks after a line break, numbers, added-token text.
std::string awkward_text(int copies) {
  std::string out;
  for (int i = 0; i < copies; ++i) {
    out += "Line " + std::to_string(i) + " of text.\n  indented line\n\n\nafter blank lines\n";
    out += "tabs\t\n\tand\r\nCRLF line\r\n\r\n  \n \n x\n\xe3\x80\x80ideographic space\n\xcc\x81 mark first\n";
    out += "caf\xc3\xa9 e\xcc\x81 \xe4\xb8\xad\xe6\x96\x87 12345 it's <|endoftext|> done\n";
    out += "trailing spaces   \n   \n\n" + std::string(static_cast<std::size_t>(i % 7), ' ') + "end\n";
  }
  return out + "  \n";
}

class MakeShards : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("llmtrain_make_shards_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path file(const std::string& name) const { return dir_ / name; }

  // make_shards on `inputs` with `extra` arguments into train.tok; its ids.
  Ids train_ids(const std::vector<std::string>& inputs, const std::vector<std::string>& extra) {
    std::vector<std::string> args = inputs;
    args.insert(args.end(), extra.begin(), extra.end());
    args.insert(args.end(), {"--train-out", file("train.tok").string()});
    const Result r = make_shards(args);
    EXPECT_EQ(r.status, 0) << r.output;
    return r.status == 0 ? shard_ids(file("train.tok")) : Ids{};
  }

  // Every chunk size and thread count gives the ids of one encode call over `text`.
  void expect_equal_to_one_encode_call(const std::string& text, const std::string& tokenizer_spec) {
    write_file(file("doc.txt"), text);
    const Ids expected = text::make_tokenizer(tokenizer_spec)->encode(text);
    ASSERT_FALSE(expected.empty());
    for (const char* chunk_kib : {"1", "3", "64", "2048"}) {
      for (const char* threads : {"1", "4"}) {
        const Ids ids = train_ids({file("doc.txt").string()},
                                  {"--tokenizer", tokenizer_spec, "--chunk-kib", chunk_kib, "--threads", threads});
        ASSERT_EQ(ids.size(), expected.size()) << "chunk " << chunk_kib << " KiB, " << threads << " threads";
        EXPECT_TRUE(ids == expected) << "chunk " << chunk_kib << " KiB, " << threads << " threads";
      }
    }
  }

  fs::path dir_;
};

TEST_F(MakeShards, PlainTextEqualsOneEncodeCallByteTokenizer) {
  expect_equal_to_one_encode_call(awkward_text(300), "byte");
}

TEST_F(MakeShards, PlainTextEqualsOneEncodeCallSmallBpe) {
  expect_equal_to_one_encode_call(awkward_text(300), kSmallBpe.string());
}

TEST_F(MakeShards, PlainTextEqualsOneEncodeCallQwen3) {
  const auto qwen3 =
      test::find_data("LLMTRAIN_QWEN3_TOKENIZER", kRepositoryRoot / "../shared/data/qwen3-tokenizer/tokenizer.json");
  if (!qwen3) GTEST_SKIP() << "Qwen3 tokenizer.json not found: set LLMTRAIN_QWEN3_TOKENIZER";
  std::string text = test::read_file(kFixtures / "torture.txt");
  for (int i = 0; i < 40; ++i) text += test::read_file(kFixtures / "torture.txt") + awkward_text(i);
  expect_equal_to_one_encode_call(text, qwen3->string());
  if (const auto kjv = test::find_data("LLMTRAIN_KJV", kRepositoryRoot / "../shared/data/kjv.txt")) {
    expect_equal_to_one_encode_call(test::read_file(*kjv), qwen3->string());
  }
}

// One line with no line break: the cuts inside it (letter-space-letter, digit-digit) keep the ids
// of one encode call, also next to contractions, punctuation, combining marks and other scripts.
// Written in pieces of about 64 KiB, so a test holds no more than that.
void write_long_line(const fs::path& path, std::size_t bytes) {
  const std::string words[] = {
      "In",       " the",          " beginning", " 1234567", "'s",    " it's", " don't", ",",  " \u00e9t\u00e9",
      " e\u0301", " \u4e2d\u6587", "  two",      "\t",       " 3.14", "x9",    " A",     " b", "!!",
      " Zz"};
  std::ofstream out(path, std::ios::binary);
  std::string piece;
  for (std::size_t i = 0, written = 0; written < bytes; ++i) {
    piece += words[(i * 7 + i / 19) % std::size(words)];
    if (piece.size() >= (std::size_t{64} << 10)) {
      out << piece;
      written += piece.size();
      piece.clear();
    }
  }
}

TEST_F(MakeShards, LongLineCutInsideEqualsOneEncodeCall) {
  write_long_line(file("line.txt"), 100000);
  const std::string line = test::read_file(file("line.txt"));
  expect_equal_to_one_encode_call(line, kSmallBpe.string());
  if (const auto qwen3 = test::find_data("LLMTRAIN_QWEN3_TOKENIZER",
                                         kRepositoryRoot / "../shared/data/qwen3-tokenizer/tokenizer.json")) {
    expect_equal_to_one_encode_call(line, qwen3->string());
  }
}

// The largest resident memory (VmHWM, bytes) of `args` run as a program: read from /proc while it
// runs, since the peak the kernel reports for a child includes the test process it was forked
// from (that image alone is over 100 MB).
std::optional<double> peak_resident_bytes(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::freopen("/dev/null", "w", stdout);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  double peak = 0;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    std::ifstream proc("/proc/" + std::to_string(pid) + "/status");
    for (std::string line; std::getline(proc, line);) {
      // The high-water mark only grows once the program runs; before its exec it is the forked
      // test process's, so the last reading counts, not the largest.
      if (line.rfind("VmHWM:", 0) == 0) peak = std::atof(line.c_str() + 6) * 1024.0;
    }
    ::usleep(5000);
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  return peak;
}

// A single 16 MB line through a BPE tokenizer: encoded whole it needs about ten times its size
// (the line, its code points twice, the ids: 196 MB peak); cut into chunks, the peak stays near
// the program's baseline (about 30 MB).
TEST_F(MakeShards, LongLineMemoryIsBounded) {
  constexpr std::size_t kBytes = std::size_t{16} << 20;
  write_long_line(file("line.txt"), kBytes);
  const auto peak =
      peak_resident_bytes({LLMTRAIN_MAKE_SHARDS, file("line.txt").string(), "--tokenizer", kSmallBpe.string(),
                           "--threads", "2", "--chunk-kib", "256", "--train-out", file("train.tok").string()});
  ASSERT_TRUE(peak.has_value()) << "make_shards failed";
  std::printf("peak resident memory %.1f MB\n", *peak / 1e6);
  EXPECT_LT(*peak, 4.0 * kBytes) << "peak resident memory of make_shards on one 16 MB line";
  EXPECT_GT(text::TokenShard(file("train.tok")).size(), kBytes / 8);
}

TEST_F(MakeShards, ManyFilesWithSeparators) {
  const std::vector<std::string> texts = {"First document.\nTwo lines.\n", "", "Third <|endoftext|> one\n"};
  std::vector<std::string> paths;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    paths.push_back(file(std::to_string(i) + "_doc.txt").string());
    write_file(paths.back(), texts[i]);
  }
  auto encoded = [&](const std::string& spec) {
    std::vector<Ids> documents;
    for (const auto& t : texts) documents.push_back(text::make_tokenizer(spec)->encode(t));
    return documents;
  };
  // byte: no separator unless asked (as before); --separator TEXT gives its ids; --separator-id one id.
  EXPECT_EQ(train_ids(paths, {"--tokenizer", "byte"}), concat(encoded("byte"), {}));
  EXPECT_EQ(train_ids(paths, {"--tokenizer", "byte", "--separator", "\n\n"}), concat(encoded("byte"), {10, 10}));
  EXPECT_EQ(train_ids(paths, {"--tokenizer", "byte", "--separator-id", "0"}), concat(encoded("byte"), {0}));
  // BPE: the end-of-text id by default, '' for none.
  const std::string bpe = kSmallBpe.string();
  const Result r =
      make_shards({paths[0], paths[1], paths[2], "--tokenizer", bpe, "--train-out", file("train.tok").string()});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(shard_ids(file("train.tok")), concat(encoded(bpe), {kSmallEndOfText}));
  EXPECT_NE(r.output.find("3 documents, separator [299]"), std::string::npos) << r.output;
  EXPECT_EQ(train_ids(paths, {"--tokenizer", bpe, "--separator", ""}), concat(encoded(bpe), {}));
  EXPECT_EQ(train_ids(paths, {"--tokenizer", bpe, "--separator-id", "5"}), concat(encoded(bpe), {5}));
  const Result outside =
      make_shards({paths[0], "--tokenizer", bpe, "--separator-id", "300", "--train-out", file("x.tok").string()});
  EXPECT_EQ(outside.status, 2);
  EXPECT_NE(outside.output.find("outside the vocabulary"), std::string::npos) << outside.output;
}

TEST_F(MakeShards, JsonlDocuments) {
  const std::vector<std::string> documents = {"Hello world.\nSecond line with \"quotes\" and \\ backslash.", "",
                                              "caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87\ttab", "last one\n"};
  std::string a = json_line("text", documents[0]) + "\n" + json_line("text", documents[1]) + "\n\n   \n";
  std::string b = json_line("text", documents[2]) + "\r\n" + json_line("text", documents[3]);  // no final newline
  write_file(file("a.jsonl"), a);
  write_file(file("b.jsonl"), b);
  const std::string bpe = kSmallBpe.string();
  std::vector<Ids> encoded;
  for (const auto& d : documents) encoded.push_back(text::make_tokenizer(bpe)->encode(d));
  const Result r = make_shards({file("a.jsonl").string(), file("b.jsonl").string(), "--jsonl-field", "text",
                                "--tokenizer", bpe, "--chunk-kib", "1", "--train-out", file("train.tok").string()});
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(shard_ids(file("train.tok")), concat(encoded, {kSmallEndOfText}));
  EXPECT_NE(r.output.find("a.jsonl: " + std::to_string(a.size()) + " bytes, 2 documents"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("b.jsonl: " + std::to_string(b.size()) + " bytes, 2 documents"), std::string::npos)
      << r.output;

  // Standard input as '-'.
  const Result piped =
      make_shards({"-", "--jsonl-field", "text", "--tokenizer", bpe, "--train-out", file("stdin.tok").string()},
                  file("a.jsonl").string());
  ASSERT_EQ(piped.status, 0) << piped.output;
  EXPECT_EQ(shard_ids(file("stdin.tok")), concat({encoded[0], encoded[1]}, {kSmallEndOfText}));

  // Bad lines: named by file and line.
  const auto expect_refused = [&](const std::string& content, const std::string& field, const std::string& message) {
    write_file(file("bad.jsonl"), content);
    const Result bad = make_shards({file("a.jsonl").string(), file("bad.jsonl").string(), "--jsonl-field", field,
                                    "--train-out", file("bad.tok").string()});
    EXPECT_EQ(bad.status, 2) << bad.output;
    EXPECT_NE(bad.output.find(message), std::string::npos) << bad.output;
    EXPECT_FALSE(fs::exists(file("bad.tok")));
  };
  const std::string where = file("bad.jsonl").string() + ":3: ";
  expect_refused("{\"text\": \"ok\"}\n\n{\"text\": 5}\n", "text", where + "'text' is number, not a string");
  expect_refused("{\"text\": \"ok\"}\n\n{\"body\": \"x\"}\n", "text", where + "no key 'text'");
  expect_refused("{\"text\": \"ok\"}\n\n{\"text\": \"x\"\n", "text", where + "not a JSON line");
  expect_refused("{\"text\": \"ok\"}\n\n[1, 2]\n", "text", where + "no key 'text'");
}

TEST_F(MakeShards, ValEverySplitIsDeterministic) {
  std::string corpus;
  std::vector<std::string> documents;
  for (int d = 0; d < 500; ++d) {
    documents.push_back("Document " + std::to_string(d) + ": " + awkward_text(d % 5 + 1));
    corpus += json_line("text", documents.back()) + "\n";
  }
  write_file(file("corpus.jsonl"), corpus);
  const std::string bpe = kSmallBpe.string();
  std::vector<Ids> train_docs, val_docs;
  for (int d = 0; d < 500; ++d) {
    (d % 7 == 6 ? val_docs : train_docs)
        .push_back(text::make_tokenizer(bpe)->encode(documents[static_cast<std::size_t>(d)]));
  }
  std::optional<std::string> first_train, first_val;
  for (const char* threads : {"1", "3", "8"}) {
    for (const char* chunk_kib : {"1", "16"}) {
      const Result r = make_shards({file("corpus.jsonl").string(), "--jsonl-field", "text", "--tokenizer", bpe,
                                    "--val-every", "7", "--threads", threads, "--chunk-kib", chunk_kib, "--train-out",
                                    file("train.tok").string(), "--val-out", file("val.tok").string()});
      ASSERT_EQ(r.status, 0) << r.output;
      if (!first_train) {
        EXPECT_EQ(shard_ids(file("train.tok")), concat(train_docs, {kSmallEndOfText}));
        EXPECT_EQ(shard_ids(file("val.tok")), concat(val_docs, {kSmallEndOfText}));
        first_train = test::read_file(file("train.tok"));
        first_val = test::read_file(file("val.tok"));
      } else {  // byte-identical shards whatever the threads and chunks
        EXPECT_TRUE(test::read_file(file("train.tok")) == *first_train) << threads << " threads, chunk " << chunk_kib;
        EXPECT_TRUE(test::read_file(file("val.tok")) == *first_val) << threads << " threads, chunk " << chunk_kib;
      }
    }
  }
}

TEST_F(MakeShards, ValFractionTakesTheLastTokens) {
  write_file(file("a.txt"), awkward_text(50));
  write_file(file("b.txt"), awkward_text(20));
  const std::string bpe = kSmallBpe.string();
  const Ids all =
      concat({text::make_tokenizer(bpe)->encode(awkward_text(50)), text::make_tokenizer(bpe)->encode(awkward_text(20))},
             {kSmallEndOfText});
  for (const char* threads : {"1", "4"}) {
    const Result r = make_shards({file("a.txt").string(), file("b.txt").string(), "--tokenizer", bpe, "--val-fraction",
                                  "0.3", "--threads", threads, "--chunk-kib", "2", "--train-out",
                                  file("train.tok").string(), "--val-out", file("val.tok").string()});
    ASSERT_EQ(r.status, 0) << r.output;
    const auto val_count = static_cast<std::size_t>(std::llround(0.3 * static_cast<double>(all.size())));
    const Ids train = shard_ids(file("train.tok")), val = shard_ids(file("val.tok"));
    EXPECT_EQ(train, Ids(all.begin(), all.end() - static_cast<std::ptrdiff_t>(val_count)));
    EXPECT_EQ(val, Ids(all.end() - static_cast<std::ptrdiff_t>(val_count), all.end()));
    EXPECT_EQ(fs::file_size(file("train.tok")), text::kTokenShardHeaderBytes + 2 * train.size());  // u16 ids
  }
}

TEST_F(MakeShards, BadInputsRefusedLeavingOutputsAlone) {
  write_file(file("train.tok"), "previous");
  write_file(file("ok.txt"), "text\n");
  const auto expect_refused = [&](std::vector<std::string> args, const std::string& message) {
    args.insert(args.end(), {"--train-out", file("train.tok").string()});
    const Result r = make_shards(args);
    EXPECT_EQ(r.status, 2) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
    EXPECT_EQ(test::read_file(file("train.tok")), "previous");
    for (const auto& entry : fs::directory_iterator(dir_)) {
      EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
    }
  };
  expect_refused({file("ok.txt").string(), file("missing.txt").string()},
                 "cannot open input '" + file("missing.txt").string());
  expect_refused({file("ok.txt").string(), dir_.string()}, "is a folder");
  expect_refused({file("ok.txt").string(), "--val-every", "3"}, "need --val-out");
  write_file(file("invalid.txt"), "fine\nthen \xff invalid UTF-8\n");
  expect_refused({file("ok.txt").string(), file("invalid.txt").string(), "--tokenizer", kSmallBpe.string()},
                 "input '" + file("invalid.txt").string() + "' (bytes 0..");
}

}  // namespace
