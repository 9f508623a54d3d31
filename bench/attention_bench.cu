// Benchmark of the CUDA causal GQA attention (flash-style, bf16) at Qwen3 shapes: q, k, v read as
// head slices of one packed qkv buffer [batch * seq, (q_heads + 2 kv_heads) * head_dim], gradients
// written into a packed dqkv buffer, as a Qwen3 layer uses them. Times the forward, the backward and
// forward + backward with CUDA events (median of --reps after --warmup) for every tile variant (the
// "sweep") and for the variant the library picks by default ("ours_ms"), and writes one JSON object
// per measurement into --out-dir:
//   attention_forward_hd<D>.json, attention_forward_backward_hd<D>.json
// which bench/record.py joins with bench/peer_attention.py's files of the same names (.peer.json).
//
// TFLOP/s use the usual flash-attention count: 4 B Hq T^2 hd / 2 for the causal forward (two
// matrix products over half the score matrix) and 2.5 times that for the backward. Our backward
// recomputes S and dP a second time for dQ (the price of having no atomics), which the count leaves
// out, so its figure is the useful rate, comparable with the peer's.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/event_timer.h"
#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/rng.h"
#include "models/ops/attention.h"

namespace {

namespace ops = models::ops;

__global__ void fill_normal_bf16(std::uint16_t* x, std::int64_t n, std::uint64_t seed, float scale) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = __bfloat16_as_ushort(__float2bfloat16_rn(scale * core::normal01(seed, static_cast<std::uint64_t>(i))));
  }
}

