// Batch-1 greedy decoding with the Qwen3 decode megakernel (random bf16 weights of a preset's
// shape) against the memory-bandwidth floor measured in the same run.
//
// Copy bandwidth: cudaMemcpy device to device of a 1 GiB buffer (bytes read + bytes written over
// the time, best of 5). The floor of a token at position p is (weight bytes + cache bytes of the p
// earlier positions) / bandwidth; a run's floor sums it over its tokens.
// Per geometry variant (--variants, e.g. "w8-p32-n0-s16-c128": consumer warps, page KB, pages (0:
// as many as fit), max attention splits, min chunk; "-noevict", "-b<blocks>", "-f<pages in flight>"
// optional; p0: the page size the decoder picks for the model):
//   prompt --prompt tokens (teacher-forced), then --new-tokens greedy tokens in one launch, and
//   the same with one launch per token; then at each --contexts position (a cache of random rows),
//   --context-tokens greedy tokens in one launch; and a --prefill-tokens prompt (default 512)
//   through prefill() (the batched path both decoders share), against the plain decoder's.
// With --profile N, each variant also decodes N greedy tokens with every unit timed and prints
// where a token's time goes, phase by phase (MegakernelDecoder::profile_greedy).
// Each time is the median of --repeats runs (CUDA events). The plain CUDA decoder (graph-captured
// steps, greedy on the device through models::generate) runs once per preset for reference.
// Prints a line per variant to stderr and one JSON object to stdout (or --out).
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include "core/buffer.h"
#include "core/error.h"
#include "models/generation.h"
#include "models/qwen3/config.h"
#include "models/qwen3/decode_megakernel_plan.h"
#include "models/qwen3/decoder_cuda.h"
#include "models/qwen3/megakernel_decoder.h"

