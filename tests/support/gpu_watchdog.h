// A per-test time limit for GPU suites: a kernel that never finishes blocks the host in a device
// wait forever, so a listener ends the process with a message naming the test once it has run
// longer than the limit (LLMTRAIN_TEST_TIMEOUT_S, default 120 s). Include it in one source file
// of a test executable; it registers itself before the tests run.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace test {

class GpuWatchdog final : public ::testing::EmptyTestEventListener {
 public:
  GpuWatchdog() {
    if (const char* value = std::getenv("LLMTRAIN_TEST_TIMEOUT_S"); value != nullptr && std::atoi(value) > 0) {
      limit_ = std::chrono::seconds(std::atoi(value));
    }
    thread_ = std::thread([this] { watch(); });
  }
  ~GpuWatchdog() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    changed_.notify_all();
    thread_.join();
  }
  void OnTestStart(const ::testing::TestInfo& info) override {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = std::string(info.test_suite_name()) + "." + info.name();
    deadline_ = std::chrono::steady_clock::now() + limit_;
    changed_.notify_all();
  }
  void OnTestEnd(const ::testing::TestInfo&) override {
    std::lock_guard<std::mutex> lock(mutex_);
    running_.clear();
    changed_.notify_all();
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!done_) {
      if (running_.empty()) {
        changed_.wait(lock);
        continue;
      }
      if (changed_.wait_until(lock, deadline_) == std::cv_status::timeout && !running_.empty() &&
          std::chrono::steady_clock::now() >= deadline_) {
        std::fprintf(stderr, "\n[  FAILED  ] %s: still running after %lld s (a device wait that never returns?)\n",
                     running_.c_str(), static_cast<long long>(limit_.count()));
        std::fflush(stderr);
        std::_Exit(1);
      }
    }
  }

  std::chrono::seconds limit_{120};
  std::mutex mutex_;
  std::condition_variable changed_;
  std::string running_;
  std::chrono::steady_clock::time_point deadline_;
  bool done_ = false;
  std::thread thread_;
};

// Appends the watchdog to gtest's listeners at static initialisation (gtest owns it from then on).
inline const bool gpu_watchdog_registered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new GpuWatchdog);
  return true;
}();

}  // namespace test
