// The language-model ends on one GPU (lm_ends_cuda.h).
#include "models/lm_ends_cuda.h"

#include <algorithm>
#include <string>

#include "core/error.h"
#include "models/ops/embedding.h"
#include "models/ops/rmsnorm.h"

namespace models {

optim::GradientSink* checked_sink(optim::GradientSink* sink, optim::GradientSink* fallback, std::int64_t largest,
                                  const char* what) {
  if (sink == nullptr) return fallback;
  const std::int64_t limit = sink->max_range_elements();
  if (limit > 0 && limit < largest) {
    throw core::Error(std::string(what) + ": the gradient sink takes ranges of at most " + std::to_string(limit) +
                      " elements; the backward needs " + std::to_string(largest));
  }
  return sink;
}

LmEndsLayout::LmEndsLayout(std::int64_t max_tokens, std::int64_t vocab, std::int64_t dim) {
  DeviceArena a;
  const auto n = static_cast<std::size_t>(max_tokens), d = static_cast<std::size_t>(dim);
  x_final_ = a.reserve(n * d * 2);
  x_norm_ = a.reserve(n * d * 2);
  rstd_ = a.reserve(n * 4);
  dx_ = a.reserve(n * d * 2);
  token_losses_ = a.reserve(n * 4);
  token_lse_ = a.reserve(n * 4);
  mean_loss_ = a.reserve(4);
  count_ = a.reserve(4);
  invalid_ = a.reserve(4);
  embed_workspace_bytes_ = ops::embedding_backward_workspace_bytes(max_tokens, vocab, dim);
  embed_workspace_ = a.reserve(embed_workspace_bytes_);
  total_ = a.size();
}

LmEndsCuda::LmEndsCuda(const core::DeviceContext& context, optim::Slab& slab, const LmEndsSpec& spec,
                       std::int64_t max_tokens)
    : LmEndsLayout(max_tokens, spec.vocab, spec.dim),
      stream_(context.stream()),
      slab_(slab),
      spec_(spec),
      cross_entropy_(context) {
  memory_ = core::Buffer(context.device(), total_);
  memory_.fill_bytes(0, stream_);
}

std::size_t LmEndsCuda::workspace_bytes(std::int64_t max_tokens, std::int64_t vocab, std::int64_t dim) {
  return std::max({ops::linear_workspace_bytes(), ops::cross_entropy_workspace_bytes(max_tokens, vocab),
                   ops::rmsnorm_backward_workspace_bytes(max_tokens, dim)});
}

const LmEndsCuda::bf16* LmEndsCuda::weight(int tensor) const {
  if (holds_ != nullptr && holds_->active()) return static_cast<const bf16*>(holds_->find(tensor));
  return reinterpret_cast<const bf16*>(slab_.mirror_view(tensor).data);
}
optim::Range LmEndsCuda::range_of(int tensor) const {
  return slab_.layout().tensors()[static_cast<std::size_t>(tensor)].range();
}
ops::CrossEntropyDeviceOutputs LmEndsCuda::loss_outputs() const {
  return {at<float>(token_losses_), at<float>(mean_loss_), at<std::int32_t>(count_)};
}

void LmEndsCuda::embed(const std::int32_t* ids, std::int64_t n, bf16* x0) {
  ops::embedding_forward_cuda(ids, n, weight(spec_.embed), spec_.vocab, spec_.dim, x0, at<std::int32_t>(invalid_),
                              stream_);
}

void LmEndsCuda::final_norm(std::int64_t n) {
  ops::rmsnorm_forward_cuda(at<bf16>(x_final_), weight(spec_.final_norm), n, spec_.dim, spec_.eps, at<bf16>(x_norm_),
                            at<float>(rstd_), stream_);
}

void LmEndsCuda::loss(const std::int32_t* targets, std::int64_t n, ops::DeviceWorkspace workspace) {
  cross_entropy_.forward(at<bf16>(x_norm_), weight(spec_.head), targets, n, spec_.dim, spec_.vocab, loss_outputs(),
                         workspace);
}

void LmEndsCuda::backward_head(optim::GradientSink& sink, const std::int32_t* targets, std::int64_t n, float grad_scale,
                               bf16* scratch, ops::DeviceWorkspace workspace) {
  const std::int64_t d = spec_.dim, vocab = spec_.vocab;
  head_grad_ = nullptr;
  const optim::Range head_range = range_of(spec_.head);
  if (!one_pass(sink)) {
    cross_entropy_.backward_hidden(at<bf16>(x_norm_), weight(spec_.head), targets, n, d, vocab, scratch, grad_scale,
                                   loss_outputs(), at<float>(token_lse_), workspace);
  } else {
    head_grad_ = sink.acquire_held(head_range);
    cross_entropy_.backward(at<bf16>(x_norm_), weight(spec_.head), targets, n, d, vocab, scratch, head_grad_,
                            grad_scale, loss_outputs(), workspace);
    if (spec_.head != spec_.embed) {
      sink.release(head_range);
      head_grad_ = nullptr;
    }
  }
  const optim::Range norm_range = range_of(spec_.final_norm);
  float* norm_grad = sink.acquire(norm_range);
  ops::rmsnorm_backward_cuda(scratch, at<bf16>(x_final_), weight(spec_.final_norm), at<float>(rstd_), n, d,
                             at<bf16>(dx_), norm_grad, workspace.data, workspace.bytes, stream_);
  sink.release(norm_range);
}

void LmEndsCuda::backward_embedding(optim::GradientSink& sink, const std::int32_t* ids, const std::int32_t* targets,
                                    std::int64_t n, float grad_scale, ops::DeviceWorkspace workspace) {
  const std::int64_t d = spec_.dim, vocab = spec_.vocab;
  const int head = spec_.head, embed = spec_.embed;
  const optim::Range head_range = range_of(head), embed_range = range_of(embed);
  const bf16* dx = at<bf16>(dx_);
  char* embed_workspace = at<char>(embed_workspace_);
  if (one_pass(sink)) {
    float* embed_grad = head_grad_ != nullptr ? head_grad_ : sink.acquire_held(embed_range);
    ops::embedding_backward_cuda(ids, n, dx, vocab, d, embed_grad, at<std::int32_t>(invalid_), embed_workspace,
                                 embed_workspace_bytes_, stream_);
    sink.release(embed_range);
    head_grad_ = nullptr;
    return;
  }
  ops::embedding_backward_sort_cuda(ids, n, vocab, at<std::int32_t>(invalid_), embed_workspace, embed_workspace_bytes_,
                                    stream_);
  // Windows of a multiple of 128 rows when the limit allows: an odd width gives the window's
  // logits rows that are not 16-byte aligned, and cuBLASLt then picks kernels ~20x slower.
  std::int64_t rows = sink.max_range_elements() / d;
  if (rows >= 128) rows = rows / 128 * 128;
  // Hands each window [r0, r1) of `tensor`'s rows to `fill` in acquired staging, then releases it.
  const auto for_each_window = [&](const optim::Range& tensor, auto fill) {
    for (std::int64_t r0 = 0; r0 < vocab; r0 += rows) {
      const std::int64_t r1 = std::min(vocab, r0 + rows);
      const optim::Range window{tensor.begin + r0 * d, tensor.begin + r1 * d};
      float* grad = sink.acquire(window);
      fill(r0, r1, grad);
      sink.release(window);
    }
  };
  const auto scatter_embedding = [&](std::int64_t r0, std::int64_t r1, float* grad) {
    ops::embedding_backward_scatter_cuda(n, dx, vocab, d, r0, r1, grad, embed_workspace, embed_workspace_bytes_,
                                         stream_);
  };
  for_each_window(head_range, [&](std::int64_t r0, std::int64_t r1, float* grad) {
    cross_entropy_.backward_weight_rows(at<bf16>(x_norm_), weight(head), targets, at<float>(token_lse_),
                                        at<std::int32_t>(count_), n, d, vocab, r0, r1, grad, grad_scale, workspace);
    if (head == embed) scatter_embedding(r0, r1, grad);
  });
  if (head != embed) for_each_window(embed_range, scatter_embedding);
}

bool LmEndsCuda::one_pass(const optim::GradientSink& sink) const {
  return sink.max_range_elements() <= 0 ||
         sink.max_held_range_elements() >= std::max(range_of(spec_.head).size(), range_of(spec_.embed).size());
}

std::int64_t LmEndsCuda::largest_range() const { return std::max(range_of(spec_.final_norm).size(), spec_.dim); }

LmEndsCuda::bf16* LmEndsCuda::x_final() { return at<bf16>(x_final_); }
const LmEndsCuda::bf16* LmEndsCuda::x_norm() { return at<bf16>(x_norm_); }
LmEndsCuda::bf16* LmEndsCuda::dx() { return at<bf16>(dx_); }
const float* LmEndsCuda::loss_value() const { return at<float>(mean_loss_); }
const float* LmEndsCuda::token_losses() const { return at<float>(token_losses_); }
const std::int32_t* LmEndsCuda::invalid_id_flag() const { return at<std::int32_t>(invalid_); }

}  // namespace models
