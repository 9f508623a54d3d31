// A communicator for single-process tests of what issues device collectives: the host collectives
// answer as the only rank would (this rank's value back) and there is nothing to synchronise; the
// device collectives are left to each test, which counts or records them.
#pragma once

#include <string>
#include <vector>

#include "comm/communicator.h"

namespace test {

class HostStubCommunicator : public comm::Communicator {
 public:
  explicit HostStubCommunicator(comm::Placement placement = {}) : Communicator(placement) {}

  void barrier(const char*) override {}
  double all_reduce_host(double value, comm::ReduceOp, const char*) override { return value; }
  std::vector<double> all_reduce_host(std::vector<double> values, comm::ReduceOp, const char*) override {
    return values;
  }
  std::vector<std::string> gather_strings(const std::string& mine, int, const char*) override { return {mine}; }
  std::string broadcast_string(const std::string& text, int, const char*) override { return text; }
  void synchronize() override {}
  void mark_first_step_done() override {}
};

}  // namespace test
