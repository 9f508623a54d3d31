// generate PATH (--prompt TEXT | --prompt-ids 1,2,3) [options]: text from a model, batch 1.
// PATH is a Hugging Face folder (config.json + safetensors) or a training checkpoint (a step
// directory, or a run directory meaning its newest complete step). The prompt is prefilled in one
// pass and the new tokens come one at a time from the family's decoder (KV cache), chosen on the
// backend (greedy by default; temperature, top-k, top-p and a seed otherwise). --decoder auto (the
// default) decodes with the family's megakernel where it can take the model (Qwen3 on a Hopper
// GPU), else the plain decoder. Text goes through the model's tokenizer: the folder's
// tokenizer.json, the run's data.tokenizer for a checkpoint, else bytes; --tokenizer overrides it.
// stdout gets the prompt and its continuation as text (or, with --ids, every id comma-separated);
// stderr gets the prefill and decode speeds and the decoder. Generation ends early at an
// end-of-sequence id of config.json / generation_config.json (--ignore-eos: never).
// Exit status: 0, 2 for bad input (named), 1 otherwise.
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/error.h"
#include "core/standard_streams.h"
#include "models/generation.h"
#include "optim/slab.h"
#include "text/tokenizer.h"
#include "tools/model_source.h"

namespace {

namespace fs = std::filesystem;

std::vector<std::int32_t> parse_ids(const std::string& list) {
  std::vector<std::int32_t> ids;
  std::size_t at = 0;
  while (at <= list.size()) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    std::string item = list.substr(at, comma - at);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    std::int64_t value = 0;
    const auto [end, error] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || error != std::errc() || end != item.data() + item.size() || value < 0 || value > INT32_MAX) {
      throw core::InputError("--prompt-ids: expected non-negative integers separated by commas, got '" + item + "'");
    }
    ids.push_back(static_cast<std::int32_t>(value));
    at = comma + 1;
  }
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  const core::ClosedStreams closed = core::guard_standard_streams();
  CLI::App app{"Generate text from a Hugging Face folder or a training checkpoint (batch 1, KV cache)"};
  std::string path, prompt, prompt_ids, device, tokenizer_spec, decoder_name = "auto";
  bool have_prompt = false;
  models::GenerationOptions options;
  options.max_new_tokens = 128;
  bool print_ids = false, skip_special = true, ignore_eos = false;
  app.add_option("path", path, "Hugging Face folder, checkpoint step directory or run directory")->required();
  auto* text_option = app.add_option("--prompt", prompt, "prompt text (encoded with the model's tokenizer)");
  auto* ids_option = app.add_option("--prompt-ids", prompt_ids, "prompt as token ids, e.g. 1,2,3");
  text_option->excludes(ids_option);
  app.add_option("--max-new-tokens", options.max_new_tokens, "tokens to generate (default 128)");
  app.add_option("--temperature", options.sampling.temperature, "0 = greedy (default); > 0 samples");
  app.add_option("--top-k", options.sampling.top_k, "keep the k most likely tokens (0 = off)");
  app.add_option("--top-p", options.sampling.top_p, "keep the smallest set with this probability (1 = off)");
  app.add_option("--seed", options.seed, "seed of the sampling draws (default 0)");
  app.add_option("--device", device, "cpu or cuda (default: cuda when a GPU is present)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--decoder", decoder_name,
                 "auto (default: the megakernel where it can take the model, e.g. Qwen3 on a Hopper GPU), "
                 "megakernel or plain")
      ->check(CLI::IsMember({"auto", "megakernel", "plain"}));
  app.add_option("--tokenizer", tokenizer_spec, "byte or a tokenizer.json, instead of the model's own");
  app.add_flag("--ids", print_ids, "print the ids (prompt and new, comma-separated) instead of text");
  app.add_flag("--skip-special-tokens,!--keep-special-tokens", skip_special,
               "leave special tokens out of the text (default on)");
  app.add_flag("--ignore-eos", ignore_eos, "do not stop at the model's end-of-sequence ids");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  have_prompt = text_option->count() > 0;
  try {
    if (closed.out) throw core::InputError("standard output is closed: the generated text would be lost");
    if (!have_prompt && ids_option->count() == 0) throw core::InputError("give --prompt TEXT or --prompt-ids 1,2,3");
    models::ops::check_sampling(options.sampling);
    if (options.max_new_tokens < 0) throw core::InputError("--max-new-tokens must be >= 0");

    tools::ModelSource source = tools::load_model_source(path, device, tokenizer_spec);
    device = source.device;
    const models::ModelSpec& spec = *source.weights.spec;
    const std::unique_ptr<text::Tokenizer>& tokenizer = source.tokenizer;
    if (!source.weights.checkpoint.empty()) {
      std::fprintf(stderr, "generate: loaded %s\n", source.weights.checkpoint.c_str());
    }
    std::vector<std::int32_t> ids;
    if (have_prompt) {
      for (const std::uint32_t id : tokenizer->encode(prompt)) ids.push_back(static_cast<std::int32_t>(id));
    } else {
      ids = parse_ids(prompt_ids);
    }
    if (ids.empty()) throw core::InputError("the prompt is empty");
    for (const std::int32_t id : ids) {
      if (id >= spec.vocab_size()) {
        throw core::InputError("prompt id " + std::to_string(id) + " is outside the model's vocabulary of " +
                               std::to_string(spec.vocab_size()));
      }
    }
    // Compared without forming the sum, which a huge --max-new-tokens would overflow.
    const auto prompt_tokens = static_cast<std::int64_t>(ids.size());
    if (prompt_tokens > spec.max_sequence_length() ||
        options.max_new_tokens > spec.max_sequence_length() - prompt_tokens) {
      throw core::InputError("prompt (" + std::to_string(ids.size()) + " tokens) + --max-new-tokens (" +
                             std::to_string(options.max_new_tokens) + ") exceed the model's " +
                             std::to_string(spec.max_sequence_length()) + " positions");
    }
    const std::int64_t needed = prompt_tokens + options.max_new_tokens;
    if (!ignore_eos) options.stop_ids = source.eos_ids;
    const core::DeviceContext& context = *source.context;
    optim::Slab& slab = *source.slab;
    const models::DecoderChoice choice = models::parse_decoder_choice(decoder_name);
    std::string decoder_note;
    const auto decoder = models::choose_decoder(spec, slab, context, {.max_tokens = needed}, choice, &decoder_note);
    if (!decoder) throw core::InputError(spec.family() + " has no decoder on " + device);
    if (choice == models::DecoderChoice::megakernel && decoder->kind() != std::string("megakernel")) {
      std::fprintf(stderr, "generate: warning: --decoder megakernel, running the %s\n", decoder_note.c_str());
    }

    models::GenerationResult result;
    if (options.max_new_tokens > 0) {
      result = models::generate(*decoder, context, spec.vocab_size(), ids, options);
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      decoder->prefill(ids);
      context.synchronize();
      result.prefill_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    std::vector<std::int32_t> all = ids;
    all.insert(all.end(), result.ids.begin(), result.ids.end());
    if (print_ids) {
      std::string line;
      for (std::size_t i = 0; i < all.size(); ++i) line += (i ? "," : "") + std::to_string(all[i]);
      std::printf("%s\n", line.c_str());
    } else {
      std::printf("%s\n", tokenizer->display_text(all, skip_special).c_str());
    }
    core::finish_standard_output();
    const double new_tokens = static_cast<double>(result.ids.size());
    std::fprintf(
        stderr, "prefill: %zu tokens in %.2f ms (%.0f tok/s) | decode: %zu tokens in %.3f s (%.1f tok/s)%s | %s, %s\n",
        ids.size(), result.prefill_seconds * 1e3, static_cast<double>(ids.size()) / result.prefill_seconds,
        result.ids.size(), result.decode_seconds, result.decode_seconds > 0 ? new_tokens / result.decode_seconds : 0.0,
        result.stopped ? ", stopped at an end-of-sequence id" : "", device.c_str(), decoder_note.c_str());
    return 0;
  } catch (const core::InputError& e) {
    std::fprintf(stderr, "generate: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "generate: out of host memory (fewer --max-new-tokens or a smaller model may fit)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "generate: %s\n", e.what());
    return 1;
  }
}
