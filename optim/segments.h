// The table that lets one kernel launch cover every tensor of a slab range.
//
// A Segment is the part of one tensor inside the range a rank updates (the whole tensor on one
// rank; possibly a slice of it under ZeRO). A WorkChunk is a piece of one segment small enough
// for one thread block; kernels take the chunk list, so the number of launches never depends
// on the number of tensors. Both are plain structs shared by host and device code.
#pragma once

#include <cstdint>
#include <vector>

#include "optim/slab_layout.h"

namespace optim {

struct Segment {
  std::int64_t offset = 0;         // global element index of the first element
  std::int64_t length = 0;         // elements
  std::int64_t tensor_offset = 0;  // global index of the tensor's first element (position inside the tensor)
  std::int32_t tensor = 0;         // index into SlabLayout::parameters() (the logical tensors)
  float decay = 1.0f;              // 1: weight decay applies, 0: it does not
  float lr_scale = 1.0f;
  std::int32_t rows = 0;  // factored 2-D tensors: shape [rows, cols]; 0 otherwise
  std::int32_t cols = 0;
};

struct WorkChunk {
  std::int64_t offset = 0;   // global element index, a multiple of 4 (16-byte aligned in fp32)
  std::int32_t length = 0;   // elements, > 0
  std::int32_t segment = 0;  // index into the segment table
};

// Segments of every non-empty tensor part inside `range`, in slab order.
std::vector<Segment> make_segments(const SlabLayout& layout, Range range);

// Splits each segment into chunks of at most `chunk_elements` (a positive multiple of 64).
std::vector<WorkChunk> make_work_chunks(const std::vector<Segment>& segments, std::int64_t chunk_elements);

}  // namespace optim