namespace {

namespace q3 = models::qwen3;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timer {
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaStream_t stream = nullptr;
  explicit Timer(cudaStream_t s) : stream(s) {
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~Timer() {
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
  }
  void begin() { CUDA_CHECK(cudaEventRecord(start, stream)); }
  double end_seconds() {
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms * 1e-3;
  }
};

// Device copy bandwidth, bytes/s (read + write).
double copy_bandwidth(const core::DeviceContext& ctx) {
  const std::size_t bytes = std::size_t{1} << 30;
  core::Buffer a(ctx.device(), bytes), b(ctx.device(), bytes);
  a.fill_bytes(1, ctx.stream());
  Timer timer(ctx.stream());
  double best = 1e30;
  for (int i = 0; i < 6; ++i) {
    timer.begin();
    CUDA_CHECK(cudaMemcpyAsync(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice, ctx.stream()));
    const double s = timer.end_seconds();
    if (i > 0) best = std::min(best, s);
  }
  return 2.0 * static_cast<double>(bytes) / best;
}

// Random weights straight into the bf16 mirror: matrices N(0, 0.02^2), norms 1 + N(0, 0.1^2).
void random_mirror(optim::Slab& slab, const core::DeviceContext& ctx) {
  std::uint64_t seed = 1;
  for (std::size_t i = 0; i < slab.layout().tensors().size(); ++i) {
    const auto& t = slab.layout().tensors()[i];
    auto* data = static_cast<std::uint16_t*>(slab.mirror_view(static_cast<int>(i)).data);
    if (t.spec.name.find("norm") != std::string::npos) {
      std::vector<std::uint16_t> host(static_cast<std::size_t>(t.numel));
      for (std::size_t j = 0; j < host.size(); ++j) {
        const float v = 1.0f + 0.1f * static_cast<float>(static_cast<int>((j * 2654435761u) % 2001) - 1000) / 1000.0f;
        std::uint32_t bits;
        std::memcpy(&bits, &v, 4);
        host[j] = static_cast<std::uint16_t>(bits >> 16);
      }
      core::copy_bytes(data, host.data(), host.size() * 2, ctx.stream());
      ctx.synchronize();
    } else {
      q3::megakernel::fill_bf16_normal(data, t.numel, seed++, 0.02f, ctx.stream());
    }
  }
  ctx.synchronize();
}

q3::MegakernelSettings parse_variant(const std::string& text) {
  q3::MegakernelSettings s;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, '-')) {
    if (part.empty()) continue;
    if (part == "noevict") {
      s.evict_first = false;
      continue;
    }
    const int value = std::stoi(part.substr(1));
    switch (part[0]) {
      case 'w': s.consumer_warps = value; break;
      case 'p': s.page_bytes = value * 1024; break;
      case 'n': s.pages = value; break;
      case 's': s.max_splits = value; break;
      case 'c': s.min_chunk = value; break;
      case 'b': s.blocks = value; break;
      case 'f': s.inflight_pages = value; break;
      default: throw core::InputError("variant '" + text + "': unknown part '" + part + "'");
    }
  }
  return s;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Qwen3 decode megakernel benchmark"};
  std::string presets = "qwen3-0.6b", variants = "w8-p0-n0-s16-c64", contexts = "1024,8192,32768", out;
  std::int64_t prompt = 32, new_tokens = 1024, context_tokens = 128, prefill_tokens = 512;
  int repeats = 3;
  bool plain = true, per_token = true;
  std::int64_t profile_tokens = 0;
  app.add_option("--presets", presets, "comma-separated presets");
  app.add_option("--variants", variants, "comma-separated geometries (see the top of the source)");
  app.add_option("--contexts", contexts, "comma-separated context lengths (empty: none)");
  app.add_option("--prompt", prompt);
  app.add_option("--new-tokens", new_tokens);
  app.add_option("--context-tokens", context_tokens, "greedy tokens timed at each context");
  app.add_option("--prefill-tokens", prefill_tokens, "prompt tokens of the timed prefill (0: none)");
  app.add_option("--repeats", repeats);
  app.add_option("--plain", plain, "also time the plain CUDA decoder");
  app.add_option("--per-token", per_token, "also time one launch per token");
  app.add_option("--out", out, "JSON file (default: stdout)");
  app.add_option("--profile", profile_tokens,
                 "per variant, also this many greedy tokens with every unit timed: where a token's time goes");
  std::string trace_out;
  app.add_option("--trace-out", trace_out,
                 "with --profile: every unit's marks of 8 tokens to this file (the preset and variant appended "
                 "to its name); bench/megakernel_trace.py summarises it");
  CLI11_PARSE(app, argc, argv);
  try {
    const core::DeviceContext ctx(core::Device::cuda(0));
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, ctx.device().index));
    const double bandwidth = copy_bandwidth(ctx);
    std::fprintf(stderr, "%s, %d SMs, copy bandwidth %.0f GB/s\n", prop.name, prop.multiProcessorCount,
                 bandwidth / 1e9);
    nlohmann::ordered_json report;
    report["bench"] = "megakernel";
    report["device"] = prop.name;
    report["sms"] = prop.multiProcessorCount;
    report["copy_bandwidth_gbs"] = bandwidth / 1e9;
    report["prompt"] = prompt;
    report["new_tokens"] = new_tokens;
    report["prefill_tokens"] = prefill_tokens;
    report["results"] = nlohmann::json::array();
    std::vector<std::int64_t> context_list;
    for (const auto& c : split_list(contexts)) context_list.push_back(std::stoll(c));
    const std::int64_t longest = context_list.empty() ? 0 : *std::max_element(context_list.begin(), context_list.end());
    Timer timer(ctx.stream());

    for (const std::string& preset : split_list(presets)) {
      const q3::Qwen3Config config = q3::preset(preset);
      optim::Slab slab(optim::SlabLayout(q3::parameter_specs(config), 1), ctx);
      random_mirror(slab, ctx);
      std::vector<std::int32_t> prompt_ids(static_cast<std::size_t>(prompt));
      for (std::size_t i = 0; i < prompt_ids.size(); ++i) {
        prompt_ids[i] = static_cast<std::int32_t>((i * 7919 + 13) % static_cast<std::size_t>(config.vocab_size));
      }
      const std::int64_t capacity = std::max({prompt + new_tokens, longest + context_tokens + 1, prefill_tokens + 1});
      std::vector<std::int32_t> long_prompt(static_cast<std::size_t>(prefill_tokens));
      for (std::size_t i = 0; i < long_prompt.size(); ++i) {
        long_prompt[i] = static_cast<std::int32_t>((i * 104729 + 7) % static_cast<std::size_t>(config.vocab_size));
      }
      // Median seconds of prefill(long_prompt) from an empty cache by each decoder, the two
      // alternating run by run (the first run of each warms up).
      auto time_prefills = [&](models::Decoder& first, models::Decoder& second) {
        std::vector<double> times[2];
        for (int r = 0; r <= 2 * repeats; ++r) {
          for (int k = 0; k < 2; ++k) {
            models::Decoder& decoder = k == 0 ? first : second;
            decoder.reset();
            timer.begin();
            decoder.prefill(long_prompt);
            const double s = timer.end_seconds();
            if (r > 0) times[k].push_back(s);
          }
        }
        return std::pair<double, double>{median(times[0]), median(times[1])};
      };
      nlohmann::ordered_json preset_json;
      preset_json["preset"] = preset;

      if (plain) {
        q3::Qwen3CudaDecoder decoder(config, slab, ctx, {.max_tokens = prompt + new_tokens});
        models::GenerationOptions options;
        options.max_new_tokens = new_tokens;
        std::vector<double> times;
        for (int r = 0; r < repeats; ++r) {
          const auto result = models::generate(decoder, ctx, config.vocab_size, prompt_ids, options);
          times.push_back(result.decode_seconds);
        }
        preset_json["plain_tokens_per_s"] = static_cast<double>(new_tokens) / median(times);
        std::fprintf(stderr, "%s plain decoder: %.0f tokens/s\n", preset.c_str(),
                     static_cast<double>(new_tokens) / median(times));
      }

      nlohmann::ordered_json rows = nlohmann::json::array();
      for (const std::string& variant : split_list(variants)) {
        nlohmann::ordered_json row;
        row["variant"] = variant;
        try {
          q3::MegakernelDecoder decoder(config, slab, ctx, {.max_tokens = capacity}, parse_variant(variant));
          row["geometry"] = decoder.describe();
          const double weight_bytes = static_cast<double>(decoder.weight_bytes_per_token());
          auto floor_seconds = [&](std::int64_t first_position, std::int64_t tokens) {
            double bytes = 0;
            for (std::int64_t p = first_position; p < first_position + tokens; ++p) {
              bytes += weight_bytes + static_cast<double>(decoder.cache_bytes_read(p));
            }
            return bytes / bandwidth;
          };
          // Prompt, then new tokens in one launch (and one launch per token).
          std::vector<double> one, each;
          for (int r = 0; r < repeats; ++r) {
            decoder.reset();
            decoder.prefill(prompt_ids);
            timer.begin();
            decoder.greedy(new_tokens);
            one.push_back(timer.end_seconds());
            decoder.check();
            if (per_token) {
              decoder.reset();
              decoder.prefill(prompt_ids);
              timer.begin();
              for (std::int64_t t = 0; t < new_tokens; ++t) decoder.greedy(1);
              each.push_back(timer.end_seconds());
              decoder.check();
            }
          }
          const double floor = floor_seconds(prompt, new_tokens);
          row["tokens_per_s"] = static_cast<double>(new_tokens) / median(one);
          row["floor_tokens_per_s"] = static_cast<double>(new_tokens) / floor;
          row["pct_of_floor"] = 100.0 * floor / median(one);
          if (per_token) {
            row["tokens_per_s_launch_per_token"] = static_cast<double>(new_tokens) / median(each);
            row["pct_of_floor_launch_per_token"] = 100.0 * floor / median(each);
          }
          std::fprintf(stderr, "%s %-28s %-60s prompt %lld + %lld: %7.0f tok/s (%5.1f%% of floor %6.0f)%s",
                       preset.c_str(), variant.c_str(), decoder.describe().c_str(), static_cast<long long>(prompt),
                       static_cast<long long>(new_tokens), static_cast<double>(new_tokens) / median(one),
                       100.0 * floor / median(one), static_cast<double>(new_tokens) / floor, per_token ? "" : "\n");
          if (per_token) std::fprintf(stderr, "; per-token launches %5.1f%%\n", 100.0 * floor / median(each));
          nlohmann::ordered_json context_rows = nlohmann::json::array();
          for (std::int64_t context : context_list) {
            std::vector<double> times;
            for (int r = 0; r < repeats; ++r) {
              decoder.reset();
              decoder.fake_context(context, 7);
              decoder.step(prompt_ids[0]);
              timer.begin();
              decoder.greedy(context_tokens);
              times.push_back(timer.end_seconds());
              decoder.check();
            }
            const double f = floor_seconds(context + 1, context_tokens);
            nlohmann::ordered_json c;
            c["context"] = context;
            c["tokens_per_s"] = static_cast<double>(context_tokens) / median(times);
            c["floor_tokens_per_s"] = static_cast<double>(context_tokens) / f;
            c["pct_of_floor"] = 100.0 * f / median(times);
            std::fprintf(stderr, "    context %6lld: %7.0f tok/s (%5.1f%% of floor %6.0f)\n",
                         static_cast<long long>(context), static_cast<double>(context_tokens) / median(times),
                         100.0 * f / median(times), static_cast<double>(context_tokens) / f);
            context_rows.push_back(c);
          }
          row["contexts"] = context_rows;
          if (prefill_tokens > 0) {
            q3::Qwen3CudaDecoder plain_decoder(config, slab, ctx, {.max_tokens = prefill_tokens + 1});
            const auto [mega_seconds, plain_seconds] = time_prefills(decoder, plain_decoder);
            row["prefill_ms"] = mega_seconds * 1e3;
            row["plain_prefill_ms"] = plain_seconds * 1e3;
            std::fprintf(stderr, "    prefill of %lld tokens: %.3f ms (plain decoder %.3f ms, alternating)\n",
                         static_cast<long long>(prefill_tokens), mega_seconds * 1e3, plain_seconds * 1e3);
          }
          if (profile_tokens > 0) {
            decoder.reset();
            decoder.prefill(prompt_ids);
            const std::string trace = trace_out.empty() ? "" : trace_out + "." + preset + "." + variant;
            const std::string summary = decoder.profile_greedy(std::min(profile_tokens, capacity - prompt), trace);
            std::fprintf(stderr, "%s", summary.c_str());
            row["profile"] = summary;
          }
        } catch (const core::Error& e) {
          row["error"] = e.what();
          std::fprintf(stderr, "%s %s: %s\n", preset.c_str(), variant.c_str(), e.what());
        }
        rows.push_back(row);
        if (!out.empty()) {  // after every variant, so a run cut short keeps what it measured
          nlohmann::ordered_json partial = report;
          nlohmann::ordered_json current = preset_json;
          current["variants"] = rows;
          partial["results"].push_back(current);
          std::ofstream(out) << partial.dump(1) << "\n";
        }
      }
      preset_json["variants"] = rows;
      report["results"].push_back(preset_json);
    }
    const std::string text = report.dump(1);
    if (out.empty()) {
      std::printf("%s\n", text.c_str());
    } else {
      std::ofstream(out) << text << "\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megakernel_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
