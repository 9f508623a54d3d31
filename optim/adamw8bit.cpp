// adamw8bit: the work plan (chunks of whole quantisation blocks for quantised tensors, plain
// chunks for small ones), the state buffers, the update dispatch, and the CPU reference of the
// update -- the oracle the CUDA kernel (adamw8bit.cu) must match code for code.
#include "optim/adamw8bit.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "core/error.h"
#include "core/half.h"
#include "optim/adamw.h"
#include "optim/quantization.h"
#include "optim/update_epilogue.h"

namespace optim {

namespace {

std::int64_t segment_end(const Segment& s) { return s.offset + s.length; }

std::int64_t blocks_up(std::int64_t elements) { return (elements + kQuantBlock - 1) / kQuantBlock; }

// Appends the quantised chunks of the merged block range [first_block, end_block), which the
// quantised segments [first, end) cover.
void add_quantised_chunks(const std::vector<Segment>& q, std::size_t first, std::size_t end, std::int64_t first_block,
                          std::int64_t end_block, std::int64_t blocks_per_chunk, std::vector<AdamW8bitChunk>& chunks) {
  std::size_t s = first;
  std::int64_t b = first_block;
  while (b < end_block) {
    const std::int64_t chunk_block = b;
    while (s < end && segment_end(q[s]) <= chunk_block * kQuantBlock) ++s;
    std::size_t e = s;
    std::int64_t blocks = 0;
    while (b < end_block && blocks < blocks_per_chunk) {
      std::size_t next = e;
      while (next < end && q[next].offset < (b + 1) * kQuantBlock) ++next;
      if (blocks > 0 && next - s > static_cast<std::size_t>(kMaxChunkSegments)) break;
      e = next;
      ++b;
      ++blocks;
    }
    AdamW8bitChunk c;
    c.offset = chunk_block * kQuantBlock;
    c.length = static_cast<std::int32_t>(blocks * kQuantBlock);
    c.first_segment = static_cast<std::int32_t>(s);
    c.segment_count = static_cast<std::int32_t>(e - s);
    c.kind = ChunkKind::quantised;
    chunks.push_back(c);
  }
}

// The update of the quantised chunk `chunk` (all its blocks) under code Q.
template <Quantization Q>
struct QuantisedChunkCpu {
  using Codec = MomentCodec<Q>;

  float* master;
  float* grad;
  std::uint16_t* mirror;
  bool bf16;
  std::int64_t owned_begin;
  std::uint8_t* q_m;
  std::uint8_t* q_v;
  float* scale_m;
  float* scale_v;
  const Segment* segments;           // the chunk's quantised segments
  const AdamWElementParams* params;  // one per segment of the chunk
  int segment_count;
  bool skip;
  std::uint64_t seed;

