// Batch-1 generation with the Qwen3 decoder on one GPU (random weights of a preset's shape, through
// the model interface's decoder hook): the time of one decode step at context 64 and at 4096 (the
// median over timed steps after warm-up, CUDA events around each step), and tokens/s of a
// generation of --new-tokens tokens after a --prompt-tokens prompt (greedy and sampled, ids chosen
// on the device; median over repeats). Prints one JSON object; the PyTorch peer is
// bench/peer_decode.py and bench/record.py joins the two.
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "models/generation.h"
#include "models/model_config.h"
#include "models/qwen3/decoder_cuda.h"
#include "models/qwen3/family.h"
#include "models/registry.h"
#include "bench/random_weights.h"

namespace {

using bench::median;
using bench::random_weights;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Qwen3 batch-1 decode benchmark"};
  std::string preset = "qwen3-0.6b";
  std::int64_t prompt_tokens = 32, new_tokens = 256, short_context = 64, long_context = 4096;
  int warmup = 10, steps = 100, repeats = 5;
  app.add_option("--preset", preset);
  app.add_option("--prompt-tokens", prompt_tokens);
  app.add_option("--new-tokens", new_tokens);
  app.add_option("--short-context", short_context);
  app.add_option("--long-context", long_context);
  app.add_option("--warmup", warmup, "untimed steps before the timed ones");
  app.add_option("--steps", steps, "timed steps per context");
  app.add_option("--repeats", repeats, "timed generations (median)");
  bool run_sweep = false;
  app.add_flag("--sweep", run_sweep, "also time the step with other decoder settings");
  CLI11_PARSE(app, argc, argv);
  try {
    const core::DeviceContext ctx(core::Device::cuda(0));
    const models::Family& family = models::family("qwen3");
    const models::Shape shape = models::base_shape(family, preset);
    models::check_shape(family, shape, "decode_bench");
    const auto spec = family.spec(shape);
    optim::Slab slab(optim::SlabLayout(spec->parameters(), 1), ctx);
    random_weights(slab, ctx);
    const std::int64_t vocab = spec->vocab_size();
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(std::max(long_context, prompt_tokens)));
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 7919 + 13) % vocab);

    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    const auto elapsed_ms = [&] {
      CUDA_CHECK(cudaEventSynchronize(stop));
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
      return static_cast<double>(ms);
    };

    // Per-step time at a context: prefill `context` tokens, warm up, then time each step alone.
    const std::int64_t capacity = long_context + warmup + steps + 1;
    const auto step_ms = [&](models::Decoder& decoder, std::int64_t context) {
      decoder.reset();
      decoder.prefill({tokens.data(), static_cast<std::size_t>(context)});
      std::vector<double> ms;
      for (int i = 0; i < warmup + steps; ++i) {
        const auto token = tokens[static_cast<std::size_t>(i) % tokens.size()];
        CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
        decoder.step(token);
        CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
        const double t = elapsed_ms();
        if (i >= warmup) ms.push_back(t);
      }
      return median(ms);
    };
    double short_ms = 0, long_ms = 0;
    {
      auto decoder = spec->decoder(slab, ctx, {.max_tokens = capacity});
      short_ms = step_ms(*decoder, short_context);
      long_ms = step_ms(*decoder, long_context);
    }
    // Settings of the step (models/qwen3/decoder_cuda.h) against the defaults.
    nlohmann::json sweep = nlohmann::json::array();
    if (run_sweep) {
      const auto config = models::qwen3::config_from_shape(shape);
      const auto measure = [&](models::qwen3::CudaDecoderSettings settings, bool long_too) {
        models::qwen3::Qwen3CudaDecoder decoder(config, slab, ctx, {.max_tokens = capacity}, settings);
        nlohmann::json row = {{"cuda_graph", settings.cuda_graph},
                              {"attention_splits", settings.attention_splits},
                              {"matvec_blocks", settings.matvec_blocks},
                              {"step_ms_ctx" + std::to_string(short_context), step_ms(decoder, short_context)}};
        if (long_too) row["step_ms_ctx" + std::to_string(long_context)] = step_ms(decoder, long_context);
        sweep.push_back(row);
      };
      measure({.cuda_graph = false}, false);
      for (int splits : {16, 32, 64, 128, 256}) measure({.attention_splits = splits}, true);
      const int sms = ctx.multiprocessor_count();
      for (int blocks : {2, 4, 16, 32}) measure({.matvec_blocks = blocks * sms}, false);
    }

    // Generation: prompt, then new tokens chosen on the device.
    auto generation = [&](const models::ops::SamplingParams& sampling) {
      auto gen_decoder = spec->decoder(slab, ctx, {.max_tokens = prompt_tokens + new_tokens});
      models::GenerationOptions options;
      options.max_new_tokens = new_tokens;
      options.sampling = sampling;
      options.seed = 1;
      const std::span<const std::int32_t> prompt(tokens.data(), static_cast<std::size_t>(prompt_tokens));
      models::generate(*gen_decoder, ctx, vocab, prompt, options);  // warm-up (captures the step's graph)
      std::vector<double> tok_s, prefill_ms;
      for (int r = 0; r < repeats; ++r) {
        const auto result = models::generate(*gen_decoder, ctx, vocab, prompt, options);
        tok_s.push_back(static_cast<double>(result.ids.size()) / result.decode_seconds);
        prefill_ms.push_back(result.prefill_seconds * 1e3);
      }
      return std::pair{median(tok_s), median(prefill_ms)};
    };
    const auto [greedy_tok_s, prefill_ms] = generation({});
    const auto [sampled_tok_s, sampled_prefill_ms] = generation({.temperature = 0.8f, .top_k = 0, .top_p = 0.95f});
    (void)sampled_prefill_ms;

    // Bytes read per step: every weight matrix once (bf16), plus the embedding row.
    double weight_bytes = 0;
    for (const auto& p : spec->parameters()) {
      double numel = 1;
      for (const auto d : p.shape) numel *= static_cast<double>(d);
      if (p.name != "embed_tokens" || shape.value("tie_word_embeddings", true)) weight_bytes += 2.0 * numel;
    }
    nlohmann::json out = {
        {"bench", preset + " decode batch 1"},
        {"device", ctx.device_name()},
        {"ours_ms", 1e3 / greedy_tok_s},
        {"tok_s", greedy_tok_s},
        {"tok_s_sampled", sampled_tok_s},
        {"prompt_tokens", prompt_tokens},
        {"new_tokens", new_tokens},
        {"prefill_ms", prefill_ms},
        {"step_ms_ctx" + std::to_string(short_context), short_ms},
        {"step_ms_ctx" + std::to_string(long_context), long_ms},
        {"long_over_short", long_ms / short_ms},
        {"weight_gb_s_ctx" + std::to_string(short_context), weight_bytes / (short_ms * 1e-3) / 1e9},
        {"cuda_graph", true},
    };
    if (run_sweep) out["sweep"] = sweep;
    std::printf("%s\n", out.dump().c_str());
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(stop));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decode_bench: %s\n", e.what());
    return 1;
  }
}
