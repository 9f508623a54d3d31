#include "optim/segments.h"

#include <algorithm>
#include <limits>

#include "core/error.h"

namespace optim {

std::vector<Segment> make_segments(const SlabLayout& layout, Range range) {
  std::vector<Segment> segments;
  const auto& tensors = layout.parameters();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const SlabTensor& t = tensors[i];
    const Range part = t.range().intersect(range);
    if (part.empty()) continue;
    Segment s;
    s.offset = part.begin;
    s.length = part.size();
    s.tensor_offset = t.offset;
    s.tensor = static_cast<std::int32_t>(i);
    s.decay = t.spec.decay ? 1.0f : 0.0f;
    s.lr_scale = t.spec.lr_scale;
    if (t.spec.factored) {
      if (t.spec.shape[0] > std::numeric_limits<std::int32_t>::max() ||
          t.spec.shape[1] > std::numeric_limits<std::int32_t>::max()) {
        throw core::Error("factored parameter '" + t.spec.name + "' has a dimension over 2^31");
      }
      s.rows = static_cast<std::int32_t>(t.spec.shape[0]);
      s.cols = static_cast<std::int32_t>(t.spec.shape[1]);
    }
    segments.push_back(s);
  }
  return segments;
}

std::vector<WorkChunk> make_work_chunks(const std::vector<Segment>& segments, std::int64_t chunk_elements) {
  if (chunk_elements <= 0 || chunk_elements % kTensorAlignment != 0 ||
      chunk_elements > std::numeric_limits<std::int32_t>::max()) {
    throw core::Error("work chunk size must be a positive multiple of 64 below 2^31, got " +
                      std::to_string(chunk_elements));
  }
  std::vector<WorkChunk> chunks;
  for (std::size_t si = 0; si < segments.size(); ++si) {
    const Segment& s = segments[si];
    for (std::int64_t done = 0; done < s.length; done += chunk_elements) {
      WorkChunk c;
      c.offset = s.offset + done;
      c.length = static_cast<std::int32_t>(std::min(chunk_elements, s.length - done));
      c.segment = static_cast<std::int32_t>(si);
      chunks.push_back(c);
    }
  }
  return chunks;
}

}  // namespace optim
