// The phase kernels of the E29a layer's hybrid CUDA path (layer_cuda.h drives them between the
// per-step cuBLASLt products). One block per sequence; a block's threads stride over the D
// features, and the per-slot dot products of a step (N of them, the attention scores) are summed
// across the block in a fixed order (warp shuffles, then warps in order), so every result is
// bit-identical run to run. Kernels are templated on the slot capacity (8, 16, 32, 64; a smaller
// slot count runs in the next one up), D is a runtime argument, and dynamic shared memory holds
// the per-warp partial sums, the scores and attention weights and one D-vector.
//
// Per step t, forward:  [GEMM W_h h_{t-1}] read_step [GEMM W_write h_t] write_step
//             backward: write_back [GEMM W_write^T dw] read_back [GEMM W_h^T dp]
// All state is fp32; x/z come from the fp32 input projection; y, dy and the bf16 operands of the
// weight-gradient products are bf16.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace models::e29a::kernels {

// Largest slot count the CUDA path takes.
inline constexpr int kMaxSlots = 64;

struct ReadStepArgs {
  std::int64_t batch = 0;
  int dim = 0, slots = 0;
  float scale = 0;
  const float* tape = nullptr;    // H_{t-1} [batch, N, D]
  const float* h_prev = nullptr;  // [batch, D]
  const float* x = nullptr;       // x_t of sequence b at x + b * x_stride
  std::int64_t x_stride = 0;
  const float* recurrent = nullptr;  // W_h h_{t-1} [batch, D]
  const __nv_bfloat16* bias = nullptr;
  float* h = nullptr;               // h_t [batch, D]
  __nv_bfloat16* h_bf16 = nullptr;  // h_t rounded [batch, D]
  float* read = nullptr;            // r_t [batch, D]
  float* read_attn = nullptr;       // a_r [batch, N]
};

struct WriteStepArgs {
  std::int64_t batch = 0;
  int dim = 0, slots = 0;
  float scale = 0;
  float* tape = nullptr;         // in H_{t-1}, out H_t [batch, N, D]
  float* checkpoint = nullptr;   // optional: receives H_{t-1}
  const float* write = nullptr;  // w_t [batch, D]
  const float* h = nullptr;      // h_t
  const float* read = nullptr;   // r_t
  const float* z = nullptr;      // z_t of sequence b at z + b * z_stride
  std::int64_t z_stride = 0;
  float* write_attn = nullptr;  // a_w [batch, N]
  __nv_bfloat16* y = nullptr;   // y_t of sequence b at y + b * y_stride
  std::int64_t y_stride = 0;
};

struct WriteBackArgs {
  std::int64_t batch = 0;
  int dim = 0, slots = 0;
  float scale = 0;
  const float* tape = nullptr;        // H_{t-1}
  float* d_tape = nullptr;            // in dL/dH_t, out its part of dL/dH_{t-1}
  const float* write = nullptr;       // w_t
  const float* write_attn = nullptr;  // a_w [batch, N]
  const float* h = nullptr;           // h_t
  const float* read = nullptr;        // r_t
  const float* z = nullptr;
  std::int64_t z_stride = 0;
  const __nv_bfloat16* dy = nullptr;
  std::int64_t dy_stride = 0;
  const float* dh_next = nullptr;  // dL/dh_t from step t+1 [batch, D]
  float* dh_local = nullptr;       // out: dL/dh_t from step t+1, the output and the gate
  float* d_gate = nullptr;         // out: dL/d(z_t + r_t + h_t)
  float* d_write = nullptr;        // out: dL/dw_t (fp32, product operand)
  __nv_bfloat16* d_write_bf16 = nullptr;
  __nv_bfloat16* dz = nullptr;  // dL/dz_t of sequence b at dz + b * dz_stride
  std::int64_t dz_stride = 0;
  float* score_grad = nullptr;  // optional [batch, N]
  bool detach_scores = false;   // the write scores get no gradient
  float carry_clip = 0;         // > 0: (dh_next, d_tape) of a sequence rescaled to norm <= carry_clip first
};

struct ReadBackArgs {
  std::int64_t batch = 0;
  int dim = 0, slots = 0;
  float scale = 0;
  const float* tape = nullptr;       // H_{t-1}
  float* d_tape = nullptr;           // in/out: dL/dH_{t-1} (adds the read's part)
  const float* h_prev = nullptr;     // h_{t-1}
  const float* h = nullptr;          // h_t
  const float* read_attn = nullptr;  // a_r [batch, N]
  const float* dh_local = nullptr;
  const float* dh_write = nullptr;  // W_write^T dw_t
  const float* d_gate = nullptr;
  float* dh_prev = nullptr;  // out: the read attention's part of dL/dh_{t-1}
  float* d_pre = nullptr;    // out: dL/d(pre-tanh) (fp32, product operand)
  __nv_bfloat16* d_pre_bf16 = nullptr;
  __nv_bfloat16* dx = nullptr;  // dL/dx_t of sequence b at dx + b * dx_stride
  std::int64_t dx_stride = 0;
  float* d_bias = nullptr;      // [batch, D], dL/d(pre) added (per sequence, over steps)
  float* score_grad = nullptr;  // optional [batch, N]
  bool detach_scores = false;   // the read scores get no gradient
};

void read_step(const ReadStepArgs& args, cudaStream_t stream);
void write_step(const WriteStepArgs& args, cudaStream_t stream);
void write_back(const WriteBackArgs& args, cudaStream_t stream);
void read_back(const ReadBackArgs& args, cudaStream_t stream);

// seg[i] = tape before step s0 + i, i < count, from seg[0] = checkpoint (the tape before step s0)
// and the saved write attention / write values of steps s0 .. s0 + count - 2 ([count - 1, batch, .]
// time-major), with the forward's own update arithmetic (bit-identical).
void replay_tape(const float* checkpoint, const float* write_attn, const float* write, std::int64_t batch, int slots,
                 int dim, int count, float* seg, cudaStream_t stream);

// tape[b] = float(tape0) for every sequence.
void broadcast_tape(const __nv_bfloat16* tape0, std::int64_t batch, std::int64_t per_sequence, float* tape,
                    cudaStream_t stream);
void bf16_to_float(const __nv_bfloat16* in, std::int64_t count, float* out, cudaStream_t stream);
void float_to_bf16(const float* in, std::int64_t count, __nv_bfloat16* out, cudaStream_t stream);
// out[i] = bf16(float(a[i]) + float(b[i])) (the residual stream of the model; out may alias a or b).
void add_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, std::int64_t count, __nv_bfloat16* out,
              cudaStream_t stream);
// out[i] += sum_b in[b * count + i], b in order.
void add_batch_sum(const float* in, std::int64_t batch, std::int64_t count, float* out, cudaStream_t stream);

}  // namespace models::e29a::kernels
