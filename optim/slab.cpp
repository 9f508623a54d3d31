#include "optim/slab.h"

#include <cstdint>

#include "core/error.h"
#include "core/half.h"

namespace optim {

SlabCoverage slab_coverage(const SlabLayout& layout, const SlabOptions& options) {
  if (options.zero_stage < 0 || options.zero_stage > 3) {
    throw core::Error("slab: zero_stage must be 0, 1, 2 or 3, got " + std::to_string(options.zero_stage));
  }
  if (options.shard_gradients && options.zero_stage < 2) {
    throw core::Error("slab: shard_gradients needs zero_stage 2 or 3, got zero_stage " +
                      std::to_string(options.zero_stage));
  }
  const Range full{0, layout.total_elements()};
  const Range shard = layout.shard(options.rank);  // validates the rank at every stage
  SlabCoverage c;
  c.owned = options.zero_stage >= 1 ? shard : full;
  c.grad = options.shard_gradients ? c.owned : full;
  c.mirror = options.zero_stage >= 3 ? c.owned : full;
  return c;
}

Slab::Slab(SlabLayout layout, const core::DeviceContext& context, SlabOptions options)
    : layout_(std::move(layout)), device_(context.device()), options_(options) {
  if (options_.mirror_dtype != core::DType::bf16 && options_.mirror_dtype != core::DType::f16) {
    throw core::Error("slab: mirror dtype must be bf16 or f16, got " +
                      std::string(core::dtype_name(options_.mirror_dtype)));
  }
  const SlabCoverage coverage = slab_coverage(layout_, options_);
  owned_ = coverage.owned;
  grad_covers_ = coverage.grad;
  mirror_covers_ = coverage.mirror;

  master_ = core::Buffer(device_, static_cast<std::size_t>(owned_.size()) * sizeof(float));
  grad_ = core::Buffer(device_, static_cast<std::size_t>(grad_covers_.size()) * sizeof(float));
  mirror_ =
      core::Buffer(device_, static_cast<std::size_t>(mirror_covers_.size()) * core::dtype_size(options_.mirror_dtype));
  for (core::Buffer* b : {&master_, &grad_, &mirror_}) b->fill_bytes(0, context.stream());

  segments_ = make_segments(layout_, owned_);
  if (device_.is_cuda()) {
    segment_table_ = core::Buffer(device_, segments_.size() * sizeof(Segment));
    core::copy_bytes(segment_table_.data(), segments_.data(), segment_table_.bytes(), context.stream());
    context.synchronize();  // the host vector may be reallocated later; finish the copy now
  }
}

namespace {

// Indexing gradients (and the mirror) by global element keeps one kernel (and one CPU loop) for both layouts.
// The origin of a sharded buffer lies before its allocation, where pointer arithmetic on the
// buffer's pointer would be undefined; the shift is done on the address as an integer instead,
// and callers only dereference origin[i] for i in grad_covers(), which is inside the buffer.
std::uintptr_t origin_address(const core::Buffer& buffer, Range covers, std::size_t element_bytes) {
  const auto base = reinterpret_cast<std::uintptr_t>(buffer.data());
  return base - static_cast<std::uintptr_t>(covers.begin) * element_bytes;
}

}  // namespace

float* Slab::grad_origin() { return reinterpret_cast<float*>(origin_address(grad_, grad_covers_, sizeof(float))); }

const float* Slab::grad_origin() const {
  return reinterpret_cast<const float*>(origin_address(grad_, grad_covers_, sizeof(float)));
}

void* Slab::mirror_origin() {
  return reinterpret_cast<void*>(origin_address(mirror_, mirror_covers_, core::dtype_size(options_.mirror_dtype)));
}

const Segment* Slab::segment_table() const {
  return device_.is_cuda() ? segment_table_.as<Segment>() : segments_.data();
}

core::TensorView Slab::view(core::Buffer& buffer, core::DType dtype, Range covers, int index) const {
  const auto& tensors = layout_.tensors();
  if (index < 0 || static_cast<std::size_t>(index) >= tensors.size()) {
    throw core::Error("slab: tensor index " + std::to_string(index) + " out of range");
  }
  const SlabTensor& t = tensors[static_cast<std::size_t>(index)];
  if (!covers.contains(t.range())) {
    throw core::Error("slab: tensor '" + t.spec.name + "' [" + std::to_string(t.offset) + ", " +
                      std::to_string(t.offset + t.numel) + ") is not wholly inside this buffer's range [" +
                      std::to_string(covers.begin) + ", " + std::to_string(covers.end) + ")");
  }
  const std::size_t byte_offset = static_cast<std::size_t>(t.offset - covers.begin) * core::dtype_size(dtype);
  REQUIRE(byte_offset + static_cast<std::size_t>(t.numel) * core::dtype_size(dtype) <= buffer.bytes(),
          "slab view beyond the end of its buffer");
  return core::TensorView{static_cast<char*>(buffer.data()) + byte_offset, dtype, t.spec.shape, device_};
}

void Slab::write_mirror(const core::DeviceContext& context) {
  const std::int64_t n = owned_.size();
  const float* master = master_.as<float>();
  auto* mirror = static_cast<std::uint16_t*>(mirror_origin()) + owned_.begin;
  if (device_.is_cuda()) {
    launch_write_mirror(master, mirror, options_.mirror_dtype, n, context.stream());
    return;
  }
  const bool bf16 = options_.mirror_dtype == core::DType::bf16;
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    mirror[i] = bf16 ? core::float_to_bf16(master[i]) : core::float_to_fp16(master[i]);
  }
}

}  // namespace optim
