// Benchmark of the GPU linear layer (LinearPlan, cuBLASLt) on Qwen3-0.6B's projection shapes at
// 16384 tokens: forward y = x W^T, input gradient dx = dy W (bf16) and weight gradient
// dW += dy^T x (fp32, accumulated), each in TFLOP/s (2 * tokens * in * out per product); and the
// fused lm_head + cross-entropy backward (CrossEntropyPlan: loss, dhidden, dW) at Qwen3's
// vocabulary, with other chunk sizes and the time of each product of one chunk. CUDA events around
// a batch of calls, warm-up first, median of the batches.
// Prints one JSON object; bench/peer_linear.py times PyTorch on the same shapes in the same run
// and writes the joined records.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/linear.h"

namespace {

namespace ops = models::ops;
using bf16 = __nv_bfloat16;

struct Projection {
  std::string name;
  std::int64_t in, out;
};

// Qwen3-0.6B: hidden 1024, q 2048 + k 1024 + v 1024, o 2048 -> 1024, gate + up 2 x 3072, down 3072 -> 1024.
const std::vector<Projection> kQwen3Projections = {
    {"qkv", 1024, 4096}, {"o_proj", 2048, 1024}, {"gate_up", 1024, 6144}, {"down", 3072, 1024}};

// Uniform [-scale, scale) bf16 values from a counter-based stream, uploaded to a new device buffer.
core::Buffer random_bf16(const core::DeviceContext& context, std::size_t n, std::uint64_t seed, float scale) {
  std::vector<std::uint16_t> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = core::float_to_bf16(scale * (2.0f * core::uniform01(seed, i) - 1.0f));
  core::Buffer buffer(context.device(), n * sizeof(std::uint16_t));
  core::copy_bytes(buffer.data(), host.data(), buffer.bytes(), context.stream());
  context.synchronize();
  return buffer;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds per call of `call`, timed in batches of `batch` calls.
double time_ms(const core::DeviceContext& context, const std::function<void()>& call, int warmup, int samples,
               int batch) {
  cudaEvent_t start{}, stop{};
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<double> ms;
  try {
    for (int i = 0; i < warmup; ++i) call();
    for (int s = 0; s < samples; ++s) {
      CUDA_CHECK(cudaEventRecord(start, context.stream()));
      for (int i = 0; i < batch; ++i) call();
      CUDA_CHECK(cudaEventRecord(stop, context.stream()));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float elapsed = 0.0f;
      CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
      ms.push_back(static_cast<double>(elapsed) / batch);
    }
  } catch (...) {
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
    throw;
  }
  CUDA_CHECK(cudaEventDestroy(start));
  CUDA_CHECK(cudaEventDestroy(stop));
  return median(ms);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"GPU linear layer and fused cross-entropy benchmark (Qwen3-0.6B shapes)"};
  std::int64_t tokens = 16384, vocab = 151936, hidden = 1024;
  int warmup = 10, samples = 30, batch = 10;
  bool cross_entropy = true;
  app.add_option("--tokens", tokens, "rows of every product");
  app.add_option("--warmup", warmup, "untimed calls");
  app.add_option("--samples", samples, "timed batches (median reported)");
  app.add_option("--batch", batch, "calls per timed batch");
  app.add_option("--vocab", vocab, "cross-entropy vocabulary");
  app.add_flag("!--no-cross-entropy", cross_entropy, "skip the cross-entropy benchmark");
  std::vector<std::int64_t> ce_chunks = {384, 1536, 3072, 6144};
  app.add_option("--ce-chunks", ce_chunks, "cross-entropy chunk sizes timed besides the default");
  std::vector<std::int64_t> split_rows = {4480, 8192, 9216, 16384, 18992};
  app.add_option("--split-rows", split_rows, "vocabulary rows per window of the vocabulary-split backward");
  CLI11_PARSE(app, argc, argv);

  try {
    if (core::cuda_device_count() == 0) {
      std::fprintf(stderr, "linear_bench: no CUDA device\n");
      return 1;
    }
    core::DeviceContext context(core::Device::cuda(0));
    std::int64_t max_in = 0, max_out = 0, max_weight = 0;
    for (const auto& p : kQwen3Projections) {
      max_in = std::max(max_in, p.in);
      max_out = std::max(max_out, p.out);
      max_weight = std::max(max_weight, p.in * p.out);
    }
    const auto n = [](std::int64_t v) { return static_cast<std::size_t>(v); };
    core::Buffer x = random_bf16(context, n(tokens * max_in), 1, 1.0f);
    core::Buffer dy = random_bf16(context, n(tokens * max_out), 2, 1.0f);
    core::Buffer w = random_bf16(context, n(max_weight), 3, 0.03f);
    core::Buffer y(context.device(), n(tokens * max_out) * 2), dx(context.device(), n(tokens * max_in) * 2);
    core::Buffer dw(context.device(), n(max_weight) * sizeof(float));
    dw.fill_bytes(0, context.stream());
    core::Buffer workspace(context.device(), ops::linear_workspace_bytes());
    const ops::DeviceWorkspace ws{workspace.data(), workspace.bytes()};
    ops::LinearPlan plan(context);

    nlohmann::json results = nlohmann::json::array();
    for (const auto& p : kQwen3Projections) {
      const double flop = 2.0 * static_cast<double>(tokens) * static_cast<double>(p.in) * static_cast<double>(p.out);
      const std::string shape = std::to_string(p.in) + "x" + std::to_string(p.out);
      const std::vector<std::pair<std::string, std::function<void()>>> passes = {
          {"forward", [&] { plan.forward(x.as<bf16>(), w.as<bf16>(), tokens, p.in, p.out, y.as<bf16>(), ws); }},
          {"dgrad", [&] { plan.backward_input(dy.as<bf16>(), w.as<bf16>(), tokens, p.in, p.out, dx.as<bf16>(), ws); }},
          {"wgrad",
           [&] { plan.backward_weight(dy.as<bf16>(), x.as<bf16>(), tokens, p.in, p.out, dw.as<float>(), ws); }},
      };
      for (const auto& [pass, call] : passes) {
        const double ms = time_ms(context, call, warmup, samples, batch);
        results.push_back({{"bench", "linear_" + pass + "_" + p.name + "_" + shape},
                           {"pass", pass},
                           {"tokens", tokens},
                           {"in", p.in},
                           {"out", p.out},
                           {"ours_ms", ms},
                           {"tflops", flop / (ms * 1e-3) / 1e12}});
        std::fprintf(stderr, "%-32s %8.4f ms %7.1f TFLOP/s\n", results.back()["bench"].get<std::string>().c_str(), ms,
                     flop / (ms * 1e-3) / 1e12);
      }
    }

    if (cross_entropy) {
      core::Buffer h = random_bf16(context, n(tokens * hidden), 4, 1.0f);
      core::Buffer head = random_bf16(context, n(vocab * hidden), 5, 0.05f);
      std::vector<std::int32_t> host_targets(n(tokens));
      for (std::size_t i = 0; i < host_targets.size(); ++i) {
        host_targets[i] = static_cast<std::int32_t>(core::uniform01(6, i) * static_cast<float>(vocab)) % vocab;
      }
      core::Buffer targets(context.device(), host_targets.size() * sizeof(std::int32_t));
      core::copy_bytes(targets.data(), host_targets.data(), targets.bytes(), context.stream());
      core::Buffer dh(context.device(), n(tokens * hidden) * 2);
      core::Buffer dhead(context.device(), n(vocab * hidden) * sizeof(float));
      dhead.fill_bytes(0, context.stream());
      core::Buffer losses(context.device(), n(tokens) * sizeof(float)), mean(context.device(), sizeof(float)),
          count(context.device(), sizeof(std::int32_t));
      const std::int64_t chunk = ops::cross_entropy_chunk_tokens_cuda(vocab, 0);
      std::size_t workspace_bytes = ops::cross_entropy_workspace_bytes(tokens, vocab);
      for (const std::int64_t c : ce_chunks) {
        workspace_bytes = std::max(workspace_bytes, ops::cross_entropy_workspace_bytes(tokens, vocab, c));
      }
      core::Buffer ce_workspace(context.device(), workspace_bytes);
      ops::CrossEntropyPlan ce(context);
      const ops::CrossEntropyDeviceOutputs outputs{losses.as<float>(), mean.as<float>(), count.as<std::int32_t>()};
      const auto backward = [&](std::int64_t chunk_tokens) {
        ce.backward(h.as<bf16>(), head.as<bf16>(), targets.as<std::int32_t>(), tokens, hidden, vocab, dh.as<bf16>(),
                    dhead.as<float>(), 1.0f, outputs, {ce_workspace.data(), ce_workspace.bytes()}, chunk_tokens);
      };
      context.synchronize();
      const int ce_samples = std::max(5, samples / 3);
      const double ms = time_ms(
          context, [&] { backward(0); }, 3, ce_samples, 1);
      const double flop = 6.0 * static_cast<double>(tokens) * static_cast<double>(vocab) * static_cast<double>(hidden);
      // Other chunk sizes, and the three products of one default chunk timed alone (the row
      // kernel is the rest of the chunk's share of the total).
      nlohmann::json sweep = nlohmann::json::object();
      for (const std::int64_t c : ce_chunks)
        sweep[std::to_string(c)] = time_ms(
            context, [&] { backward(c); }, 2, ce_samples, 1);
      const ops::DeviceWorkspace gemm_ws{
          static_cast<char*>(ce_workspace.data()) + (workspace_bytes - ops::linear_workspace_bytes()),
          ops::linear_workspace_bytes()};
      auto* logits = ce_workspace.as<bf16>();
      ops::LinearPlan ce_gemms(context);
      const double logits_ms = time_ms(
          context, [&] { ce_gemms.forward(h.as<bf16>(), head.as<bf16>(), chunk, hidden, vocab, logits, gemm_ws); },
          warmup, samples, 1);
      const double dhidden_ms = time_ms(
          context,
          [&] { ce_gemms.backward_input(logits, head.as<bf16>(), chunk, hidden, vocab, dh.as<bf16>(), gemm_ws); },
          warmup, samples, 1);
      const double dweight_ms = time_ms(
          context,
          [&] { ce_gemms.backward_weight(logits, h.as<bf16>(), chunk, hidden, vocab, dhead.as<float>(), gemm_ws); },
          warmup, samples, 1);
      const double chunks = static_cast<double>(tokens) / static_cast<double>(chunk);
      const nlohmann::json breakdown = {{"logits_gemm", logits_ms},
                                        {"dhidden_gemm", dhidden_ms},
                                        {"dweight_gemm", dweight_ms},
                                        {"rows_and_rest", ms / chunks - logits_ms - dhidden_ms - dweight_ms}};
      results.push_back({{"bench", "cross_entropy_fwd_bwd_qwen3"},
                         {"pass", "cross_entropy"},
                         {"tokens", tokens},
                         {"in", hidden},
                         {"out", vocab},
                         {"chunk_tokens", chunk},
                         {"workspace_mib", static_cast<double>(ce_workspace.bytes()) / (1 << 20)},
                         {"ours_ms", ms},
                         {"tflops", flop / (ms * 1e-3) / 1e12},
                         {"tokens_per_s", static_cast<double>(tokens) / (ms * 1e-3)},
                         {"sweep_ms", sweep},
                         {"chunk_breakdown_ms", breakdown}});
      std::fprintf(stderr, "%-32s %8.4f ms %7.1f TFLOP/s (chunk %lld)\n", "cross_entropy_fwd_bwd_qwen3", ms,
                   flop / (ms * 1e-3) / 1e12, static_cast<long long>(chunk));

      // The vocabulary-split backward (ZeRO-2 with sharded gradients): pass 1, then pass 2 over
      // windows of `rows` vocabulary rows, each window's two products timed alone too.
      core::Buffer lse(context.device(), n(tokens) * sizeof(float));
      const ops::DeviceWorkspace ce_ws{ce_workspace.data(), ce_workspace.bytes()};
      const double pass1_ms = time_ms(
          context,
          [&] {
            ce.backward_hidden(h.as<bf16>(), head.as<bf16>(), targets.as<std::int32_t>(), tokens, hidden, vocab,
                               dh.as<bf16>(), 1.0f, outputs, lse.as<float>(), ce_ws);
          },
          3, ce_samples, 1);
      nlohmann::json split = nlohmann::json::array();
      for (const std::int64_t rows : split_rows) {
        const auto pass2 = [&] {
          for (std::int64_t r0 = 0; r0 < vocab; r0 += rows) {
            const std::int64_t r1 = std::min(vocab, r0 + rows);
            ce.backward_weight_rows(h.as<bf16>(), head.as<bf16>(), targets.as<std::int32_t>(), lse.as<float>(),
                                    count.as<std::int32_t>(), tokens, hidden, vocab, r0, r1,
                                    dhead.as<float>() + r0 * hidden, 1.0f, ce_ws);
          }
        };
        const double pass2_ms = time_ms(context, pass2, 2, ce_samples, 1);
        const double window_logits_ms = time_ms(
            context, [&] { ce_gemms.forward(h.as<bf16>(), head.as<bf16>(), tokens, hidden, rows, logits, gemm_ws); },
            warmup, samples, 1);
        const double window_dweight_ms = time_ms(
            context,
            [&] { ce_gemms.backward_weight(logits, h.as<bf16>(), tokens, hidden, rows, dhead.as<float>(), gemm_ws); },
            warmup, samples, 1);
        split.push_back({{"window_rows", rows},
                         {"pass1_ms", pass1_ms},
                         {"pass2_ms", pass2_ms},
                         {"window_logits_gemm_ms", window_logits_ms},
                         {"window_dweight_gemm_ms", window_dweight_ms}});
        std::fprintf(stderr,
                     "vocabulary split, %6lld rows: pass 1 %.3f ms, pass 2 %.3f ms (window: logits %.3f, dW %.3f)\n",
                     static_cast<long long>(rows), pass1_ms, pass2_ms, window_logits_ms, window_dweight_ms);
      }
      results.back()["vocabulary_split"] = split;
    }
    const nlohmann::json out = {{"device", context.device_name()}, {"results", results}};
    std::printf("%s\n", out.dump(2).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "linear_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
