// Where every parameter lives in the slab's flat index space, and which part each rank owns.
//
// Invariants (DESIGN.md section 3):
// - tensors are placed in the order given, each starting at a multiple of 64 elements;
// - tensor offsets never depend on the world size, only the tail padding does;
// - the total is a multiple of world * 256, so every shard is whole 256-element blocks;
// - all indices are 64-bit.
//
// tensors() are the stored parameters (what models address, checkpoints list and Hugging Face
// tensors map into); parameters() the logical tensors the optimizers see: a stored parameter
// with parts (ParamSpec::parts) contributes one logical tensor per part, placed back to back
// inside it. A part must start at a multiple of 64 elements like any tensor (so the optimizers'
// vector loads and quantisation blocks keep their alignment); a parameter whose part boundaries
// are not (rows * columns not a multiple of 64: toy shapes only) stays one logical tensor and is
// listed by unsplit().
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_set>
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
  ParamSpec spec;           // for a logical part: the stored parameter's, with the part's name and shape
  std::int64_t offset = 0;  // global element index of the first element
  std::int64_t numel = 0;
  int stored = 0;  // index into tensors() of the stored parameter holding it
  Range range() const { return {offset, offset + numel}; }
};

class SlabLayout {
 public:
  // Throws core::Error on an empty or duplicate name, a negative dimension or world_size < 1.
  SlabLayout(std::vector<ParamSpec> specs, int world_size);

  const std::vector<SlabTensor>& tensors() const { return tensors_; }
  const std::vector<SlabTensor>& parameters() const { return parameters_; }
  // Names of the stored parameters with parts that could not be split (see above).
  const std::vector<std::string>& unsplit() const { return unsplit_; }
  bool has_parts() const { return parameters_.size() != tensors_.size(); }
  int world_size() const { return world_size_; }
  std::int64_t used_elements() const { return used_; }    // end of the last tensor, aligned
  std::int64_t total_elements() const { return total_; }  // padded to world * 256
  std::int64_t parameter_count() const;                   // sum of numel, no padding
  std::int64_t shard_elements() const { return total_ / world_size_; }
  Range shard(int rank) const;

  // Index of the tensor called `name`, or -1.
  int find(std::string_view name) const;
  const SlabTensor& tensor(std::string_view name) const;  // throws core::Error when absent

 private:
  void add_parameters(const SlabTensor& stored, std::unordered_set<std::string>& names);

  std::vector<SlabTensor> tensors_;
  std::vector<SlabTensor> parameters_;
  std::vector<std::string> unsplit_;
  int world_size_ = 1;
  std::int64_t used_ = 0;
  std::int64_t total_ = 0;
};

}  // namespace optim
