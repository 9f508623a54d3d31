#include "models/generation.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <string>

#include <sys/resource.h>
#include <unistd.h>

#include "core/buffer.h"
#include "core/error.h"

namespace models {

GenerationResult generate(Decoder& decoder, const core::DeviceContext& context, std::int64_t vocab,
                          std::span<const std::int32_t> prompt, const GenerationOptions& options) {
  ops::check_sampling(options.sampling);
  if (prompt.empty()) throw core::InputError("generate: the prompt is empty");
  if (options.max_new_tokens < 0) throw core::InputError("generate: max_new_tokens must be >= 0");
  const auto needed = static_cast<std::int64_t>(prompt.size()) + options.max_new_tokens;
  if (needed > decoder.capacity()) {
    throw core::InputError("generate: prompt (" + std::to_string(prompt.size()) + ") + max_new_tokens (" +
                           std::to_string(options.max_new_tokens) + ") exceed the decoder's capacity of " +
                           std::to_string(decoder.capacity()));
  }
  using Clock = std::chrono::steady_clock;
  const auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  GenerationResult result;
  ops::TokenSampler sampler(context, vocab);
  const auto count = static_cast<std::size_t>(options.max_new_tokens);
  // The sampled ids, in the backend's memory: each step reads the one before it from here.
  core::Buffer ids(context.device(), std::max<std::size_t>(count, 1) * sizeof(std::int32_t));
  auto* id_slots = ids.as<std::int32_t>();
  const auto is_stop = [&](std::int32_t id) {
    return std::find(options.stop_ids.begin(), options.stop_ids.end(), id) != options.stop_ids.end();
  };

  context.synchronize();
  const auto start = Clock::now();
  decoder.reset();
  decoder.prefill(prompt);
  context.synchronize();
  const auto prefilled = Clock::now();
  result.prefill_seconds = seconds(start, prefilled);

  const bool check_each = !options.stop_ids.empty();
  std::size_t made = 0;
  // Greedy without stop ids: a decoder with a fused path makes every token in one call.
  const bool fused = !check_each && options.sampling.temperature == 0.0f && count > 0 &&
                     decoder.append_greedy(static_cast<std::int64_t>(count), id_slots);
  if (fused) made = count;
  for (; !fused && made < count; ++made) {
    sampler.sample(decoder.logits(), options.sampling,
                   ops::sampling_uniform(options.seed, static_cast<std::uint64_t>(made)), id_slots + made);
    if (check_each) {
      std::int32_t id = 0;
      core::copy_bytes(&id, id_slots + made, sizeof(id), context.stream());
      context.synchronize();
      result.ids.push_back(id);
      if (is_stop(id)) {
        result.stopped = true;
        ++made;
        break;
      }
    }
    if (made + 1 < count) {
      if (context.is_cuda()) {
        decoder.step(0, id_slots + made);
      } else {
        decoder.step(id_slots[made]);
      }
    }
  }
  if (!check_each && made > 0) {
    result.ids.resize(made);
    core::copy_bytes(result.ids.data(), id_slots, made * sizeof(std::int32_t), context.stream());
  }
  context.synchronize();
  result.decode_seconds = seconds(prefilled, Clock::now());
  return result;
}

DecoderChoice parse_decoder_choice(const std::string& name) {
  if (name == "auto") return DecoderChoice::automatic;
  if (name == "megakernel") return DecoderChoice::megakernel;
  if (name == "plain") return DecoderChoice::plain;
  throw core::InputError("decoder: expected auto, megakernel or plain, got '" + name + "'");
}

const char* decoder_choice_name(DecoderChoice choice) {
  switch (choice) {
    case DecoderChoice::automatic: return "auto";
    case DecoderChoice::megakernel: return "megakernel";
    case DecoderChoice::plain: return "plain";
  }
  return "?";
}

std::unique_ptr<Decoder> choose_decoder(const ModelSpec& spec, optim::Slab& slab, const core::DeviceContext& context,
                                        DecoderOptions options, DecoderChoice choice, std::string* note) {
  options.kind = choice == DecoderChoice::plain ? DecoderKind::plain : DecoderKind::megakernel;
  std::string reason;
  options.fallback_reason = &reason;
  std::unique_ptr<Decoder> decoder = spec.decoder(slab, context, options);
  if (decoder && note != nullptr) {
    const std::string kind = decoder->kind();
    *note = kind + " decoder";
    if (options.kind == DecoderKind::megakernel && kind != "megakernel") {
      *note += " (" + (reason.empty() ? spec.family() + " has no megakernel" : reason) + ")";
    }
  }
  return decoder;
}

void check_decoder_capacity(std::int64_t max_tokens) {
  if (max_tokens <= 0) {
    throw core::InputError("decoder: max_tokens (prompt + new tokens) must be positive, got " +
                           std::to_string(max_tokens));
  }
}

void check_cuda_slab(const optim::Slab& slab, const core::DeviceContext& context, const std::string& what) {
  if (!context.is_cuda() || !(slab.device() == context.device())) {
    throw core::Error(what + ": needs a cuda slab and context");
  }
  if (slab.mirror_dtype() != core::DType::bf16) throw core::Error(what + ": the slab's mirror must be bf16");
}

const void* decoder_mirror_tensor(optim::Slab& slab, const void* whole_mirror, int tensor) {
  if (whole_mirror == nullptr) return slab.mirror_view(tensor).data;
  const std::int64_t offset = slab.layout().tensors()[static_cast<std::size_t>(tensor)].offset;
  return static_cast<const std::byte*>(whole_mirror) +
         offset * static_cast<std::int64_t>(core::dtype_size(slab.mirror_dtype()));
}

void check_decoder_prompt(std::span<const std::int32_t> tokens, std::int64_t position, std::int64_t capacity,
                          std::int64_t vocab) {
  check_decoder_room(position, static_cast<std::int64_t>(tokens.size()), capacity);
  check_decoder_ids(tokens, vocab);
}

void check_decoder_room(std::int64_t position, std::int64_t tokens, std::int64_t capacity) {
  if (position + tokens > capacity) {
    throw core::InputError("decoder: " + std::to_string(position + tokens) + " tokens exceed its capacity of " +
                           std::to_string(capacity) + " (max_tokens: prompt + new tokens)");
  }
}

namespace {

// Bytes this process can still get from the host: /proc/meminfo's MemAvailable (else the physical
// memory), less where a limit on its address space or data (ulimit -v, -d) is lower.
double host_available_bytes() {
  double available = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  double kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") available = kib * 1024.0;
  }
  for (const int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    rlimit limit{};
    if (::getrlimit(resource, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
      available = std::min(available, static_cast<double>(limit.rlim_cur));
    }
  }
  return available;
}

std::string gigabytes(double bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%.0f bytes (%.2f GB)", bytes, bytes / 1e9);
  return text;
}

}  // namespace

void check_decoder_state_fits(double bytes, std::int64_t positions, const core::Device& device) {
  double available = 0;
  if (device.is_cuda()) {
    std::size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    available = static_cast<double>(free);
  } else {
    available = host_available_bytes();
  }
  if (bytes > available) {
    throw core::InputError(
        "decoder: a KV cache for " + std::to_string(positions) + " positions (prompt + new tokens) needs " +
        gigabytes(bytes) + ", more than the " + gigabytes(available) + " " +
        (device.is_cuda() ? "free on the GPU" : "of host memory available") + "; ask for fewer new tokens");
  }
}

void check_decoder_ids(std::span<const std::int32_t> ids, std::int64_t vocab) {
  for (const std::int32_t id : ids) {
    if (id < 0 || id >= vocab) {
      throw core::InputError("decoder: token id " + std::to_string(id) + " outside the vocabulary [0, " +
                             std::to_string(vocab) + ")");
    }
  }
}

}  // namespace models
