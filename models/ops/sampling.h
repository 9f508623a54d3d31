// Choosing the next token from fp32 logits [vocab]: greedy, or sampling with a temperature, top-k
// and top-p, from one uniform draw u in [0, 1) per token. Semantics (as transformers' warpers, in
// their order: temperature, then top-k, then top-p), with every tie broken the same way:
//   greedy (temperature 0): the largest logit, the lowest id among equal ones;
//   sampling: z = logit / temperature (NaN -> -inf, +inf -> the largest finite float, -0 -> +0);
//     tokens ordered by z descending, ties by id ascending (the "order");
//     top-k (k > 0): keeps the first k of the order and every token equal in z to the k-th;
//     e_i = exp(z_i - z_max) in double, its weight w_i = round(e_i * 2^41) as a 64-bit integer,
//     cum = running sum of w along the order;
//     top-p (p < 1): keeps the shortest prefix of the order whose cum reaches p * (sum of the kept w);
//     the choice is the first kept token whose cum exceeds u * (cum of the last kept token)
//     (cum compared as a double).
// With all logits -inf (or NaN) both give id 0.
//
// The CPU reference (sampling.cpp) and the CUDA kernels (sampling.cu) compute the same z, order
// and e bit for bit (e by sampling_exp below, the same operations on both), and the weights are
// integers, so their sums are exact in any order: the host's sequential sums and the device's
// tiled scan are equal, and the two choose the same id for every u. (Sums of doubles differed in
// their last bits over a 151,936-token vocabulary, which moved the choice at u near 1 by a few
// tokens in the tail.) A token with e below 2^-42 weighs 0 and is never chosen.
//
// Draws: sampling_uniform(seed, step) is core::uniform01 of the seed and the index of the
// generated token, so a seeded generation makes the same choices on either backend.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include <cuda_runtime_api.h>

#include "core/buffer.h"
#include "core/device.h"
#include "core/rng.h"

namespace models::ops {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  std::int64_t top_k = 0;    // 0: no top-k
  float top_p = 1.0f;        // 1: no top-p
};

// core::InputError naming the bad field: temperature must be finite and >= 0, top_k >= 0,
// top_p in (0, 1].
void check_sampling(const SamplingParams& params);

// exp(x) for x <= 0 in double, from IEEE multiplications and explicit fma only, so the host and
// the device round it identically: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor
// polynomial of degree 13 (Horner), times 2^k built from exponent bits. Within a few ulp of exp;
// 0 below -708 (and for -inf or NaN).
LLMTRAIN_HD inline double sampling_exp(double x) {
  if (!(x >= -708.0)) return 0.0;
  if (x > 0.0) x = 0.0;
  const double k = rint(x * 1.4426950408889634);
  double r = fma(-k, 6.93147180369123816490e-01, x);  // ln2, high part (exact product with k)
  r = fma(-k, 1.90821492927058770002e-10, r);         // ln2, low part
  constexpr double kInverseFactorial[14] = {1.0,
                                            1.0,
                                            0.5,
                                            1.6666666666666666e-01,
                                            4.1666666666666664e-02,
                                            8.3333333333333332e-03,
                                            1.3888888888888889e-03,
                                            1.9841269841269841e-04,
                                            2.4801587301587302e-05,
                                            2.7557319223985893e-06,
                                            2.7557319223985888e-07,
                                            2.5052108385441720e-08,
                                            2.0876756987868100e-09,
                                            1.6059043836821613e-10};
  double p = kInverseFactorial[13];
  for (int i = 12; i >= 0; --i) p = fma(p, r, kInverseFactorial[i]);
  const std::uint64_t bits = static_cast<std::uint64_t>(static_cast<std::int64_t>(k) + 1023) << 52;
#if defined(__CUDA_ARCH__)
  const double scale = __longlong_as_double(static_cast<long long>(bits));
#else
  double scale;
  std::memcpy(&scale, &bits, sizeof(scale));
#endif
  return p * scale;
}

// A token's weight: e in fixed point with kWeightBits fraction bits, rounded to nearest (even)
// the same way on host and device. e <= 1, so vocab * 2^kWeightBits < 2^64 up to
// kMaxSamplingVocab entries.
constexpr int kWeightBits = 41;
constexpr std::int64_t kMaxSamplingVocab = std::int64_t{1} << 22;
LLMTRAIN_HD inline std::uint64_t sampling_weight(double e) {
  constexpr double kScale = static_cast<double>(std::uint64_t{1} << kWeightBits);
#if defined(__CUDA_ARCH__)
  return __double2ull_rn(e * kScale);
#else
  return static_cast<std::uint64_t>(std::nearbyint(e * kScale));
#endif
}

inline bool is_greedy(const SamplingParams& params) { return params.temperature == 0.0f; }

// The uniform draw of generated token `step` (0 for the first one after the prompt).
inline float sampling_uniform(std::uint64_t seed, std::uint64_t step) { return core::uniform01(seed, step); }

// CPU reference: the chosen id. `uniform` in [0, 1) (ignored when greedy).
std::int32_t sample_cpu(std::span<const float> logits, const SamplingParams& params, float uniform);

// Bytes of device workspace sample_cuda needs for `vocab` (16-byte aligned start).
std::size_t sample_cuda_workspace_bytes(std::int64_t vocab);

// Writes the chosen id to the device int32 `out_id`, on `stream`; allocates nothing and never
// waits for the host, so only the id need ever cross to it. logits: device fp32 [vocab].
void sample_cuda(const float* logits, std::int64_t vocab, const SamplingParams& params, float uniform,
                 std::int32_t* out_id, void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// Sampling on a backend: owns the device workspace on cuda. `logits` and `out_id` live in the
// context's memory (host on cpu, device on cuda).
class TokenSampler {
 public:
  TokenSampler(const core::DeviceContext& context, std::int64_t vocab);

  void sample(const float* logits, const SamplingParams& params, float uniform, std::int32_t* out_id);
  std::int64_t vocab() const { return vocab_; }

 private:
  const core::DeviceContext& context_;
  std::int64_t vocab_;
  core::Buffer workspace_;  // cuda only
};

}  // namespace models::ops
