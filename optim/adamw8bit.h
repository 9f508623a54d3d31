// Fused multi-tensor 8-bit AdamW over the slab (optimizer.type: adamw8bit): AdamW's update in
// fp32 with m and v stored as one byte per element and one fp32 scale per 256-element block
// (optim/quantization.h has the codes). One statistics launch and one update launch per step
// whatever the number of tensors; the update dequantises, updates, takes each block's maxima and
// requantises inside the same kernel.
//
// State of the owned range [owned.begin, owned.end) (a whole number of 256-element blocks):
//   q_m (i8), q_v (u8): one code per element; scale_m, scale_v (f32): one per owned block, the
//   block maximum of |m| and of v over the block's quantised elements;
//   small_m, small_v (f32): plain AdamW state of the tensors with fewer than min_8bit_size
//   elements, packed (each segment at a multiple of 4), in segment order.
// Whether a tensor is quantised depends on its full size, never on the shard, so a tensor has
// the same kind of state whatever the world size. A block can hold the tail of one quantised
// tensor and the head of the next: the two then share the block's scales. Codes of elements
// that are not in a quantised tensor (small tensors, padding) are 0 and take no part in the
// maxima.
#pragma once

#include <cstdint>
#include <vector>

#include "optim/adamw_math.h"
#include "optim/optimizer.h"

namespace optim {

enum class ChunkKind : std::int32_t {
  fp32 = 0,       // elements of one small segment, fp32 state in small_m / small_v
  quantised = 1,  // whole 256-element blocks; only elements of quantised segments are updated
};

// One thread block's work in the update launch.
struct AdamW8bitChunk {
  std::int64_t offset = 0;         // global index of the first element (quantised: a multiple of 256)
  std::int32_t length = 0;         // elements (quantised: a multiple of 256)
  std::int32_t first_segment = 0;  // fp32: index into the slab's segment table;
                                   // quantised: into the quantised-segment table
  std::int32_t segment_count = 0;  // segments the chunk intersects (fp32: 1)
  ChunkKind kind = ChunkKind::fp32;
  std::int64_t state_offset = 0;  // fp32: index into small_m / small_v of the chunk's first element
};

// At most this many quantised segments intersect one quantised chunk (chunks are cut to keep it
// so; one block meets at most 4 segments, since tensors start at multiples of 64).
inline constexpr int kMaxChunkSegments = 16;

// The work list and state sizes of an adamw8bit optimizer, built on the host once.
struct AdamW8bitPlan {
  std::vector<Segment> quantised_segments;  // owned segments of tensors with numel >= min_8bit_size
  std::vector<AdamW8bitChunk> chunks;       // quantised chunks and fp32 chunks, by offset
  std::int64_t owned_elements = 0;          // bytes of q_m and of q_v
  std::int64_t owned_blocks = 0;            // entries of scale_m and of scale_v
  std::int64_t small_elements = 0;          // entries of small_m and of small_v

  std::int64_t state_bytes() const { return 2 * owned_elements + 8 * owned_blocks + 8 * small_elements; }
};

// `segments` are the owned segments of `layout` (Slab::segments()); `owned` is a whole number of
// blocks. Quantised chunks hold at most max(1, chunk_elements / 256) blocks, fp32 chunks at most
// chunk_elements elements (a positive multiple of 64).
AdamW8bitPlan plan_adamw8bit(const SlabLayout& layout, const std::vector<Segment>& segments, Range owned,
                             std::int64_t min_8bit_size, std::int64_t chunk_elements);

class AdamW8bit final : public Optimizer {
 public:
  AdamW8bit(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context,
            std::int64_t chunk_elements = kDefaultChunkElements);

  std::vector<StateBuffer> state_buffers() override;
  const AdamW8bitPlan& plan() const { return plan_; }
  core::Buffer& q_m() { return q_m_; }
  core::Buffer& q_v() { return q_v_; }
  core::Buffer& scale_m() { return scale_m_; }
  core::Buffer& scale_v() { return scale_v_; }
  core::Buffer& small_m() { return small_m_; }
  core::Buffer& small_v() { return small_v_; }

 private:
  void update(double lr) override;
  void update_cpu(const AdamWStepParams& params);

  AdamW8bitPlan plan_;
  core::Buffer chunk_table_;              // plan_.chunks on the device (cuda)
  core::Buffer quantised_segment_table_;  // plan_.quantised_segments on the device (cuda)
  core::Buffer q_m_;
  core::Buffer q_v_;
  core::Buffer scale_m_;
  core::Buffer scale_v_;
  core::Buffer small_m_;
  core::Buffer small_v_;
};

// Arguments of the update launch. master and the state cover the owned range starting at
// global index owned_begin; the mirror the whole slab; grad is Slab::grad_origin() (indexed by
// global element, covering Slab::grad_covers()).
struct AdamW8bitBuffers {
  float* master;
  float* grad;
  void* mirror;
  core::DType mirror_dtype;
  std::int64_t owned_begin;
  std::uint8_t* q_m;
  std::uint8_t* q_v;
  float* scale_m;
  float* scale_v;
  float* small_m;
  float* small_v;
};

void launch_adamw8bit_update(const AdamW8bitBuffers& buffers, const AdamW8bitChunk* chunks, std::int64_t num_chunks,
                             const Segment* segments, const Segment* quantised_segments, StepScalars* scalars,
                             const AdamWStepParams& params, Quantization quantization, cudaStream_t stream);

// Checks of the update kernel's shortcuts against the reference arithmetic, for the GPU tests
// (they run on the current CUDA device and synchronise).
namespace self_check {

// How many floats x in [2^-101, FLT_MAX] (every one) get a square root from the kernel's fast
// path (sqrt_rn_in_range) that differs from fp::sqrt's; 0 is expected.
std::uint64_t adamw8bit_sqrt_mismatches();

// The companded codes that the kernel's encoder (its fast path and the fallback it takes when
// that may be off) gives m[i] and v[i], in groups of 4 elements with one scale_m / scale_v (block
// maximum) per group and the 32-bit draw word of each element (m: low 16 bits, v: high 16 bits,
// as rounding_draws_from). m.size() is a multiple of 4.
void adamw8bit_companded_codes(const std::vector<float>& m, const std::vector<float>& v,
                               const std::vector<float>& scale_m, const std::vector<float>& scale_v,
                               const std::vector<std::uint32_t>& draws, std::vector<std::uint8_t>& code_m,
                               std::vector<std::uint8_t>& code_v);

}  // namespace self_check

}  // namespace optim
