// TensorBoard event files: our writer's file read back (both checksums of every record, the file
// version first, steps, tags, float32 values, wall times, the text sample, the SessionLog START),
// a file written by the `tensorboard` Python package (tests/fixtures/tensorboard, made by
// make_tensorboard_fixture.py) read back with the values that script wrote, a corrupted or
// truncated file refused with the record's offset, and a second writer never reusing a file.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "core/error.h"
#include "trainer/tensorboard.h"

namespace {

namespace fs = std::filesystem;
using trainer::TensorBoardEvent;

std::string read_bytes(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream content;
  content << file.rdbuf();
  return std::move(content).str();
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

class TensorBoardFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("llmtrain_tb_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(TensorBoardFiles, WriterRecordsReadBackWithValuesAndSteps) {
  const double before = trainer::unix_time_now();
  fs::path path;
  const std::string sample =
      "step 20: **In the beginning** \xc3\xbcn\xc3\xaf"
      "c\xc3\xb6"
      "d\xc3\xa9\n| a | b |";
  {
    trainer::TensorBoardWriter writer(dir_ / "tb", 11);
    path = writer.path();
    EXPECT_EQ(path.parent_path(), dir_ / "tb");
    const std::string name = path.filename().string();
    EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
    EXPECT_NE(name.find(std::to_string(::getpid())), std::string::npos) << name;
    for (std::int64_t step = 11; step <= 30; ++step) {
      const double t = 1700000000.0 + 0.25 * static_cast<double>(step);
      writer.add_scalar("train/loss", step, 10.0 / static_cast<double>(step) + 1e-9, t);
      writer.add_scalar("lr", step, 3e-4 * std::sin(static_cast<double>(step)), t);
      if (step % 10 == 0) writer.add_scalar("val_loss", step, 2.5 + static_cast<double>(step), t);
      if (step == 20) writer.add_text("samples", step, sample, t);
    }
    writer.add_scalar("big_step", std::int64_t{1} << 40, -1.0e30, 1.0);
    writer.add_scalar("zero_step", 0, 0.0, 2.0);
    writer.flush();
    // Readable while the writer is open, after flush.
    EXPECT_GE(trainer::read_tensorboard_events(path).size(), 40u);
  }
  const std::vector<TensorBoardEvent> events = trainer::read_tensorboard_events(path);
  ASSERT_EQ(events.size(), 1u + 1u + 20u * 2u + 2u + 1u + 2u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_TRUE(events[0].values.empty());
  EXPECT_GE(events[0].wall_time, before - 1.0);
  EXPECT_LE(events[0].wall_time, trainer::unix_time_now() + 1.0);
  EXPECT_EQ(events[1].session_status, 1);
  EXPECT_EQ(events[1].step, 11);
  EXPECT_EQ(events[1].wall_time, events[0].wall_time);
  EXPECT_TRUE(events[1].values.empty());

  std::size_t i = 2;
  for (std::int64_t step = 11; step <= 30; ++step) {
    const double t = 1700000000.0 + 0.25 * static_cast<double>(step);
    auto expect_scalar = [&](const std::string& tag, double value) {
      ASSERT_LT(i, events.size());
      const TensorBoardEvent& e = events[i++];
      EXPECT_EQ(e.step, step);
      EXPECT_EQ(e.wall_time, t);
      EXPECT_TRUE(e.file_version.empty());
      ASSERT_EQ(e.values.size(), 1u);
      EXPECT_EQ(e.values[0].tag, tag);
      ASSERT_TRUE(e.values[0].simple_value.has_value()) << tag << " at " << step;
      EXPECT_EQ(*e.values[0].simple_value, static_cast<float>(value)) << tag << " at " << step;
      EXPECT_EQ(e.values[0].tensor_dtype, 0);
    };
    expect_scalar("train/loss", 10.0 / static_cast<double>(step) + 1e-9);
    expect_scalar("lr", 3e-4 * std::sin(static_cast<double>(step)));
    if (step % 10 == 0) expect_scalar("val_loss", 2.5 + static_cast<double>(step));
    if (step == 20) {
      const TensorBoardEvent& e = events[i++];
      EXPECT_EQ(e.step, 20);
      ASSERT_EQ(e.values.size(), 1u);
      EXPECT_EQ(e.values[0].tag, "samples");
      EXPECT_EQ(e.values[0].plugin, "text");
      EXPECT_EQ(e.values[0].tensor_dtype, 7);
      EXPECT_FALSE(e.values[0].simple_value.has_value());
      EXPECT_EQ(e.values[0].tensor_strings, std::vector<std::string>{sample});
    }
  }
  EXPECT_EQ(events[i].step, std::int64_t{1} << 40);
  EXPECT_EQ(*events[i].values.at(0).simple_value, -1.0e30f);
  EXPECT_EQ(events[i + 1].step, 0);
  EXPECT_EQ(*events[i + 1].values.at(0).simple_value, 0.0f);
  EXPECT_EQ(events[i + 1].wall_time, 2.0);
}

TEST_F(TensorBoardFiles, SecondWriterOpensANewFileAndKeepsTheFirst) {
  fs::path first, second;
  {
    trainer::TensorBoardWriter a(dir_, 1);
    a.add_scalar("loss", 1, 3.0);
    first = a.path();
  }
  const std::string first_bytes = read_bytes(first);
  {
    trainer::TensorBoardWriter b(dir_, 2);  // a resumed run: same folder, same second, same process
    b.add_scalar("loss", 2, 2.0);
    second = b.path();
  }
  EXPECT_NE(first, second);
  EXPECT_EQ(read_bytes(first), first_bytes);
  EXPECT_EQ(event_files(dir_), (std::vector<fs::path>{first, second}));  // names sort in opening order
  const auto events = trainer::read_tensorboard_events(second);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[1].session_status, 1);
  EXPECT_EQ(events[1].step, 2);
  EXPECT_EQ(events[2].step, 2);
  EXPECT_EQ(*events[2].values.at(0).simple_value, 2.0f);
}

TEST_F(TensorBoardFiles, CorruptOrTruncatedRecordsRefusedWithTheirOffset) {
  fs::path path;
  {
    trainer::TensorBoardWriter writer(dir_, 1);
    writer.add_scalar("loss", 1, 1.5);
    writer.add_scalar("loss", 2, 1.25);
    path = writer.path();
  }
  const std::string good = read_bytes(path);
  const auto events = trainer::read_tensorboard_events(path);
  ASSERT_EQ(events.size(), 4u);
  // Record starts: each record is a 12-byte header, its data and a 4-byte data checksum.
  std::size_t offset = 0;
  std::vector<std::size_t> starts;
  while (offset < good.size()) {
    starts.push_back(offset);
    std::uint64_t length;
    std::memcpy(&length, good.data() + offset, 8);
    offset += 12 + length + 4;
  }
  ASSERT_EQ(starts.size(), 4u);
  ASSERT_EQ(offset, good.size());

  const auto expect_refused = [&](const std::string& bytes, const std::string& what) {
    write_bytes(path, bytes);
    try {
      trainer::read_tensorboard_events(path);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const core::InputError& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
    }
  };
  std::string bad = good;
  bad[starts[3] + 14] ^= 0x01;  // a data byte of the last record
  expect_refused(bad, "record at byte " + std::to_string(starts[3]) + ": data checksum mismatch");
  bad = good;
  bad[starts[1] + 1] ^= 0x40;  // the length of the second record
  expect_refused(bad, "record at byte " + std::to_string(starts[1]) + ": length checksum mismatch");
  bad = good;
  bad[good.size() - 1] ^= 0x80;  // the data checksum itself
  expect_refused(bad, "data checksum mismatch");
  expect_refused(good.substr(0, good.size() - 2), "record at byte " + std::to_string(starts[3]) + ": truncated");
  expect_refused(good.substr(0, starts[3] + 5), "truncated header");
  write_bytes(path, good);
  EXPECT_EQ(trainer::read_tensorboard_events(path).size(), 4u);
}

TEST_F(TensorBoardFiles, UncreatableFolderRefusedByName) {
  fs::create_directories(dir_);
  write_bytes(dir_ / "file", "x");
  try {
    trainer::TensorBoardWriter writer(dir_ / "file" / "tb", 1);
    FAIL() << "a folder under a regular file was accepted";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find((dir_ / "file" / "tb").string()), std::string::npos) << e.what();
  }
}

// Written by tensorboard's EventFileWriter (make_tensorboard_fixture.py documents the records).
TEST(TensorBoardFixture, PythonWrittenFileReadsBackWithItsValues) {
  const auto events =
      trainer::read_tensorboard_events(fs::path(LLMTRAIN_FIXTURES_DIR) / "tensorboard" / "events.out.tfevents.fixture");
  ASSERT_EQ(events.size(), 1u + 5u + 1u + 1u + 1u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_GT(events[0].wall_time, 1.6e9);
  std::size_t i = 1;
  for (std::int64_t step = 1; step <= 5; ++step) {
    const TensorBoardEvent& e = events[i++];
    EXPECT_EQ(e.step, step);
    EXPECT_EQ(e.wall_time, 1700000000.0 + static_cast<double>(step));
    ASSERT_EQ(e.values.size(), 2u);
    EXPECT_EQ(e.values[0].tag, "loss");
    EXPECT_EQ(e.values[0].simple_value, static_cast<float>(5.0 - 0.25 * static_cast<double>(step)));
    EXPECT_EQ(e.values[1].tag, "lr");
    EXPECT_EQ(e.values[1].simple_value, static_cast<float>(1e-3 * static_cast<double>(step)));
    if (step == 3) {
      const TensorBoardEvent& t = events[i++];
      EXPECT_EQ(t.step, 3);
      ASSERT_EQ(t.values.size(), 1u);
      EXPECT_EQ(t.values[0].tag, "samples");
      EXPECT_EQ(t.values[0].plugin, "text");
      EXPECT_EQ(t.values[0].tensor_dtype, 7);
      EXPECT_EQ(t.values[0].tensor_strings,
                std::vector<std::string>{"sample at step 3: **In the beginning** \xc3\xbcn\xc3\xaf"
                                         "c\xc3\xb6"
                                         "d\xc3\xa9\nsecond line"});
    }
    if (step == 4) {
      const TensorBoardEvent& s = events[i++];
      EXPECT_EQ(s.step, 4);
      EXPECT_EQ(s.session_status, 1);
      EXPECT_TRUE(s.values.empty());
    }
    if (step == 5) {
      const TensorBoardEvent& v = events[i++];
      EXPECT_EQ(v.step, 5);
      ASSERT_EQ(v.values.size(), 1u);
      EXPECT_EQ(v.values[0].tag, "val_loss");
      EXPECT_EQ(v.values[0].plugin, "scalars");
      EXPECT_EQ(v.values[0].tensor_dtype, 1);
      EXPECT_FALSE(v.values[0].simple_value.has_value());
      EXPECT_EQ(v.values[0].tensor_numbers, std::vector<double>{3.25});
    }
  }
  EXPECT_EQ(i, events.size());
}

}  // namespace
