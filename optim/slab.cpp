#include "optim/slab.h"

#include <cstdint>

#include "core/error.h"
#include "core/half.h"

namespace optim {

Slab::Slab(SlabLayout layout, const core::DeviceContext& context, SlabOptions options)
    : layout_(std::move(layout)), device_(context.device()), options_(options) {
  if (options_.zero_stage < 0 || options_.zero_stage > 2) {
    throw core::Error("slab: zero_stage must be 0, 1 or 2, got " + std::to_string(options_.zero_stage));
  }
  if (options_.mirror_dtype != core::DType::bf16 && options_.mirror_dtype != core::DType::f16) {
    throw core::Error("slab: mirror dtype must be bf16 or f16, got " +
                      std::string(core::dtype_name(options_.mirror_dtype)));
  }
  if (options_.shard_gradients && options_.zero_stage != 2) {
    throw core::Error("slab: shard_gradients needs zero_stage 2, got zero_stage " +
                      std::to_string(options_.zero_stage));
  }
  owned_ = options_.zero_stage >= 1 ? layout_.shard(options_.rank) : full();
  if (options_.zero_stage == 0) (void)layout_.shard(options_.rank);  // validates the rank
  grad_covers_ = options_.shard_gradients ? owned_ : full();

  const auto total = static_cast<std::size_t>(layout_.total_elements());
  master_ = core::Buffer(device_, static_cast<std::size_t>(owned_.size()) * sizeof(float));
  grad_ = core::Buffer(device_, static_cast<std::size_t>(grad_covers_.size()) * sizeof(float));
  mirror_ = core::Buffer(device_, total * core::dtype_size(options_.mirror_dtype));
  for (core::Buffer* b : {&master_, &grad_, &mirror_}) b->fill_bytes(0, context.stream());

  segments_ = make_segments(layout_, owned_);
  if (device_.is_cuda()) {
    segment_table_ = core::Buffer(device_, segments_.size() * sizeof(Segment));
    core::copy_bytes(segment_table_.data(), segments_.data(), segment_table_.bytes(), context.stream());
    context.synchronize();  // the host vector may be reallocated later; finish the copy now
  }
}

namespace {

// Indexing gradients by global element keeps one kernel (and one CPU loop) for both layouts.
// The origin of a sharded buffer lies before its allocation, where pointer arithmetic on the
// buffer's pointer would be undefined; the shift is done on the address as an integer instead,
// and callers only dereference origin[i] for i in grad_covers(), which is inside the buffer.
std::uintptr_t grad_origin_address(const core::Buffer& grad, Range covers) {
  const auto base = reinterpret_cast<std::uintptr_t>(grad.data());
  return base - static_cast<std::uintptr_t>(covers.begin) * sizeof(float);
}

}  // namespace

float* Slab::grad_origin() { return reinterpret_cast<float*>(grad_origin_address(grad_, grad_covers_)); }

const float* Slab::grad_origin() const {
  return reinterpret_cast<const float*>(grad_origin_address(grad_, grad_covers_));
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
  auto* mirror = mirror_.as<std::uint16_t>() + owned_.begin;
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
