// The communicator of a job of one rank that runs without MPI (library callers, unit tests):
// every collective is already complete in place, so each one is a no-op.
#pragma once

#include <string>

#include "comm/communicator.h"
#include "core/error.h"

namespace comm {

class SingleRankCommunicator final : public Communicator {
 public:
  SingleRankCommunicator() : Communicator(Placement{}) {}

  void all_reduce(void*, core::DType, std::size_t, ReduceOp, const char*) override {}
  void reduce_scatter(void*, core::DType, std::size_t, ReduceOp, const char*) override {}
  void all_gather(void*, core::DType, std::size_t, const char*) override {}
  void broadcast(void*, core::DType, std::size_t, int, const char*) override {}
  // With one rank the reduction is a copy, which this communicator cannot make: it does not know
  // whether the buffers are host or device memory. Only the in-place form is a no-op.
  void reduce_into(const void* send, void* recv, core::DType, std::size_t count, ReduceOp, int,
                   const char* what) override {
    if (send != recv && count > 0) {
      throw core::Error(std::string("comm: out-of-place reduce '") + (what ? what : "") +
                        "' needs a communicator of the job's device (single-rank communicator)");
    }
  }
  void barrier(const char*) override {}
  double all_reduce_host(double value, ReduceOp, const char*) override { return value; }
  std::vector<double> all_reduce_host(std::vector<double> values, ReduceOp, const char*) override { return values; }
  std::vector<std::string> gather_strings(const std::string& mine, int, const char*) override { return {mine}; }
  std::string broadcast_string(const std::string& text, int, const char*) override { return text; }
  void synchronize() override {}
  void mark_first_step_done() override {}
};

}  // namespace comm
