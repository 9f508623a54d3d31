// The cpu backend's communicator: device collectives on host buffers through MPI (no CUDA at all).
#pragma once

#include <cstddef>
#include <memory>

#include "comm/host_communicator.h"

namespace comm {

class MpiCommunicator final : public detail::HostCommunicator {
 public:
  // `max_chunk_bytes`: the most one MPI call moves (larger collectives are split); tests lower it
  // to exercise the chunked paths with small buffers.
  MpiCommunicator(Placement placement, CommOptions options,
                  std::size_t max_chunk_bytes = detail::MpiComm::kDefaultMaxChunkBytes);

  void all_reduce(void* data, core::DType dtype, std::size_t count, ReduceOp op, const char* what) override;
  void reduce_scatter(void* data, core::DType dtype, std::size_t count_per_rank, ReduceOp op,
                      const char* what) override;
  void all_gather(void* data, core::DType dtype, std::size_t count_per_rank, const char* what) override;
  void broadcast(void* data, core::DType dtype, std::size_t count, int root, const char* what) override;
  void reduce_into(const void* send, void* recv, core::DType dtype, std::size_t count, ReduceOp op, int root,
                   const char* what) override;
  void synchronize() override {}
};

}  // namespace comm
