// A small flight recorder of collectives, one record per rank in shared memory: every collective
// a rank enters bumps its sequence number and records the operation, its label and its bytes.
// The records live in files under /dev/shm (the temporary directory where /dev/shm is absent)
// named by a token all ranks of the job share, so a rank whose watchdog fires can read every
// other rank's record even when that rank is stopped or wedged, and name the rank that is behind
// and the collective it never joined (in the spirit of PyTorch's NCCL flight recorder).
#pragma once

#include <cstdint>
#include <string>

namespace comm {

class ProgressRecord {
 public:
  // `job`: a token the ranks agreed on (file names); rank and world of this process.
  ProgressRecord(const std::string& job, int rank, int world);
  ~ProgressRecord();  // unmaps and removes this rank's file
  ProgressRecord(const ProgressRecord&) = delete;
  ProgressRecord& operator=(const ProgressRecord&) = delete;

  // Before a collective: its sequence number (1, 2, ...) is recorded with what it is.
  void enter(const char* operation, const char* what, std::uint64_t bytes);
  // After it completed on this rank.
  void leave();

  // Who holds up the collective this rank waits in: every rank's last entered collective, the
  // ranks behind this one named with the collective they never joined. Empty when nothing is known.
  std::string diagnose() const;

 private:
  struct Record;
  std::string path(int rank) const;

  std::string job_;
  int rank_ = 0, world_ = 1;
  Record* record_ = nullptr;  // mapped
};

}  // namespace comm