void fill(core::Buffer& b, std::uint64_t seed, float scale, cudaStream_t stream) {
  fill_normal_bf16<<<4096, 256, 0, stream>>>(b.as<std::uint16_t>(), static_cast<std::int64_t>(b.bytes() / 2), seed,
                                             scale);
  CUDA_CHECK_LAUNCH("fill_normal_bf16");
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream f(path);
  if (!f) throw core::Error("cannot write " + path);
  f << j.dump() << "\n";
  std::printf("%s\n", j.dump().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Causal GQA flash attention benchmark (packed qkv, bf16)"};
  ops::AttentionShape shape{8, 2048, 16, 8, 128};
  int warmup = 10, reps = 50;
  std::string out_dir = ".";
  int only_variant = -1;
  app.add_option("--batch", shape.batch);
  app.add_option("--seq", shape.seq);
  app.add_option("--q-heads", shape.q_heads);
  app.add_option("--kv-heads", shape.kv_heads);
  app.add_option("--head-dim", shape.head_dim, "64 or 128");
  app.add_option("--warmup", warmup, "untimed runs");
  app.add_option("--reps", reps, "timed runs (median reported)");
  app.add_option("--out-dir", out_dir, "where the JSON files go");
  app.add_option("--variant", only_variant, "time only this tile variant (default: all; for profilers)");
  CLI11_PARSE(app, argc, argv);

  try {
    if (core::cuda_device_count() == 0) {
      std::fprintf(stderr, "attention_bench: no CUDA device\n");
      return 1;
    }
    core::DeviceContext ctx(core::Device::cuda(0));
    const core::Device gpu = ctx.device();
    cudaStream_t stream = ctx.stream();
    const std::int64_t hd = shape.head_dim, tokens = shape.batch * shape.seq;
    const std::int64_t row = (shape.q_heads + 2 * shape.kv_heads) * hd;
    const std::size_t dense_bytes = static_cast<std::size_t>(tokens * shape.q_heads * hd) * 2;
    core::Buffer qkv(gpu, static_cast<std::size_t>(tokens * row) * 2), dqkv(gpu, qkv.bytes());
    core::Buffer out(gpu, dense_bytes), dout(gpu, dense_bytes);
    core::Buffer lse(gpu, static_cast<std::size_t>(tokens * shape.q_heads) * sizeof(float));
    core::Buffer workspace(gpu, ops::attention_backward_workspace_bytes(shape));
    fill(qkv, 1, 1.0f, stream);
    fill(dout, 2, 1.0f, stream);

    auto* base = qkv.as<std::uint16_t>();
    auto* grad_base = dqkv.as<std::uint16_t>();
    const std::int64_t k_col = shape.q_heads * hd, v_col = (shape.q_heads + shape.kv_heads) * hd;
    const ops::AttentionInput q{base, row}, k{base + k_col, row}, v{base + v_col, row};
    const ops::AttentionGradient dq{grad_base, row}, dk{grad_base + k_col, row}, dv{grad_base + v_col, row};
    auto forward = [&](int variant) {
      ops::attention_forward_cuda(shape, q, k, v, out.as<std::uint16_t>(), lse.as<float>(), stream, variant);
    };
    auto backward = [&](int variant) {
      ops::attention_backward_cuda(shape, q, k, v, out.as<std::uint16_t>(), lse.as<float>(), dout.as<std::uint16_t>(),
                                   dq, dk, dv, workspace.data(), workspace.bytes(), stream, variant);
    };

    const double forward_flop = 4.0 * static_cast<double>(shape.batch * shape.q_heads) *
                                static_cast<double>(shape.seq) * static_cast<double>(shape.seq) *
                                static_cast<double>(hd) / 2.0;
    const double backward_flop = 2.5 * forward_flop;
    auto tflops = [](double flop, double ms) { return flop / (ms * 1e-3) / 1e12; };

    auto selected = [&](int i) { return only_variant < 0 || i == only_variant; };
    nlohmann::json forward_sweep = nlohmann::json::array();
    for (int i = 0; i < ops::attention_cuda_variant_count(hd, false); ++i) {
      if (!selected(i) || !ops::attention_cuda_variant_available(hd, false, i)) continue;
      const double ms = bench::median_ms(stream, warmup, reps, [&] { forward(i); });
      forward_sweep.push_back({{"variant", ops::attention_cuda_variant_name(hd, false, i)},
                               {"ms", ms},
                               {"tflops", tflops(forward_flop, ms)}});
      std::fprintf(stderr, "forward  hd%lld %-45s %8.4f ms %7.1f TFLOP/s\n", static_cast<long long>(hd),
                   ops::attention_cuda_variant_name(hd, false, i), ms, tflops(forward_flop, ms));
    }
    forward(-1);
    nlohmann::json backward_sweep = nlohmann::json::array();
    for (int i = 0; i < ops::attention_cuda_variant_count(hd, true); ++i) {
      if (!selected(i) || !ops::attention_cuda_variant_available(hd, true, i)) continue;
      const double ms = bench::median_ms(stream, warmup, reps, [&] { backward(i); });
      backward_sweep.push_back({{"variant", ops::attention_cuda_variant_name(hd, true, i)},
                                {"ms", ms},
                                {"tflops", tflops(backward_flop, ms)}});
      std::fprintf(stderr, "backward hd%lld %-45s %8.4f ms %7.1f TFLOP/s\n", static_cast<long long>(hd),
                   ops::attention_cuda_variant_name(hd, true, i), ms, tflops(backward_flop, ms));
    }
    if (only_variant >= 0) return 0;
    // What the library runs by default (variant -1: the preferred one that fits this device).
    const double forward_ms = bench::median_ms(stream, warmup, reps, [&] { forward(-1); });
    const double backward_ms = bench::median_ms(stream, warmup, reps, [&] { backward(-1); });
    const double both_ms = bench::median_ms(stream, warmup, reps, [&] {
      forward(-1);
      backward(-1);
    });
    const std::string shape_name = "B" + std::to_string(shape.batch) + " T" + std::to_string(shape.seq) + " Hq" +
                                   std::to_string(shape.q_heads) + " Hkv" + std::to_string(shape.kv_heads) + " hd" +
                                   std::to_string(hd);
    const std::string suffix = "_hd" + std::to_string(hd);
    write_json(out_dir + "/attention_forward" + suffix + ".json",
               {{"bench", "attention_forward" + suffix},
                {"device", ctx.device_name()},
                {"shape", shape_name},
                {"ours_ms", forward_ms},
                {"tflops", tflops(forward_flop, forward_ms)},
                {"variant", ops::attention_cuda_variant_name(hd, false, -1)},
                {"sweep", forward_sweep}});
    write_json(out_dir + "/attention_forward_backward" + suffix + ".json",
               {{"bench", "attention_forward_backward" + suffix},
                {"device", ctx.device_name()},
                {"shape", shape_name},
                {"ours_ms", both_ms},
                {"tflops", tflops(forward_flop + backward_flop, both_ms)},
                {"backward_ms", backward_ms},
                {"backward_tflops", tflops(backward_flop, backward_ms)},
                {"variant", ops::attention_cuda_variant_name(hd, true, -1)},
                {"sweep", backward_sweep}});
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_bench: %s\n", e.what());
    return 1;
  }
}
