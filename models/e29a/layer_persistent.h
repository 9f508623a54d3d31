// The E29a layer's recurrence as one persistent kernel per direction (all T steps in one
// cooperative launch) instead of the hybrid path's four launches a step.
//
// Per step two phases separated by grid-wide barriers:
// - rows: block k holds rows of [W_h ; W_write] (bf16, exact as the mirror stores them) in shared
//   memory for all T steps and computes them against h_t of every sequence (fp32 loads through
//   L2, fp32 products): w_t = W_write h_t and W_h h_t, the next step's recurrent term;
// - sequences: a block per sequence (or a cluster of 2-4 blocks, each with a slice of the features,
//   sharing slot sums through distributed shared memory, where blocks outnumber sequences
//   enough) runs the write step of t (write attention, tape update, y_t)
//   and the read step of t + 1 (read attention, h_{t+1}) with the hybrid path's own device
//   functions (layer_step.cuh), so only the two recurrent products differ from it (their summation
//   order: fp32 throughout). The sequence's tape [N, D] stays in that block's shared memory for
//   all T steps (loaded at the start, written back at the end).
// It writes every saved tensor the hybrid forward writes (h, r, w, both attentions, checkpoints),
// so either backward runs on either forward's output.
//
// The backward has the same two phases a step in reverse: rows of [W_h^T ; W_write^T] times
// (dL/dpre_{t+1}, dL/dw_t), then a block per sequence for the gate, tanh and both attentions'
// backwards with dL/dH in shared memory and the tapes replayed segment by segment from the
// forward's checkpoints (layer_persistent_kernels.cuh says in which order). Its outputs are the hybrid
// backward's per-step operands of the weight-gradient products.
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
  float* h_frag = nullptr;     // scratch: h_t for the rows phase, persistent_fragment_floats
  __nv_bfloat16* y = nullptr;  // [batch, steps, D]
  PersistentSync* sync = nullptr;
  double timeout_seconds = 5.0;
  int stall_block = -1;  // tests: this block never arrives at the first barrier
  int cluster = 0;       // blocks a sequence spreads over (1, 2 or 4); 0: the launch chooses
  int batch_parts = 0;   // the rows phase's batch split over blocks (1 or 2); 0: the launch chooses
  // Optional [12]: ns in rows, wait, sequences, wait (block 0, then the last block); block 0's
  // sequence phases split: loads + write-score pass, write softmax + update pass (read scores) +
  // read softmax, read pass (r_{t+1}), outputs.
  std::uint64_t* profile = nullptr;
};

struct PersistentBackwardArgs {
  std::int64_t batch = 0, steps = 0;
  int dim = 0, slots = 0;
  float scale = 0;
  const __nv_bfloat16* w_h = nullptr;      // [D, D]
  const __nv_bfloat16* w_write = nullptr;  // [D, D]
  // The forward's saved tensors (LayerActivationsCuda).
  const float* xz = nullptr;           // [batch, steps, 2D]
  const float* h = nullptr;            // [steps + 1, batch, D]
  const float* read = nullptr;         // [steps, batch, D]
  const float* write = nullptr;        // [steps, batch, D]
  const float* read_attn = nullptr;    // [steps, batch, N]
  const float* write_attn = nullptr;   // [steps, batch, N]
  const float* checkpoints = nullptr;  // [ceil(steps / interval), batch, N, D]
  std::int64_t interval = 1;
  const __nv_bfloat16* dy = nullptr;  // [batch, steps, D]
  // Outputs (written): the weight-gradient products' operands and the per-sequence sums.
  __nv_bfloat16* d_pre_bf16 = nullptr;    // dL/dpre [steps, batch, D]
  __nv_bfloat16* d_write_bf16 = nullptr;  // dL/dw [steps, batch, D]
  __nv_bfloat16* dxz = nullptr;           // [batch, steps, 2D]: dL/dx then dL/dz
  float* d_bias = nullptr;                // [batch, D]: dL/db_h of each sequence
  float* d_tape = nullptr;                // [batch, N, D]: dL/dH_0 of each sequence
  float* read_scores = nullptr;           // optional [steps, batch, N]
  float* write_scores = nullptr;          // optional [steps, batch, N]
  bool detach_read = false, detach_write = false;
  // Scratch: the rows phase's operands (persistent_fragment_floats each) and results [batch, D],
  // two buffers for replayed segments [2, interval, batch, N, D] (the second taken when blocks
  // without a sequence replay ahead).
  float* d_pre = nullptr;
  float* d_write = nullptr;
  float* recurrent = nullptr;  // W_h^T dL/dpre_{t+1}
  float* dh_write = nullptr;   // W_write^T dL/dw_t
  float* segment = nullptr;
  PersistentSync* sync = nullptr;
  double timeout_seconds = 5.0;
  int stall_block = -1;
  int cluster = 0;
  int batch_parts = 0;
  // Optional [12]: ns in rows, wait, sequences, wait (block 0, then the last block); block 0's
  // sequence phases split: replay and the early loads (after the block's arrival at the grid
  // barrier: also in the wait), loads + score pass, block sums + both softmaxes' backward, dL/dH
  // and dL/dh_{t-1} pass.
  std::uint64_t* profile = nullptr;
};

// Why the persistent forward cannot take this shape on the current device ("" when it can): it
// needs a block per sequence and room in shared memory for the block's weight rows and its tape.
// `cluster` > 0 asks for that many blocks a sequence, `parts` > 0 for the batch in that many parts
// in the rows phase (else chosen at each launch).
std::string persistent_forward_refusal(int dim, int slots, std::int64_t max_batch, int cluster = 0, int parts = 0);
// The same for the backward, which keeps two tapes on chip (dL/dH and the replay's).
std::string persistent_backward_refusal(int dim, int slots, std::int64_t max_batch, int cluster = 0, int parts = 0);
// The blocks a sequence and the batch parts the launch takes for this shape (`cluster` and `parts`
// as PersistentForwardArgs's; the caller checked the refusal).
struct PersistentShape {
  int cluster = 1, batch_parts = 1;
};
PersistentShape persistent_shape(bool backward, int dim, int slots, std::int64_t batch, int cluster = 0, int parts = 0);
// Launch them (the caller checked the refusal). Zero args.sync first.
void persistent_forward(const PersistentForwardArgs& args, cudaStream_t stream);
void persistent_backward(const PersistentBackwardArgs& args, cudaStream_t stream);
// Floats of a rows-phase operand: [batch, D] in the kernels' fragment order, the batch rounded up
// to groups of 8 and D to k-steps of 16.
std::size_t persistent_fragment_floats(std::int64_t batch, int dim);
// The message of an aborted launch's record.
std::string persistent_abort_message(const PersistentSync& record, double timeout_seconds, bool backward);

}  // namespace models::e29a::kernels
