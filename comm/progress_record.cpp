#include "comm/progress_record.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace comm {

// One rank's record: written by its owner with plain stores, the sequence number last (release),
// read by other processes through their own mapping (acquire on the sequence number, then the
// fields; a torn read shows at worst a label of the neighbouring collective).
struct ProgressRecord::Record {
  std::uint64_t magic;
  std::int64_t pid;
  std::atomic<std::uint64_t> entered;   // sequence number of the last collective entered
  std::atomic<std::uint64_t> finished;  // sequence number of the last collective completed
  std::uint64_t bytes;
  char operation[32];
  char what[176];
};

namespace {

constexpr std::uint64_t kMagic = 0x6C6C6D7472616301ull;  // "llmtrac" v1

std::string directory() {
  std::error_code ec;
  if (std::filesystem::is_directory("/dev/shm", ec)) return "/dev/shm";
  return std::filesystem::temp_directory_path().string();
}

void copy_text(char* destination, std::size_t size, const char* text) {
  std::snprintf(destination, size, "%s", text ? text : "");
}

// ", process stopped" (or zombie) for a process of this host in that state; empty otherwise.
std::string process_state(std::int64_t pid) {
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return {};
  char buffer[512] = {};
  const std::size_t n = std::fread(buffer, 1, sizeof buffer - 1, f);
  std::fclose(f);
  const char* close = std::strrchr(buffer, ')');  // the state follows the parenthesised name
  if (n == 0 || close == nullptr || close[1] != ' ') return {};
  switch (close[2]) {
    case 'T':
    case 't': return ", process stopped";
    case 'Z': return ", process exited (zombie)";
    case 'D': return ", process in uninterruptible sleep";
    default: return {};
  }
}

}  // namespace

ProgressRecord::ProgressRecord(const std::string& job, int rank, int world) : job_(job), rank_(rank), world_(world) {
  const std::string file = path(rank);
  const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return;  // no record: diagnose() then says nothing of this rank
  if (::ftruncate(fd, sizeof(Record)) == 0) {
    void* p = ::mmap(nullptr, sizeof(Record), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      record_ = static_cast<Record*>(p);
      record_->pid = ::getpid();
      record_->entered.store(0, std::memory_order_relaxed);
      record_->finished.store(0, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_release);
      record_->magic = kMagic;
    }
  }
  ::close(fd);
}

ProgressRecord::~ProgressRecord() {
  if (record_ == nullptr) return;
  ::munmap(record_, sizeof(Record));
  ::unlink(path(rank_).c_str());
}

std::string ProgressRecord::path(int rank) const {
  return directory() + "/llmtrain-progress." + job_ + "." + std::to_string(rank);
}

void ProgressRecord::enter(const char* operation, const char* what, std::uint64_t bytes) {
  if (record_ == nullptr) return;
  copy_text(record_->operation, sizeof record_->operation, operation);
  copy_text(record_->what, sizeof record_->what, what);
  record_->bytes = bytes;
  record_->entered.fetch_add(1, std::memory_order_release);
}

void ProgressRecord::leave() {
  if (record_ == nullptr) return;
  record_->finished.store(record_->entered.load(std::memory_order_relaxed), std::memory_order_release);
}

std::string ProgressRecord::diagnose() const {
  if (record_ == nullptr) return {};
  const std::uint64_t mine = record_->entered.load(std::memory_order_acquire);
  std::string behind, others;
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const int fd = ::open(path(r).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      behind += "; rank " + std::to_string(r) + " has no progress record (it exited or never started)";
      continue;
    }
    void* p = ::mmap(nullptr, sizeof(Record), PROT_READ, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) continue;
    const auto* other = static_cast<const Record*>(p);
    if (other->magic == kMagic) {
      const std::uint64_t entered = other->entered.load(std::memory_order_acquire);
      const std::uint64_t finished = other->finished.load(std::memory_order_acquire);
      char line[512];
      std::snprintf(line, sizeof line, "rank %d (pid %lld) last entered collective #%llu %s '%s' (%llu bytes)%s", r,
                    static_cast<long long>(other->pid), static_cast<unsigned long long>(entered), other->operation,
                    other->what, static_cast<unsigned long long>(other->bytes),
                    finished == entered ? " and left it" : " and is still in it");
      const std::string state = process_state(other->pid);
      if (entered < mine) {
        behind += std::string("; rank ") + std::to_string(r) + " is behind: it never joined collective #" +
                  std::to_string(mine) + " (" + line + state + ")";
      } else if (entered == mine && finished < entered && !state.empty()) {
        behind += std::string("; rank ") + std::to_string(r) + " has not finished collective #" + std::to_string(mine) +
                  " (" + line + state + ")";
      } else {
        others += std::string("; ") + line;
      }
    }
    ::munmap(p, sizeof(Record));
  }
  if (behind.empty() && others.empty()) return {};
  return "this rank waits in collective #" + std::to_string(mine) + " " + record_->operation + " '" + record_->what +
         "'" + behind + others;
}

}  // namespace comm
