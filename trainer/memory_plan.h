// The memory plan of a run (`trainer --plan`): parameter count, tokens per step and the bytes one
// rank holds at the configured ZeRO stage and world size, computed from the same layout, coverage
// and optimizer plans the run allocates from (optim::slab_coverage, optim::optimizer_state_bytes,
// ModelSpec::cuda_activation_bytes), without allocating. The trainer refuses a cuda run whose plan
// exceeds the GPU's free memory before it allocates (check_plan_fits).
//
// Per rank, with P the slab's elements (parameters, 64-aligned, padded to world x 256), N the
// world size, S = P / N, G the largest weight range of a ZeRO-3 model, R the largest gradient range:
//   weights:       mirror 2P (2S at ZeRO-3) + master 4P (4S from ZeRO-1)
//                  + on cpu at ZeRO-1/2 with N > 1 the whole-model fp32 copy the cpu model reads (4P)
//   gradients:     4P, or 4S where they are sharded (cuda, ZeRO >= 2, N > 1, no accumulation)
//   optimizer:     the optimizer's state over S (adamw 8 bytes an element, adamw8bit about 2,
//                  adafactor its row/column statistics); muon's working buffers besides: the
//                  fp32 assembly buffer of every hidden matrix (4M, M their elements) and on cuda
//                  the bf16 Newton-Schulz buffers of the busiest rank's matrices (optim/muon_load.h)
//   communication: sharded gradients' staging 2 x 4R; ZeRO-3's gather buffers 2 x G (bf16 on
//                  cuda, fp32 on cpu); NCCL's own buffers are not counted
//   activations:   cuda: the model's activation memory for micro_batch_size x seq_len tokens
//                  (ModelSpec::cuda_activation_bytes); cpu: not estimated
//   samples and evaluation: ZeRO-3's whole-model gather while they run, 2P (cuda, the mirror) or
//                  4P (cpu, fp32); 0 below ZeRO-3. A decoder's own state (its KV cache) is not
//                  counted at any stage.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"
#include "optim/muon_load.h"
#include "trainer/config.h"

namespace trainer {

struct MemoryTerm {
  std::string name;
  std::optional<std::int64_t> bytes;  // nullopt: not estimated
  std::string formula;
};

struct MemoryPlan {
  std::string model;  // preset or arch
  bool cuda = true;
  int world = 1;
  int zero_stage = 1;
  std::string optimizer;
  std::int64_t parameters = 0;     // the model's parameters
  std::int64_t slab_elements = 0;  // P: with alignment and padding
  std::int64_t micro_tokens = 0;   // micro_batch_size x seq_len
  std::int64_t accumulation = 1;
  std::int64_t tokens_per_step = 0;
  std::vector<MemoryTerm> terms;        // weights, gradients, optimizer state, communication, activations
  std::optional<optim::MuonLoad> muon;  // muon: the Newton-Schulz work and buffers of each rank

  bool vocab_buffer = false;         // the held fp32 [vocab, dim] gradient buffer is counted
  std::int64_t total_bytes() const;  // of the estimated terms
  // The table `trainer --plan` prints (with muon, each rank's Newton-Schulz load after it).
  std::string table() const;
};

// Whether a run keeps only its shard of the gradients (the slab's shard_gradients): cuda, ZeRO
// >= 2, several ranks, one micro-batch per step (accumulation needs the whole buffer).
bool shards_gradients(const RunConfig& config, int world);
// Elements of GradientSync's held buffer: with sharded gradients and parallel.vocab_gradient:
// whole, the largest tensor of `layout` (the vocabulary-sized head or embedding); else 0.
std::int64_t held_gradient_elements(const RunConfig& config, const optim::SlabLayout& layout, int world);

// Throws core::InputError when ZeRO-3 is configured for a family that does not read its weights
// layer by layer (ModelSpec::weight_ranges), naming parallel.zero_stage and what is supported.
void check_zero_stage(const RunConfig& config, const models::ModelSpec& spec);

// The plan of `config` on `world` ranks (validate_for_world must hold).
MemoryPlan plan_memory(const RunConfig& config, const models::ModelSpec& spec, int world);

// cuda: throws core::InputError, naming what to change, when the plan needs more than
// `free_bytes` (the GPU's free memory before the run allocates).
void check_plan_fits(const MemoryPlan& plan, std::int64_t free_bytes, int gpu);

}  // namespace trainer
