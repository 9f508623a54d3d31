// The least work of each phase of a Qwen3 training step, as Qwen3Cuda's phase timer names them
// (per step, summed over the layers): FLOPs for the products, to be set against a measured matmul
// rate, and bytes read plus written for the element-wise phases, against a measured copy
// bandwidth. Bytes count each input read once and each output written once (what one fused pass
// would move); small per-feature weights are left out. bf16 activations (2 bytes), fp32
// statistics and gradients (4 bytes).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

namespace bench {

struct Qwen3StepShape {
  std::int64_t batch = 0, seq = 0;
  std::int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0, vocab = 0, layers = 0;
  std::int64_t parameters = 0;
  std::string recompute = "none";  // none | mlp | full
  std::string optimizer = "adamw";
};

// The sizes of a qwen3 model shape (models::Shape) for `batch` x `seq` tokens.
inline Qwen3StepShape qwen3_step_shape(const nlohmann::ordered_json& shape, std::int64_t batch, std::int64_t seq,
                                       std::int64_t parameters) {
  auto size = [&](const char* key) { return shape.at(key).get<std::int64_t>(); };
  Qwen3StepShape s;
  s.batch = batch;
  s.seq = seq;
  s.hidden = size("hidden_size");
  s.heads = size("num_heads");
  s.kv_heads = size("num_kv_heads");
  s.head_dim = size("head_dim");
  s.intermediate = size("intermediate_size");
  s.vocab = size("vocab_size");
  s.layers = size("num_layers");
  s.parameters = parameters;
  return s;
}

// One of the two is set: flops for a product phase, bytes for an element-wise one.
struct PhaseWork {
  double flops = 0.0;
  double bytes = 0.0;
};

// Phase name -> its work. Phases not listed (Muon's orthogonalisation, the untimed rest) have no floor.
inline std::map<std::string, PhaseWork> qwen3_step_work(const Qwen3StepShape& s) {
  const double n = static_cast<double>(s.batch * s.seq), L = static_cast<double>(s.layers);
  const double d = static_cast<double>(s.hidden), f = static_cast<double>(s.intermediate);
  const double V = static_cast<double>(s.vocab), S = static_cast<double>(s.seq);
  const double H = static_cast<double>(s.heads), K = static_cast<double>(s.kv_heads);
  const double hd = static_cast<double>(s.head_dim);
  const double qs = H * hd, kvs = K * hd, qkv = qs + 2 * kvs;
  const double P = static_cast<double>(s.parameters);
  // A product x [n, in] W^T [in, out]: 2 n in out forward; input and weight gradients twice that.
  auto product = [&](double in, double out) { return 2 * n * in * out * L; };
  // Causal attention forward: QK^T and PV over half the [seq, seq] scores, 2 B H S^2 hd; the
  // backward counted as twice the forward, the convention of the MFU figure (flops_per_token).
  const double attention_fwd = 2 * n * S * H * hd * L;
  // RMSNorm over [n, d]: read x, write the bf16 output and one fp32 rstd per row; backward: read
  // the output gradient, x and rstd, write the input gradient.
  const double norm_fwd = (4 * n * d + 4 * n) * L, norm_bwd = (6 * n * d + 4 * n) * L;
  std::map<std::string, PhaseWork> w;
  w["embedding.fwd"].bytes = 4 * n * d + 8 * n;  // ids and positions, a row read and written per token
  w["attn.norm.fwd"].bytes = norm_fwd;
  w["attn.qkv.fwd"].flops = product(d, qkv);
  // q and k read from the qkv output, normed, rotated and written once, one rstd per head.
  w["attn.qk_norm_rope.fwd"].bytes = (4 * n * (qs + kvs) + 4 * n * (H + K)) * L;
  w["attn.core.fwd"].flops = attention_fwd;
  w["attn.o_proj.fwd"].flops = product(qs, d);
  w["residual.fwd"].bytes = 2 * 6 * n * d * L;  // two adds a layer: two bf16 reads, one write
  w["mlp.norm.fwd"].bytes = norm_fwd;
  w["mlp.gate_up.fwd"].flops = product(d, 2 * f);
  w["mlp.silu.fwd"].bytes = 6 * n * f * L;  // read gate and up, write their product
  w["mlp.down.fwd"].flops = product(f, d);
  w["final_norm.fwd"].bytes = norm_fwd / L;
  // Logits, their gradient and the head's weight gradient: 3 products of [n, d] x [d, V].
  w["lm_head+loss.fwd+bwd"].flops = 3 * 2 * n * d * V;
  w["mlp.down.bwd"].flops = 2 * product(f, d);
  w["mlp.silu.bwd"].bytes = 10 * n * f * L;  // read the gradient, gate and up; write both gradients
  w["mlp.gate_up.bwd"].flops = 2 * product(d, 2 * f);
  w["mlp.norm.bwd"].bytes = norm_bwd;
  w["residual.bwd"].bytes = 2 * 6 * n * d * L;  // dx += branch gradient, twice a layer
  w["attn.o_proj.bwd"].flops = 2 * product(qs, d);
  w["attn.core.bwd"].flops = 2 * attention_fwd;
  // Read the q/k gradient, q and k before the norm and the rstds; write their gradient.
  w["attn.qk_norm_rope.bwd"].bytes = (6 * n * (qs + kvs) + 4 * n * (H + K)) * L;
  w["attn.qkv.bwd"].flops = 2 * product(d, qkv);
  w["attn.norm.bwd"].bytes = norm_bwd;
  // Read the input gradient, add each token's row into the fp32 embedding gradient (read + write).
  w["embedding.bwd"].bytes = 2 * n * d + 8 * n * d + 4 * n;
  // The products recomputed in the backward (the element-wise work with them is left out).
  if (s.recompute == "mlp") w["recompute.bwd"].flops = product(d, 2 * f);
  if (s.recompute == "full")
    w["recompute.bwd"].flops = product(d, qkv) + attention_fwd + product(qs, d) + product(d, 2 * f) + product(f, d);
  // Gradient statistics: read every fp32 gradient once.
  w["optimizer.grad_stats"].bytes = 4 * P;
  // AdamW: read the gradient, read and write the fp32 master and both moments, write the bf16
  // mirror, zero the gradient.
  if (s.optimizer == "adamw") w["optimizer.update"].bytes = (4 + 8 + 16 + 2 + 4) * P;
  return w;
}

}  // namespace bench
