// The E29a layer's forward recurrence as one persistent kernel (all T steps in one cooperative
// launch) instead of the hybrid path's four launches a step.
//
// Per step two phases separated by grid-wide barriers:
// - rows: block k holds rows of [W_h ; W_write] (bf16, exact as the mirror stores them) in shared
//   memory for all T steps and computes them against h_t of every sequence (fp32 loads through
//   L2, fp32 products): w_t = W_write h_t and W_h h_t, the next step's recurrent term;
// - sequences: a block per sequence runs the write step of t (write attention, tape update, y_t)
//   and the read step of t + 1 (read attention, h_{t+1}) with the hybrid path's own device
//   functions (layer_step.cuh), so only the two recurrent products differ from it (their summation
//   order: fp32 throughout). The sequence's tape [N, D] stays in that block's shared memory for
//   all T steps (loaded at the start, written back at the end).
// It writes every saved tensor the hybrid forward writes (h, r, w, both attentions, checkpoints),
// so the hybrid backward runs on either forward's output.
//
// Every barrier wait has a deadline; the first wait to pass it records where it stood and every
// block leaves; check() throws with the record.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace models::e29a::kernels {

// Device words of one persistent launch: the barrier counter and the abort record.
struct PersistentSync {
  std::uint32_t arrived;
  std::uint32_t aborted;
  std::uint32_t block, barrier, wanted, seen;
};

struct PersistentForwardArgs {
  std::int64_t batch = 0, steps = 0;
  int dim = 0, slots = 0;
  float scale = 0;
  const __nv_bfloat16* w_h = nullptr;      // [D, D]
  const __nv_bfloat16* w_write = nullptr;  // [D, D]
  const __nv_bfloat16* bias = nullptr;     // [D]
  const float* xz = nullptr;               // [batch, steps, 2D]: x_t then z_t
  float* h = nullptr;                      // [steps + 1, batch, D]; h[0] holds the start state
  __nv_bfloat16* h_bf16 = nullptr;         // [steps + 1, batch, D]; [0] written by the caller
  float* read = nullptr;                   // [steps, batch, D]
  float* write = nullptr;                  // [steps, batch, D]
  float* read_attn = nullptr;              // [steps, batch, N]
  float* write_attn = nullptr;             // [steps, batch, N]
  float* tape = nullptr;                   // running H [batch, N, D], holds H_0
  float* checkpoints = nullptr;            // H before every step t with t % interval == 0
  std::int64_t interval = 1;
  float* recurrent = nullptr;  // scratch [batch, D]
  __nv_bfloat16* y = nullptr;  // [batch, steps, D]
  PersistentSync* sync = nullptr;
  double timeout_seconds = 5.0;
  int stall_block = -1;  // tests: this block never arrives at the first barrier
  // Optional [11]: ns in rows, wait, sequences, wait (block 0, then the last block); block 0's
  // sequence loads + write attention, tape pass, read.
  std::uint64_t* profile = nullptr;
};

// Why the persistent forward cannot take this shape on the current device ("" when it can): it
// needs a block per sequence and room in shared memory for the block's weight rows and its tape.
std::string persistent_forward_refusal(int dim, int slots, std::int64_t max_batch);
// Launches it (the caller checked persistent_forward_refusal). Zeroes args.sync first.
void persistent_forward(const PersistentForwardArgs& args, cudaStream_t stream);
// The message of an aborted launch's record.
std::string persistent_abort_message(const PersistentSync& record, double timeout_seconds);

}  // namespace models::e29a::kernels
