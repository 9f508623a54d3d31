// CPU reference of one E29a layer (layer.h has the equations). Each time step runs the phases the
// CUDA path runs: the recurrent product W_h h_{t-1} over the batch, the read attention + working
// state update per sequence, the write product W_write h_t over the batch, the write attention +
// tape update + gate per sequence. The backward walks the same phases in reverse.
#include "models/e29a/layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "models/ops/matmul_cpu.h"
#include "models/ops/op_checks.h"

namespace models::e29a {
namespace {

namespace checks = ops::checks;
using ops::Accumulate;

void check_shape(std::string_view op, const LayerShape& s) {
  checks::require_non_negative(op, "batch", s.batch);
  checks::require_non_negative(op, "steps", s.steps);
  checks::require_positive(op, "dim", s.dim);
  checks::require_positive(op, "slots", s.slots);
}

template <typename Scalar>
void check_weights(std::string_view op, const LayerShape& s, const LayerWeights<Scalar>& w) {
  const std::int64_t d = s.dim;
  checks::require_size(op, "w_xz", w.w_xz, 2 * d * d, "2 * dim * dim");
  checks::require_size(op, "w_h", w.w_h, d * d, "dim * dim");
  checks::require_size(op, "b_h", w.b_h, d, "dim");
  checks::require_size(op, "w_write", w.w_write, d * d, "dim * dim");
  checks::require_size(op, "tape0", w.tape0, s.slots * d, "slots * dim");
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// attn = softmax(scale * tape v) over the N slots of one sequence (tape [N, D], v [D]),
// rounded to Scalar.
template <typename Scalar>
void attention(const Scalar* tape, const Scalar* v, std::int64_t slots, std::int64_t dim, double scale, Scalar* attn) {
  std::vector<double> e(static_cast<std::size_t>(slots));
  double max_score = -INFINITY;
  for (std::int64_t n = 0; n < slots; ++n) {
    e[n] = scale * ops::dot_double(tape + n * dim, v, dim);
    max_score = std::max(max_score, e[n]);
  }
  double sum = 0.0;
  for (std::int64_t n = 0; n < slots; ++n) {
    e[n] = std::exp(e[n] - max_score);
    sum += e[n];
  }
  for (std::int64_t n = 0; n < slots; ++n) attn[n] = static_cast<Scalar>(e[n] / sum);
}

// Gradient of the softmax logits from the gradient g of its output a: a * (g - sum a g), with g
// shifted by g[0] so that equal g gives exactly zero.
template <typename Scalar>
void softmax_backward(const Scalar* a, const double* g, std::int64_t slots, double* ds) {
  double mean = 0.0;
  for (std::int64_t n = 0; n < slots; ++n) mean += static_cast<double>(a[n]) * (g[n] - g[0]);
  for (std::int64_t n = 0; n < slots; ++n) ds[n] = static_cast<double>(a[n]) * ((g[n] - g[0]) - mean);
}

// Rescales the carried gradients of one sequence (dh [dim] and dtape [slots * dim], one vector)
// to an L2 norm of at most `bound`.
template <typename Scalar>
void clip_carried(Scalar* dh, std::int64_t dh_count, Scalar* dtape, std::int64_t dtape_count, double bound) {
  double sq = 0.0;
  for (std::int64_t i = 0; i < dh_count; ++i) sq += static_cast<double>(dh[i]) * static_cast<double>(dh[i]);
  for (std::int64_t i = 0; i < dtape_count; ++i) sq += static_cast<double>(dtape[i]) * static_cast<double>(dtape[i]);
  const double norm = std::sqrt(sq);
  if (!(norm > bound)) return;
  const double factor = bound / norm;
  for (std::int64_t i = 0; i < dh_count; ++i) dh[i] = static_cast<Scalar>(factor * static_cast<double>(dh[i]));
  for (std::int64_t i = 0; i < dtape_count; ++i) dtape[i] = static_cast<Scalar>(factor * static_cast<double>(dtape[i]));
}

}  // namespace

template <typename Scalar>
void layer_forward_cpu(const LayerShape& shape, const LayerWeights<Scalar>& weights, std::span<const Scalar> u,
                       std::span<Scalar> y, LayerActivations<Scalar>* saved, const LayerState<Scalar>* start,
                       LayerState<Scalar>* end) {
  constexpr std::string_view op = "e29a_layer_forward";
  check_shape(op, shape);
  check_weights(op, shape, weights);
  const std::int64_t B = shape.batch, T = shape.steps, D = shape.dim, N = shape.slots;
  checks::require_size(op, "u", u, B * T * D, "batch * steps * dim");
  checks::require_size(op, "y", y, B * T * D, "batch * steps * dim");
  checks::require_disjoint(op, {checks::region("y", y)}, {checks::region("u", u)});
  if (start) {
    if (static_cast<std::int64_t>(start->h.size()) != B * D ||
        static_cast<std::int64_t>(start->tape.size()) != B * N * D) {
      checks::fail(op, "start state must hold h [batch, dim] and tape [batch, slots, dim]");
    }
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  LayerActivations<Scalar> local;
  LayerActivations<Scalar>& acts = saved ? *saved : local;
  acts.shape = shape;
  acts.xz.assign(static_cast<std::size_t>(B * T * 2 * D), Scalar(0));
  acts.h.assign(static_cast<std::size_t>((T + 1) * B * D), Scalar(0));
  acts.read.assign(static_cast<std::size_t>(T * B * D), Scalar(0));
  acts.write.assign(static_cast<std::size_t>(T * B * D), Scalar(0));
  acts.read_attn.assign(static_cast<std::size_t>(T * B * N), Scalar(0));
  acts.write_attn.assign(static_cast<std::size_t>(T * B * N), Scalar(0));
  acts.tape.assign(saved ? static_cast<std::size_t>(T * B * N * D) : 0, Scalar(0));

  // The input projection over every step at once.
  if (B * T > 0)
    ops::matmul_nt_cpu(u.data(), weights.w_xz.data(), B * T, 2 * D, D, acts.xz.data(), Accumulate::overwrite);

  // Start state: h_0 = 0 and H_0 for every sequence, or the caller's.
  std::vector<Scalar> tape(static_cast<std::size_t>(B * N * D));
  if (start) {
    std::copy(start->h.begin(), start->h.end(), acts.h.begin());
    std::copy(start->tape.begin(), start->tape.end(), tape.begin());
  } else {
    for (std::int64_t b = 0; b < B; ++b)
      std::copy(weights.tape0.begin(), weights.tape0.end(), tape.begin() + b * N * D);
  }

  std::vector<Scalar> recurrent(static_cast<std::size_t>(B * D));
  for (std::int64_t t = 0; t < T; ++t) {
    const Scalar* h_prev = acts.h.data() + t * B * D;
    Scalar* h_cur = acts.h.data() + (t + 1) * B * D;
    Scalar* read = acts.read.data() + t * B * D;
    Scalar* write = acts.write.data() + t * B * D;
    Scalar* read_attn = acts.read_attn.data() + t * B * N;
    Scalar* write_attn = acts.write_attn.data() + t * B * N;
    if (saved) std::copy(tape.begin(), tape.end(), acts.tape.begin() + t * B * N * D);

    // W_h h_{t-1} over the batch.
    if (B > 0) ops::matmul_nt_cpu(h_prev, weights.w_h.data(), B, D, D, recurrent.data(), Accumulate::overwrite);

      // Read attention and the working state.
#pragma omp parallel for schedule(static)
    for (std::int64_t b = 0; b < B; ++b) {
      const Scalar* H = tape.data() + b * N * D;
      Scalar* a = read_attn + b * N;
      attention(H, h_prev + b * D, N, D, scale, a);
      const Scalar* x = acts.xz.data() + (b * T + t) * 2 * D;
      for (std::int64_t d = 0; d < D; ++d) {
        double r = 0.0;
        for (std::int64_t n = 0; n < N; ++n) r += static_cast<double>(a[n]) * static_cast<double>(H[n * D + d]);
        read[b * D + d] = static_cast<Scalar>(r);
        const double pre = static_cast<double>(x[d]) + static_cast<double>(recurrent[b * D + d]) +
                           static_cast<double>(read[b * D + d]) + static_cast<double>(weights.b_h[d]);
        h_cur[b * D + d] = static_cast<Scalar>(std::tanh(pre));
      }
    }

    // w_t = W_write h_t over the batch.
    if (B > 0) ops::matmul_nt_cpu(h_cur, weights.w_write.data(), B, D, D, write, Accumulate::overwrite);

      // Write attention, tape update and the gated output.
#pragma omp parallel for schedule(static)
    for (std::int64_t b = 0; b < B; ++b) {
      Scalar* H = tape.data() + b * N * D;
      Scalar* a = write_attn + b * N;
      const Scalar* w = write + b * D;
      attention(H, w, N, D, scale, a);
      for (std::int64_t n = 0; n < N; ++n) {
        const double keep = 1.0 - static_cast<double>(a[n]), put = static_cast<double>(a[n]);
        for (std::int64_t d = 0; d < D; ++d) {
          H[n * D + d] =
              static_cast<Scalar>(keep * static_cast<double>(H[n * D + d]) + put * static_cast<double>(w[d]));
        }
      }
      const Scalar* z = acts.xz.data() + (b * T + t) * 2 * D + D;
      Scalar* y_row = y.data() + (b * T + t) * D;
      for (std::int64_t d = 0; d < D; ++d) {
        const double h = static_cast<double>(h_cur[b * D + d]);
        const double g = static_cast<double>(z[d]) + static_cast<double>(read[b * D + d]) + h;
        y_row[d] = static_cast<Scalar>(h * g * sigmoid(g));
      }
    }
  }

  if (end) {
    end->h.assign(acts.h.begin() + T * B * D, acts.h.begin() + (T + 1) * B * D);
    end->tape = std::move(tape);
  }
}

template <typename Scalar>
void layer_backward_cpu(const LayerWeights<Scalar>& weights, const LayerActivations<Scalar>& saved,
                        std::span<const Scalar> u, std::span<const Scalar> dy, std::span<Scalar> du,
                        const LayerGradients<Scalar>& grads, LayerBackwardTrace<Scalar>* trace,
                        const LayerBackwardOptions& options) {
  constexpr std::string_view op = "e29a_layer_backward";
  const LayerShape& shape = saved.shape;
  check_shape(op, shape);
  check_weights(op, shape, weights);
  const std::int64_t B = shape.batch, T = shape.steps, D = shape.dim, N = shape.slots;
  checks::require_size(op, "u", u, B * T * D, "batch * steps * dim");
  checks::require_size(op, "dy", dy, B * T * D, "batch * steps * dim");
  checks::require_size(op, "du", du, B * T * D, "batch * steps * dim");
  checks::require_size(op, "grads.w_xz", grads.w_xz, 2 * D * D, "2 * dim * dim");
  checks::require_size(op, "grads.w_h", grads.w_h, D * D, "dim * dim");
  checks::require_size(op, "grads.b_h", grads.b_h, D, "dim");
  checks::require_size(op, "grads.w_write", grads.w_write, D * D, "dim * dim");
  checks::require_size(op, "grads.tape0", grads.tape0, N * D, "slots * dim");
  if (static_cast<std::int64_t>(saved.tape.size()) != T * B * N * D) {
    checks::fail(op, "the activations were not saved by the forward (tape has " + std::to_string(saved.tape.size()) +
                         " elements)");
  }
  checks::require_disjoint(op, {checks::region("du", du)}, {checks::region("u", u), checks::region("dy", dy)});
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  if (trace) {
    trace->read.assign(static_cast<std::size_t>(T * B * N), Scalar(0));
    trace->write.assign(static_cast<std::size_t>(T * B * N), Scalar(0));
    trace->state_grad_norm.assign(static_cast<std::size_t>(T * B), 0.0);
    trace->tape_grad_norm.assign(static_cast<std::size_t>(T * B), 0.0);
  }

  std::vector<Scalar> dxz(static_cast<std::size_t>(B * T * 2 * D));            // [batch, steps, 2D]
  std::vector<Scalar> d_pre(static_cast<std::size_t>(T * B * D));              // dL/d(pre-tanh), [steps, batch, D]
  std::vector<Scalar> d_write(static_cast<std::size_t>(T * B * D));            // dL/dw_t
  std::vector<Scalar> d_tape(static_cast<std::size_t>(B * N * D), Scalar(0));  // dL/dH_t, carried
  std::vector<Scalar> dh_next(static_cast<std::size_t>(B * D), Scalar(0));     // dL/dh_t from step t+1
  std::vector<Scalar> dh_local(static_cast<std::size_t>(B * D));               // dL/dh_t from the output and gate
  std::vector<Scalar> d_gate(static_cast<std::size_t>(B * D));                 // dL/d(gate input)
  std::vector<Scalar> dh_from_write(static_cast<std::size_t>(B * D));

  for (std::int64_t t = T - 1; t >= 0; --t) {
    const Scalar* h_prev = saved.h.data() + t * B * D;
    const Scalar* h_cur = saved.h.data() + (t + 1) * B * D;
    const Scalar* read = saved.read.data() + t * B * D;
    const Scalar* write = saved.write.data() + t * B * D;
    const Scalar* read_attn = saved.read_attn.data() + t * B * N;
    const Scalar* write_attn = saved.write_attn.data() + t * B * N;
    const Scalar* tape = saved.tape.data() + t * B * N * D;  // H_{t-1}
    Scalar* dw_t = d_write.data() + t * B * D;
    Scalar* dp_t = d_pre.data() + t * B * D;

    // Gate, output, and the tape write (value and attention).
#pragma omp parallel for schedule(static)
    for (std::int64_t b = 0; b < B; ++b) {
      if (options.carry_clip > 0)
        clip_carried(dh_next.data() + b * D, D, d_tape.data() + b * N * D, N * D, options.carry_clip);
      const Scalar* z = saved.xz.data() + (b * T + t) * 2 * D + D;
      const Scalar* dy_row = dy.data() + (b * T + t) * D;
      for (std::int64_t d = 0; d < D; ++d) {
        const double h = static_cast<double>(h_cur[b * D + d]);
        const double g = static_cast<double>(z[d]) + static_cast<double>(read[b * D + d]) + h;
        const double s = sigmoid(g);
        const double dout = static_cast<double>(dy_row[d]);
        const double dg = dout * h * s * (1.0 + g * (1.0 - s));
        d_gate[b * D + d] = static_cast<Scalar>(dg);
        dxz[(b * T + t) * 2 * D + D + d] = static_cast<Scalar>(dg);
        dh_local[b * D + d] = static_cast<Scalar>(static_cast<double>(dh_next[b * D + d]) + dout * g * s + dg);
      }
      const Scalar* H = tape + b * N * D;
      const Scalar* w = write + b * D;
      const Scalar* a = write_attn + b * N;
      Scalar* dH = d_tape.data() + b * N * D;
      std::vector<double> da(static_cast<std::size_t>(N)), ds(static_cast<std::size_t>(N));
      for (std::int64_t n = 0; n < N; ++n) {
        double sum = 0.0;
        for (std::int64_t d = 0; d < D; ++d) {
          sum += static_cast<double>(dH[n * D + d]) * (static_cast<double>(w[d]) - static_cast<double>(H[n * D + d]));
        }
        da[n] = sum;
      }
      softmax_backward(a, da.data(), N, ds.data());
      if (options.detach_write_scores) std::fill(ds.begin(), ds.end(), 0.0);
      if (trace) {
        for (std::int64_t n = 0; n < N; ++n) trace->write[(t * B + b) * N + n] = static_cast<Scalar>(ds[n]);
      }
      for (std::int64_t d = 0; d < D; ++d) {
        double sum = 0.0;
        for (std::int64_t n = 0; n < N; ++n) {
          sum += static_cast<double>(a[n]) * static_cast<double>(dH[n * D + d]) +
                 scale * ds[n] * static_cast<double>(H[n * D + d]);
        }
        dw_t[b * D + d] = static_cast<Scalar>(sum);
      }
      for (std::int64_t n = 0; n < N; ++n) {
        const double keep = 1.0 - static_cast<double>(a[n]);
        for (std::int64_t d = 0; d < D; ++d) {
          dH[n * D + d] = static_cast<Scalar>(keep * static_cast<double>(dH[n * D + d]) +
                                              scale * ds[n] * static_cast<double>(w[d]));
        }
      }
    }

    // dh_t += W_write^T dw_t over the batch.
    if (B > 0) ops::matmul_nn_cpu(dw_t, weights.w_write.data(), B, D, D, dh_from_write.data(), Accumulate::overwrite);

      // tanh, and the read (value and attention).
#pragma omp parallel for schedule(static)
    for (std::int64_t b = 0; b < B; ++b) {
      const Scalar* H = tape + b * N * D;
      const Scalar* a = read_attn + b * N;
      Scalar* dH = d_tape.data() + b * N * D;
      std::vector<double> dr(static_cast<std::size_t>(D));
      double dh_sq = 0.0;
      for (std::int64_t d = 0; d < D; ++d) {
        const double h = static_cast<double>(h_cur[b * D + d]);
        const double dh = static_cast<double>(dh_local[b * D + d]) + static_cast<double>(dh_from_write[b * D + d]);
        dh_sq += dh * dh;
        const double dp = dh * (1.0 - h * h);
        dp_t[b * D + d] = static_cast<Scalar>(dp);
        dxz[(b * T + t) * 2 * D + d] = dp_t[b * D + d];
        dr[d] = static_cast<double>(d_gate[b * D + d]) + static_cast<double>(dp_t[b * D + d]);
      }
      std::vector<double> da(static_cast<std::size_t>(N)), ds(static_cast<std::size_t>(N));
      for (std::int64_t n = 0; n < N; ++n) {
        double sum = 0.0;
        for (std::int64_t d = 0; d < D; ++d) sum += dr[d] * static_cast<double>(H[n * D + d]);
        da[n] = sum;
      }
      softmax_backward(a, da.data(), N, ds.data());
      if (options.detach_read_scores) std::fill(ds.begin(), ds.end(), 0.0);
      if (trace) {
        for (std::int64_t n = 0; n < N; ++n) trace->read[(t * B + b) * N + n] = static_cast<Scalar>(ds[n]);
      }
      const Scalar* hp = h_prev + b * D;
      for (std::int64_t n = 0; n < N; ++n) {
        const double an = static_cast<double>(a[n]);
        for (std::int64_t d = 0; d < D; ++d) {
          dH[n * D + d] = static_cast<Scalar>(static_cast<double>(dH[n * D + d]) + an * dr[d] +
                                              scale * ds[n] * static_cast<double>(hp[d]));
        }
      }
      if (trace) {
        double dtape_sq = 0.0;
        for (std::int64_t i = 0; i < N * D; ++i) dtape_sq += static_cast<double>(dH[i]) * static_cast<double>(dH[i]);
        trace->state_grad_norm[static_cast<std::size_t>(t * B + b)] = std::sqrt(dh_sq);
        trace->tape_grad_norm[static_cast<std::size_t>(t * B + b)] = std::sqrt(dtape_sq);
      }
      for (std::int64_t d = 0; d < D; ++d) {
        double sum = 0.0;
        for (std::int64_t n = 0; n < N; ++n) sum += ds[n] * static_cast<double>(H[n * D + d]);
        dh_next[b * D + d] = static_cast<Scalar>(scale * sum);
      }
    }

    // dh_{t-1} += W_h^T dp_t over the batch.
    if (B > 0) ops::matmul_nn_cpu(dp_t, weights.w_h.data(), B, D, D, dh_next.data(), Accumulate::add);
  }

  // Weight gradients: one product each over all (step, sequence) rows, in a fixed order.
  const std::int64_t rows = T * B;
  if (rows > 0) {
    ops::matmul_tn_cpu(d_pre.data(), saved.h.data(), D, D, rows, grads.w_h.data(), Accumulate::add);
    ops::matmul_tn_cpu(d_write.data(), saved.h.data() + B * D, D, D, rows, grads.w_write.data(), Accumulate::add);
    ops::matmul_tn_cpu(dxz.data(), u.data(), 2 * D, D, rows, grads.w_xz.data(), Accumulate::add);
    ops::matmul_nn_cpu(dxz.data(), weights.w_xz.data(), rows, D, 2 * D, du.data(), Accumulate::overwrite);
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t d = 0; d < D; ++d) {
    double sum = 0.0;
    for (std::int64_t r = 0; r < rows; ++r) sum += static_cast<double>(d_pre[r * D + d]);
    grads.b_h[d] = static_cast<Scalar>(static_cast<double>(grads.b_h[d]) + sum);
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < N * D; ++i) {
    double sum = 0.0;
    for (std::int64_t b = 0; b < B; ++b) sum += static_cast<double>(d_tape[b * N * D + i]);
    grads.tape0[i] = static_cast<Scalar>(static_cast<double>(grads.tape0[i]) + sum);
  }
}

template void layer_forward_cpu<float>(const LayerShape&, const LayerWeights<float>&, std::span<const float>,
                                       std::span<float>, LayerActivations<float>*, const LayerState<float>*,
                                       LayerState<float>*);
template void layer_forward_cpu<double>(const LayerShape&, const LayerWeights<double>&, std::span<const double>,
                                        std::span<double>, LayerActivations<double>*, const LayerState<double>*,
                                        LayerState<double>*);
template void layer_backward_cpu<float>(const LayerWeights<float>&, const LayerActivations<float>&,
                                        std::span<const float>, std::span<const float>, std::span<float>,
                                        const LayerGradients<float>&, LayerBackwardTrace<float>*,
                                        const LayerBackwardOptions&);
template void layer_backward_cpu<double>(const LayerWeights<double>&, const LayerActivations<double>&,
                                         std::span<const double>, std::span<const double>, std::span<double>,
                                         const LayerGradients<double>&, LayerBackwardTrace<double>*,
                                         const LayerBackwardOptions&);

}  // namespace models::e29a
