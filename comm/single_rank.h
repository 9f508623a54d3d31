// The communicator of a job of one rank that runs without MPI (library callers, unit tests):
// every collective is already complete in place, so each one is a no-op.
#pragma once

#include "comm/communicator.h"

namespace comm {

class SingleRankCommunicator final : public Communicator {
 public:
  SingleRankCommunicator() : Communicator(Placement{}) {}

  void all_reduce(void*, core::DType, std::size_t, ReduceOp, const char*) override {}
  void reduce_scatter(void*, core::DType, std::size_t, ReduceOp, const char*) override {}
  void all_gather(void*, core::DType, std::size_t, const char*) override {}
  void reduce(void*, core::DType, std::size_t, ReduceOp, int, const char*) override {}
  void barrier(const char*) override {}
  double all_reduce_host(double value, ReduceOp, const char*) override { return value; }
  std::vector<double> all_reduce_host(std::vector<double> values, ReduceOp, const char*) override { return values; }
  std::vector<std::string> gather_strings(const std::string& mine, int, const char*) override { return {mine}; }
  std::string broadcast_string(const std::string& text, int, const char*) override { return text; }
  void synchronize() override {}
  void mark_first_step_done() override {}
};

}  // namespace comm
