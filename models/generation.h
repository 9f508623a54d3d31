// Generation from a prompt through any family's decoder: prefill, then sample and step one token
// at a time (models/ops/sampling.h), the draws seeded per token. On cuda the sampled id stays on
// the device and feeds the next step directly; ids reach the host at the end, or after every
// token when stop ids are given. The `generate` tool and the trainer's samples both use it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/device.h"
#include "models/model.h"
#include "models/ops/sampling.h"

namespace models {

struct GenerationOptions {
  std::int64_t max_new_tokens = 64;
  ops::SamplingParams sampling;        // greedy by default
  std::uint64_t seed = 0;              // draw of new token t: ops::sampling_uniform(seed, t)
  std::vector<std::int32_t> stop_ids;  // generation ends after emitting one of these (kept in the output)
};

struct GenerationResult {
  std::vector<std::int32_t> ids;  // the new tokens (not the prompt)
  double prefill_seconds = 0.0;   // prompt in, first logits ready
  double decode_seconds = 0.0;    // the rest: every sampled token and every step
  bool stopped = false;           // ended on a stop id
};

// The decoder a user asks for (eval.decoder, sample.decoder, generate --decoder). automatic: the
// family's megakernel where it can take the model and the GPU (Qwen3 on a Hopper GPU), else the
// plain decoder; megakernel: the same, but running the plain one is worth a warning; plain: never
// the megakernel.
enum class DecoderChoice { automatic, megakernel, plain };
DecoderChoice parse_decoder_choice(const std::string& name);  // "auto", "megakernel", "plain"
const char* decoder_choice_name(DecoderChoice choice);

// spec.decoder() for `choice` (options.kind set from it). `note` (may be null) gets what was built
// and, when the megakernel was asked for and the plain decoder runs, why. nullptr when the family
// has no decoder on this backend.
std::unique_ptr<Decoder> choose_decoder(const ModelSpec& spec, optim::Slab& slab, const core::DeviceContext& context,
                                        DecoderOptions options, DecoderChoice choice, std::string* note);

// Resets `decoder`, prefills `prompt` (non-empty) and generates up to max_new_tokens tokens (the
// decoder's capacity must hold prompt + max_new_tokens, else core::InputError before any work).
// `context` is the decoder's backend; `vocab` its vocabulary size.
GenerationResult generate(Decoder& decoder, const core::DeviceContext& context, std::int64_t vocab,
                          std::span<const std::int32_t> prompt, const GenerationOptions& options);

}  // namespace models
