// Where every parameter lives in the slab's flat index space, and which part each rank owns.
//
// Invariants (DESIGN.md section 3):
// - tensors are placed in the order given, each starting at a multiple of 64 elements;
// - tensor offsets never depend on the world size, only the tail padding does;
// - the total is a multiple of world * 256, so every shard is whole 256-element blocks;
// - all indices are 64-bit.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "optim/param_spec.h"

namespace optim {

inline constexpr std::int64_t kTensorAlignment = 64;
inline constexpr std::int64_t kShardBlock = 256;

// Half-open range of global element indices.
struct Range {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  bool contains(const Range& r) const { return r.begin >= begin && r.end <= end; }
  Range intersect(const Range& r) const;
  bool operator==(const Range&) const = default;
};

struct SlabTensor {
  ParamSpec spec;
  std::int64_t offset = 0;  // global element index of the first element
  std::int64_t numel = 0;
  Range range() const { return {offset, offset + numel}; }
};

class SlabLayout {
 public:
  // Throws core::Error on an empty or duplicate name, a negative dimension or world_size < 1.
  SlabLayout(std::vector<ParamSpec> specs, int world_size);

  const std::vector<SlabTensor>& tensors() const { return tensors_; }
  int world_size() const { return world_size_; }
  std::int64_t used_elements() const { return used_; }     // end of the last tensor, aligned
  std::int64_t total_elements() const { return total_; }   // padded to world * 256
  std::int64_t parameter_count() const;                   // sum of numel, no padding
  std::int64_t shard_elements() const { return total_ / world_size_; }
  Range shard(int rank) const;

  // Index of the tensor called `name`, or -1.
  int find(std::string_view name) const;
  const SlabTensor& tensor(std::string_view name) const;  // throws core::Error when absent

 private:
  std::vector<SlabTensor> tensors_;
  int world_size_ = 1;
  std::int64_t used_ = 0;
  std::int64_t total_ = 0;
};

}  // namespace optim
