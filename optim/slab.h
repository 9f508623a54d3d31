// The slab (mega-buffer): every parameter's fp32 master weight, fp32 gradient and 16-bit
// forward copy (the mirror) in one contiguous buffer each, laid out by SlabLayout.
//
// With ZeRO stage >= 1 this rank keeps master weights (and the optimizer its state) only for
// its own shard; the mirror spans the whole slab up to ZeRO-2 and only the shard with ZeRO-3 (a
// model then reads its weights layer by layer through a gather, optim/weight_source.h); the
// gradient buffer spans the whole slab unless SlabOptions::shard_gradients cuts it to the shard.
// Every buffer is described by the global range it covers, so a view of tensor i is the same
// arithmetic in all of them, and the optimizers address gradients and the mirror by global
// element through grad_origin() and mirror_origin() whichever the layout.
#pragma once

#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "core/device.h"
#include "core/tensor.h"
#include "optim/segments.h"
#include "optim/slab_layout.h"

namespace optim {

struct SlabOptions {
  int rank = 0;
  int zero_stage = 0;                            // 0, 1, 2 or 3
  core::DType mirror_dtype = core::DType::bf16;  // bf16 or f16
  // ZeRO-2 and 3 only (the constructor throws otherwise): the gradient buffer covers owned()
  // instead of full(), for a trainer that reduces each gradient straight onto its owner.
  bool shard_gradients = false;
};

// The global ranges a slab's buffers cover: what the constructor allocates, and what a memory
// plan counts without allocating (trainer/memory_plan.h).
struct SlabCoverage {
  Range owned;   // master weights and optimizer state
  Range grad;    // fp32 gradients
  Range mirror;  // 16-bit forward copy
};
// Throws core::Error for a stage outside 0..3, a rank outside the layout's world, or
// shard_gradients below ZeRO-2.
SlabCoverage slab_coverage(const SlabLayout& layout, const SlabOptions& options);

class Slab {
 public:
  // Allocates and zeroes the buffers on the context's device.
  Slab(SlabLayout layout, const core::DeviceContext& context, SlabOptions options = {});

  const SlabLayout& layout() const { return layout_; }
  const core::Device& device() const { return device_; }
  int rank() const { return options_.rank; }
  int zero_stage() const { return options_.zero_stage; }
  bool shard_gradients() const { return options_.shard_gradients; }
  core::DType mirror_dtype() const { return options_.mirror_dtype; }

  Range full() const { return {0, layout_.total_elements()}; }
  // Elements whose master weights and optimizer state this rank keeps and updates.
  Range owned() const { return owned_; }
  // Elements the gradient buffer holds: owned() with shard_gradients, full() otherwise.
  Range grad_covers() const { return grad_covers_; }
  // Elements the mirror holds: owned() with ZeRO-3, full() otherwise.
  Range mirror_covers() const { return mirror_covers_; }

  core::Buffer& master() { return master_; }  // fp32, covers owned()
  core::Buffer& grad() { return grad_; }      // fp32, covers grad_covers()
  core::Buffer& mirror() { return mirror_; }  // mirror_dtype, covers mirror_covers()
  const core::Buffer& master() const { return master_; }
  const core::Buffer& grad() const { return grad_; }
  const core::Buffer& mirror() const { return mirror_; }

  // A pointer p with p[i] the gradient of global element i for every i in grad_covers() (the
  // buffer's start when it covers full(); owned().begin elements before it when sharded, an
  // address outside the buffer that is only ever indexed back into it). The optimizers read and
  // zero gradients through it, so one kernel serves both layouts.
  float* grad_origin();
  const float* grad_origin() const;
  // The same for the mirror: element i of mirror_dtype() at byte 2 * i for i in mirror_covers().
  void* mirror_origin();

  // Segments of the owned range (host copy, and the same table in device memory on cuda;
  // a host pointer on cpu). The table may be empty.
  const std::vector<Segment>& segments() const { return segments_; }
  const Segment* segment_table() const;

  // View of tensor `index` inside `buffer`, whose first element is global index `covers.begin`.
  // Throws when the tensor is not wholly inside `covers` (e.g. a sharded master or sharded
  // gradients under ZeRO).
  core::TensorView view(core::Buffer& buffer, core::DType dtype, Range covers, int index) const;
  core::TensorView master_view(int index) { return view(master_, core::DType::f32, owned_, index); }
  core::TensorView grad_view(int index) { return view(grad_, core::DType::f32, grad_covers_, index); }
  core::TensorView mirror_view(int index) { return view(mirror_, options_.mirror_dtype, mirror_covers_, index); }

  // Rewrites the owned part of the mirror from the master weights (after initialisation or a
  // load; the optimizer's update writes it as part of every step).
  void write_mirror(const core::DeviceContext& context);

 private:
  SlabLayout layout_;
  core::Device device_;
  SlabOptions options_;
  Range owned_;
  Range grad_covers_;
  Range mirror_covers_;
  core::Buffer master_;
  core::Buffer grad_;
  core::Buffer mirror_;
  std::vector<Segment> segments_;
  core::Buffer segment_table_;  // device copy of segments_ (cuda only)
};

// Kernel behind Slab::write_mirror on cuda: mirror[i] = round_to_nearest(master[i]) for n elements.
void launch_write_mirror(const float* master, void* mirror, core::DType mirror_dtype, std::int64_t n,
                         cudaStream_t stream);

}  // namespace optim