  void run(const AdamW8bitChunk& chunk) const {
    int cursor = 0;
    float m[kQuantBlock], v[kQuantBlock];
    int owner[kQuantBlock];  // index into the chunk's segments, -1: not a quantised element
    for (std::int64_t base = chunk.offset; base < chunk.offset + chunk.length; base += kQuantBlock) {
      for (int e = 0; e < kQuantBlock; ++e) {
        const std::int64_t i = base + e;
        while (cursor < segment_count && segment_end(segments[cursor]) <= i) ++cursor;
        owner[e] = cursor < segment_count && segments[cursor].offset <= i ? cursor : -1;
      }
      if (skip) {
        for (int e = 0; e < kQuantBlock; ++e) {
          if (owner[e] >= 0) grad[base + e] = 0.0f;
        }
        continue;
      }
      const std::int64_t local = base - owned_begin;
      const std::int64_t block = local / kQuantBlock;
      const float old_scale_m = scale_m[block], old_scale_v = scale_v[block];
      float max_m = 0.0f, max_v = 0.0f;
      for (int e = 0; e < kQuantBlock; ++e) {
        if (owner[e] < 0) continue;
        const std::int64_t i = base + e, l = local + e;
        float mi = Codec::decode_m(q_m[l], old_scale_m);
        float vi = Codec::decode_v(q_v[l], old_scale_v);
        adamw_element_quantised(master[l], mi, vi, grad[i], params[owner[e]]);
        write_back(master[l], grad[i], mirror[i], bf16);
        m[e] = mi;
        v[e] = vi;
        max_m = std::fmax(max_m, std::fabs(mi));
        max_v = std::fmax(max_v, vi);
      }
      max_m = block_scale(max_m);
      max_v = block_scale(max_v);
      const CodeScale code_m = Codec::code_scale_m(max_m), code_v = Codec::code_scale_v(max_v);
      for (int e = 0; e < kQuantBlock; ++e) {
        std::uint8_t cm = 0, cv = 0;
        if (owner[e] >= 0) {
          const RoundingDraws u = Q == Quantization::companded ? rounding_draws(seed, base + e) : RoundingDraws{0, 0};
          cm = Codec::encode_m(m[e], code_m, u.m);
          cv = Codec::encode_v(v[e], code_v, u.v);
        }
        q_m[local + e] = cm;
        q_v[local + e] = cv;
      }
      scale_m[block] = max_m;
      scale_v[block] = max_v;
    }
  }
};

}  // namespace

AdamW8bitPlan plan_adamw8bit(const SlabLayout& layout, const std::vector<Segment>& segments, Range owned,
                             std::int64_t min_8bit_size, std::int64_t chunk_elements) {
  if (chunk_elements <= 0 || chunk_elements % kTensorAlignment != 0 ||
      chunk_elements > std::numeric_limits<std::int32_t>::max() / 2) {
    throw core::Error("adamw8bit: work chunk size must be a positive multiple of 64 below 2^30, got " +
                      std::to_string(chunk_elements));
  }
  if (owned.begin % kQuantBlock != 0 || owned.end % kQuantBlock != 0) {
    throw core::Error("adamw8bit: the owned range [" + std::to_string(owned.begin) + ", " + std::to_string(owned.end) +
                      ") is not a whole number of 256-element blocks");
  }
  AdamW8bitPlan plan;
  plan.owned_elements = owned.size();
  plan.owned_blocks = owned.size() / kQuantBlock;
  const auto& tensors = layout.parameters();
  for (std::size_t si = 0; si < segments.size(); ++si) {
    const Segment& seg = segments[si];
    if (tensors[static_cast<std::size_t>(seg.tensor)].numel >= min_8bit_size) {
      plan.quantised_segments.push_back(seg);
      continue;
    }
    for (std::int64_t done = 0; done < seg.length; done += chunk_elements) {
      AdamW8bitChunk c;
      c.offset = seg.offset + done;
      c.length = static_cast<std::int32_t>(std::min(chunk_elements, seg.length - done));
      c.first_segment = static_cast<std::int32_t>(si);
      c.segment_count = 1;
      c.kind = ChunkKind::fp32;
      c.state_offset = plan.small_elements + done;
      plan.chunks.push_back(c);
    }
    plan.small_elements += (seg.length + 3) / 4 * 4;  // keeps every segment 16-byte aligned
  }

  // Quantised chunks: the block ranges of the quantised segments, merged where they share or
  // touch a block, cut into chunks of whole blocks.
  const auto& q = plan.quantised_segments;
  const std::int64_t blocks_per_chunk = std::max<std::int64_t>(1, chunk_elements / kQuantBlock);
  for (std::size_t i = 0; i < q.size();) {
    const std::int64_t first_block = q[i].offset / kQuantBlock;
    std::int64_t end_block = blocks_up(segment_end(q[i]));
    std::size_t j = i + 1;
    while (j < q.size() && q[j].offset / kQuantBlock <= end_block) {
      end_block = std::max(end_block, blocks_up(segment_end(q[j])));
      ++j;
    }
    add_quantised_chunks(q, i, j, first_block, end_block, blocks_per_chunk, plan.chunks);
    i = j;
  }
  std::stable_sort(plan.chunks.begin(), plan.chunks.end(),
                   [](const AdamW8bitChunk& a, const AdamW8bitChunk& b) { return a.offset < b.offset; });
  return plan;
}

AdamW8bit::AdamW8bit(const OptimizerConfig& config, Slab& slab, const core::DeviceContext& context,
                     std::int64_t chunk_elements)
    : Optimizer(config, slab, context, chunk_elements),
      plan_(plan_adamw8bit(slab.layout(), slab.segments(), slab.owned(), config_.adamw8bit.min_8bit_size,
                           chunk_elements)),
      q_m_(make_state(core::DType::i8)),
      q_v_(make_state(core::DType::u8)) {
  auto zeroed = [&](std::int64_t count, std::size_t element_bytes) {
    core::Buffer b(context.device(), static_cast<std::size_t>(count) * element_bytes);
    b.fill_bytes(0, context.stream());
    return b;
  };
  scale_m_ = zeroed(plan_.owned_blocks, sizeof(float));
  scale_v_ = zeroed(plan_.owned_blocks, sizeof(float));
  small_m_ = zeroed(plan_.small_elements, sizeof(float));
  small_v_ = zeroed(plan_.small_elements, sizeof(float));
  if (on_cuda()) {
    chunk_table_ = core::Buffer(context.device(), plan_.chunks.size() * sizeof(AdamW8bitChunk));
    core::copy_bytes(chunk_table_.data(), plan_.chunks.data(), chunk_table_.bytes(), context.stream());
    quantised_segment_table_ = core::Buffer(context.device(), plan_.quantised_segments.size() * sizeof(Segment));
    core::copy_bytes(quantised_segment_table_.data(), plan_.quantised_segments.data(), quantised_segment_table_.bytes(),
                     context.stream());
  }
  context.synchronize();
}

std::vector<StateBuffer> AdamW8bit::state_buffers() {
  // The small tensors' state is packed: each fp32 chunk says where its elements' entries start.
  std::vector<StatePiece> small;
  for (const AdamW8bitChunk& c : plan_.chunks) {
    if (c.kind == ChunkKind::fp32) small.push_back({{c.offset, c.offset + c.length}, c.state_offset, c.length});
  }
  const Range owned = slab_.owned();
  const std::vector<StatePiece> blocks = {{owned, 0, plan_.owned_blocks}};
  return {{"q_m", core::DType::i8, &q_m_, {}, 1},
          {"q_v", core::DType::u8, &q_v_, {}, 1},
          {"scale_m", core::DType::f32, &scale_m_, blocks, kQuantBlock, true},
          {"scale_v", core::DType::f32, &scale_v_, blocks, kQuantBlock, true},
          {"small_m", core::DType::f32, &small_m_, small, 1, true},
          {"small_v", core::DType::f32, &small_v_, small, 1, true}};
}

void AdamW8bit::update(double lr) {
  const AdamWStepParams params = adamw_step_params(config_, lr);
  if (!on_cuda()) {
    update_cpu(params);
    return;
  }
  const AdamW8bitBuffers buffers{slab_.master().as<float>(), slab_.grad_origin(),  slab_.mirror_origin(),
                                 slab_.mirror_dtype(),       slab_.owned().begin,  q_m_.as<std::uint8_t>(),
                                 q_v_.as<std::uint8_t>(),    scale_m_.as<float>(), scale_v_.as<float>(),
                                 small_m_.as<float>(),       small_v_.as<float>()};
  launch_adamw8bit_update(buffers, chunk_table_.as<AdamW8bitChunk>(), static_cast<std::int64_t>(plan_.chunks.size()),
                          slab_.segment_table(), quantised_segment_table_.as<Segment>(), scalars(), params,
                          config_.adamw8bit.quantization, context().stream());
}

void AdamW8bit::update_cpu(const AdamWStepParams& params) {
  StepScalars& s = *scalars();
  const bool skip = skips_step(params.policy, s.nonfinite);
  const float clip = clip_coefficient(s.grad_sq_sum, params.max_norm);
  const long long t = s.step + 1;
  const std::uint64_t seed = rounding_seed(t);
  float* master = slab_.master().as<float>();
  float* grad = slab_.grad_origin();
  auto* mirror = static_cast<std::uint16_t*>(slab_.mirror_origin());
  const bool bf16 = slab_.mirror_dtype() == core::DType::bf16;
  const std::int64_t owned_begin = slab_.owned().begin;
  const auto& segments = slab_.segments();
  const auto& quantised = plan_.quantised_segments;
  const auto& work = plan_.chunks;
  const auto count = static_cast<std::int64_t>(work.size());
  const bool companded = config_.adamw8bit.quantization == Quantization::companded;

#pragma omp parallel for schedule(dynamic, 4)
  for (std::int64_t c = 0; c < count; ++c) {
    const AdamW8bitChunk& chunk = work[static_cast<std::size_t>(c)];
    if (chunk.kind == ChunkKind::fp32) {
      const Segment& seg = segments[static_cast<std::size_t>(chunk.first_segment)];
      const AdamWElementParams e = adamw_element_params(params, clip, t, seg.lr_scale, seg.decay);
      const AdamWSpanCpu span{master,
                              small_m_.as<float>() + chunk.state_offset,
                              small_v_.as<float>() + chunk.state_offset,
                              grad,
                              mirror,
                              bf16,
                              owned_begin};
      adamw_update_span_cpu(span, chunk.offset, chunk.length, e, skip);
      continue;
    }
    AdamWElementParams seg_params[kMaxChunkSegments];
    const Segment* chunk_segments = quantised.data() + chunk.first_segment;
    for (int k = 0; k < chunk.segment_count; ++k) {
      seg_params[k] = adamw_element_params(params, clip, t, chunk_segments[k].lr_scale, chunk_segments[k].decay);
    }
    auto run = [&](auto codec_tag) {
      constexpr Quantization Q = decltype(codec_tag)::value;
      const QuantisedChunkCpu<Q> kernel{master,
                                        grad,
                                        mirror,
                                        bf16,
                                        owned_begin,
                                        q_m_.as<std::uint8_t>(),
                                        q_v_.as<std::uint8_t>(),
                                        scale_m_.as<float>(),
                                        scale_v_.as<float>(),
                                        chunk_segments,
                                        seg_params,
                                        chunk.segment_count,
                                        skip,
                                        seed};
      kernel.run(chunk);
    };
    if (companded) {
      run(std::integral_constant<Quantization, Quantization::companded>{});
    } else {
      run(std::integral_constant<Quantization, Quantization::linear>{});
    }
  }
  finish_update(s, skip);
}

}  // namespace optim
