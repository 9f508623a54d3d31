// One E29a layer (selective-gating dual-memory Elman): the CPU reference of the forward and the
// exact backward over a batch of sequences. D = dim, N = slots, scale = 1/sqrt(D); per sequence,
// with working state h [D] and tape H [N, D], starting from h_0 = 0 and H_0 (a parameter):
//
//   [x_t ; z_t] = W_xz u_t                                  (u: the layer input, one product over all t)
//   a_r = softmax(scale * H_{t-1} h_{t-1});  r_t = a_r^T H_{t-1}
//   h_t = tanh(x_t + W_h h_{t-1} + r_t + b_h)
//   w_t = W_write h_t
//   a_w = softmax(scale * H_{t-1} w_t);      H_t[n] = (1 - a_w[n]) H_{t-1}[n] + a_w[n] w_t
//   y_t = h_t * silu(z_t + r_t + h_t)
//
// The backward carries dL/dh_t and dL/dH_t from step t+1 to t and differentiates every path:
// the gate, the tape write (its value and its attention, scored with w_t), tanh, the read (its
// value and its attention, scored with h_{t-1}) and both recurrent products. Softmax gradients
// are taken as ds[n] = a[n] * (g[n] - sum_m a[m] g[m]) with g shifted by g[0] first (the same
// value in exact arithmetic), so equal g (equal slots) gives exactly zero score gradients.
//
// Layouts (row-major): u, y, dy, du [batch, steps, D] (token order of the model); W_xz [2D, D]
// (rows 0..D-1 give x_t, rows D..2D-1 give z_t); W_h, W_write [D, D] (out, in); b_h [D];
// H_0 [N, D]. Everything is stored in Scalar; products and sums accumulate in double, each value
// rounded once to Scalar. Weight gradients are reduced over batch and time in a fixed order
// (products over all rows after the time loop), so results do not depend on the thread count.
// Instantiated for float (the model's CPU backend) and double (the finite-difference tests).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace models::e29a {

struct LayerShape {
  std::int64_t batch = 0;
  std::int64_t steps = 0;
  std::int64_t dim = 0;
  std::int64_t slots = 0;
};

// One span per weight of the layer: the weights themselves, or their gradients.
template <typename Span>
struct LayerSpans {
  Span w_xz;     // [2D, D]
  Span w_h;      // [D, D]
  Span b_h;      // [D]
  Span w_write;  // [D, D]
  Span tape0;    // [N, D]
};

template <typename Scalar>
using LayerWeights = LayerSpans<std::span<const Scalar>>;
// Gradients of the weights, accumulated (+=).
template <typename Scalar>
using LayerGradients = LayerSpans<std::span<Scalar>>;

// The recurrent state of a batch: h [batch, D] and H [batch, N, D].
template <typename Scalar>
struct LayerState {
  std::vector<Scalar> h;
  std::vector<Scalar> tape;
};

// What the forward keeps for the backward, time-major. Filled by layer_forward_cpu.
template <typename Scalar>
struct LayerActivations {
  LayerShape shape;
  std::vector<Scalar> xz;          // [batch, steps, 2D]: x_t, z_t
  std::vector<Scalar> h;           // [steps + 1, batch, D]: h_0 .. h_T
  std::vector<Scalar> read;        // [steps, batch, D]: r_t
  std::vector<Scalar> write;       // [steps, batch, D]: w_t
  std::vector<Scalar> read_attn;   // [steps, batch, N]: a_r
  std::vector<Scalar> write_attn;  // [steps, batch, N]: a_w
  std::vector<Scalar> tape;        // [steps, batch, N, D]: H_{t-1}, the tape step t reads
};

// What the last backward carried through time (diagnostics and the degeneracy test): the
// score gradients dL/d(scores) before the scale, [steps, batch, N] each, and the L2 norms of the
// state and tape gradients, [steps, batch]: dL/dh_t (every path) and dL/dH_{t-1} (the tape step t
// read, after step t's contributions), which show where a gradient grows going back in time.
template <typename Scalar>
struct LayerBackwardTrace {
  std::vector<Scalar> read;
  std::vector<Scalar> write;
  std::vector<double> state_grad_norm;
  std::vector<double> tape_grad_norm;
};

// How the CUDA layer runs a direction's recurrence (layer_cuda.h): `automatic` takes the persistent
// kernel where it can (its refusal is empty), else the hybrid path.
enum class RecurrenceKernel { automatic, hybrid, persistent };

// The backward's treatment of the two paths that can make the gradient grow without bound going
// back in time (docs/e29a.md, "Exploding gradients"). The default is the exact gradient.
struct LayerBackwardOptions {
  bool detach_read_scores = false;   // the read attention's scores get no gradient (a_r a constant)
  bool detach_write_scores = false;  // the write attention's scores get no gradient (a_w a constant)
  // > 0: before step t uses them, the gradients carried from step t+1 (dL/dh_t and dL/dH_t of one
  // sequence, as one vector) are rescaled to an L2 norm of at most carry_clip.
  double carry_clip = 0;
};

// y = E29a(u). `start` (optional) replaces the training start (h_0 = 0, every sequence's tape
// H_0); `end` (optional) receives the state after the last step (the decoder's state).
// `saved` (optional) receives what the backward needs.
template <typename Scalar>
void layer_forward_cpu(const LayerShape& shape, const LayerWeights<Scalar>& weights, std::span<const Scalar> u,
                       std::span<Scalar> y, LayerActivations<Scalar>* saved, const LayerState<Scalar>* start = nullptr,
                       LayerState<Scalar>* end = nullptr);

// du = dL/du (written); the weight gradients are added to `grads`. The gradient of the start tape,
// summed over the batch, is added to grads.tape0 (in training the start tape is H_0); h_0 is a
// constant. `trace` (optional) receives what the backward carried; `options` as above.
template <typename Scalar>
void layer_backward_cpu(const LayerWeights<Scalar>& weights, const LayerActivations<Scalar>& saved,
                        std::span<const Scalar> u, std::span<const Scalar> dy, std::span<Scalar> du,
                        const LayerGradients<Scalar>& grads, LayerBackwardTrace<Scalar>* trace = nullptr,
                        const LayerBackwardOptions& options = {});

}  // namespace models::e29a
