// One E29a layer's forward + backward on one GPU (models/e29a/layer_cuda.h; `--forward` and
// `--backward` pick the persistent kernel or the hybrid path for each direction), at upstream's
// training shapes: D = 1024, T = 512 and B = 64 with N = 8 or B = 16 with N = 16. Random weights at the
// initialisation's scales, random input and output gradient; CUDA events around the forward and the backward of each
// timed iteration, the median after warm-up. Prints one JSON object (the figures bench/record.py joins with
// bench/peer_e29a.py's); bench/e29a_record.sh runs both and appends to bench/results/e29a.jsonl.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/half.h"
#include "models/e29a/layer_cuda.h"
#include "models/e29a/layer_persistent.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// bf16 words uniform in [-bound, bound) from a counter hash (seeded by `stream`).
core::Buffer uniform_bf16(std::int64_t count, float bound, std::uint64_t stream) {
  std::vector<std::uint16_t> host(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) {
    std::uint64_t z = (static_cast<std::uint64_t>(i) + (stream << 40)) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    const float u = static_cast<float>((z ^ (z >> 31)) >> 40) * 0x1p-24f * 2.0f - 1.0f;
    host[static_cast<std::size_t>(i)] = core::float_to_bf16(bound * u);
  }
  core::Buffer buffer(core::Device::cuda(), host.size() * 2);
  CUDA_CHECK(cudaMemcpy(buffer.data(), host.data(), buffer.bytes(), cudaMemcpyHostToDevice));
  return buffer;
}

core::Buffer zeros_f32(std::int64_t count) {
  core::Buffer buffer(core::Device::cuda(), static_cast<std::size_t>(count) * 4);
  CUDA_CHECK(cudaMemset(buffer.data(), 0, buffer.bytes()));
  return buffer;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"E29a layer forward + backward benchmark"};
  std::int64_t batch = 64, steps = 512, dim = 1024, slots = 8, interval = 0;
  std::string forward = "automatic", backward = "automatic";
  int warmup = 3, iterations = 10, cluster = 0, batch_parts = 0;
  app.add_option("--batch", batch);
  app.add_option("--steps", steps);
  app.add_option("--dim", dim);
  app.add_option("--slots", slots);
  app.add_option("--checkpoint-interval", interval, "tape checkpoint every K steps (0: about sqrt(steps))");
  app.add_option("--forward", forward, "automatic (persistent where it fits), hybrid or persistent")
      ->check(CLI::IsMember({"automatic", "hybrid", "persistent"}));
  app.add_option("--backward", backward, "automatic (persistent where it fits), hybrid or persistent")
      ->check(CLI::IsMember({"automatic", "hybrid", "persistent"}));
  app.add_option("--cluster", cluster, "persistent kernels: blocks a sequence spreads over (1, 2, 4; 0: chosen)");
  app.add_option("--batch-parts", batch_parts,
                 "persistent kernels: blocks a row block's rows phase spreads the batch over (1, 2; 0: chosen)");
  bool profile = false;
  app.add_flag("--profile", profile, "persistent kernels: us per step in each phase kind (block 0, last block)");
  app.add_option("--warmup", warmup);
  app.add_option("--iterations", iterations);
  CLI11_PARSE(app, argc, argv);

  try {
    core::DeviceContext ctx(core::Device::cuda());
    const cudaStream_t stream = ctx.stream();
    const float inv = 1.0f / std::sqrt(static_cast<float>(dim));
    // Xavier-uniform W_xz and W_write, W_h with spectral norm about 0.9 (uniform, std 0.45/sqrt(D)).
    core::Buffer w_xz = uniform_bf16(2 * dim * dim, std::sqrt(2.0f) * inv, 1);
    core::Buffer w_h = uniform_bf16(dim * dim, 0.45f * std::sqrt(3.0f) * inv, 2);
    core::Buffer b_h = uniform_bf16(dim, 0.1f, 3);
    core::Buffer w_write = uniform_bf16(dim * dim, std::sqrt(3.0f) * inv, 4);
    core::Buffer tape0 = uniform_bf16(slots * dim, 1.0f, 5);
    core::Buffer u = uniform_bf16(batch * steps * dim, 1.0f, 6);
    core::Buffer dy = uniform_bf16(batch * steps * dim, 1.0f, 7);
    core::Buffer y(core::Device::cuda(), static_cast<std::size_t>(batch * steps * dim) * 2);
    core::Buffer du(core::Device::cuda(), static_cast<std::size_t>(batch * steps * dim) * 2);
    core::Buffer g_xz = zeros_f32(2 * dim * dim), g_h = zeros_f32(dim * dim), g_b = zeros_f32(dim);
    core::Buffer g_write = zeros_f32(dim * dim), g_tape0 = zeros_f32(slots * dim);
    const models::e29a::LayerWeightsCuda weights{w_xz.as<__nv_bfloat16>(), w_h.as<__nv_bfloat16>(),
                                                 b_h.as<__nv_bfloat16>(), w_write.as<__nv_bfloat16>(),
                                                 tape0.as<__nv_bfloat16>()};
    const models::e29a::LayerGradientsCuda grads{g_xz.as<float>(), g_h.as<float>(), g_b.as<float>(),
                                                 g_write.as<float>(), g_tape0.as<float>()};

    models::e29a::LayerCuda layer(ctx, dim, slots, batch, steps, interval);
    layer.set_persistent_cluster(cluster);
    layer.set_persistent_batch_parts(batch_parts);
    auto kernel = [](const std::string& name) {
      return name == "hybrid"       ? models::e29a::RecurrenceKernel::hybrid
             : name == "persistent" ? models::e29a::RecurrenceKernel::persistent
                                    : models::e29a::RecurrenceKernel::automatic;
    };
    layer.set_forward_kernel(kernel(forward));
    layer.set_backward_kernel(kernel(backward));
    core::Buffer profile_ns = zeros_f32(12 * 2);           // 12 uint64
    core::Buffer backward_profile_ns = zeros_f32(12 * 2);  // 12 uint64
    if (profile) {
      layer.set_persistent_profile(profile_ns.as<std::uint64_t>());
      layer.set_persistent_backward_profile(backward_profile_ns.as<std::uint64_t>());
    }
    auto acts = layer.make_activations();
    cudaEvent_t start, mid, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&mid));
    CUDA_CHECK(cudaEventCreate(&stop));
    // The recurrence alone (the persistent launches or the hybrid steps), without the products
    // over all tokens: what the hand-off floor (bench/handoff_bench) bounds.
    models::e29a::LayerCuda::RecurrenceEvents rec;
    for (cudaEvent_t* e : {&rec.forward_start, &rec.forward_end, &rec.backward_start, &rec.backward_end})
      CUDA_CHECK(cudaEventCreate(e));
    layer.set_recurrence_events(rec);
    std::vector<double> fwd, bwd, total, rec_fwd, rec_bwd, rec_total;
    for (int i = 0; i < warmup + iterations; ++i) {
      CUDA_CHECK(cudaEventRecord(start, stream));
      layer.forward(weights, u.as<__nv_bfloat16>(), batch, steps, y.as<__nv_bfloat16>(), acts);
      CUDA_CHECK(cudaEventRecord(mid, stream));
      layer.backward(weights, u.as<__nv_bfloat16>(), dy.as<__nv_bfloat16>(), du.as<__nv_bfloat16>(), grads, acts);
      CUDA_CHECK(cudaEventRecord(stop, stream));
      CUDA_CHECK(cudaEventSynchronize(stop));
      if (i < warmup) continue;
      float f = 0, b = 0;
      CUDA_CHECK(cudaEventElapsedTime(&f, start, mid));
      CUDA_CHECK(cudaEventElapsedTime(&b, mid, stop));
      fwd.push_back(f);
      bwd.push_back(b);
      total.push_back(static_cast<double>(f) + b);
      float rf = 0, rb = 0;
      CUDA_CHECK(cudaEventElapsedTime(&rf, rec.forward_start, rec.forward_end));
      CUDA_CHECK(cudaEventElapsedTime(&rb, rec.backward_start, rec.backward_end));
      rec_fwd.push_back(rf);
      rec_bwd.push_back(rb);
      rec_total.push_back(static_cast<double>(rf) + rb);
    }
    layer.check();
    CUDA_CHECK(cudaEventDestroy(start));
    CUDA_CHECK(cudaEventDestroy(mid));
    CUDA_CHECK(cudaEventDestroy(stop));
    layer.set_recurrence_events({});
    for (cudaEvent_t e : {rec.forward_start, rec.forward_end, rec.backward_start, rec.backward_end})
      CUDA_CHECK(cudaEventDestroy(e));

    const double ms = median(total);
    // Blocks a sequence and batch parts of each persistent kernel (0 and 0: the hybrid path ran).
    auto shape = [&](bool backward) {
      const bool persistent = (backward ? layer.last_backward_kernel() : layer.last_forward_kernel()) ==
                              models::e29a::RecurrenceKernel::persistent;
      return persistent ? models::e29a::kernels::persistent_shape(backward, static_cast<int>(dim),
                                                                  static_cast<int>(slots), batch, cluster, batch_parts)
                        : models::e29a::kernels::PersistentShape{0, 0};
    };
    const models::e29a::kernels::PersistentShape shape_forward = shape(false), shape_backward = shape(true);
    // Matrix-product FLOPs per token: forward 8 D^2 (the projection 4 D^2, W_h h and W_write h
    // 2 D^2 each), backward twice that (input and weight gradients of each product).
    const double flops = 24.0 * static_cast<double>(batch * steps) * static_cast<double>(dim * dim);
    nlohmann::json out = {
        {"bench", "e29a_layer_fwd_bwd_d" + std::to_string(dim) + "_t" + std::to_string(steps) + "_b" +
                      std::to_string(batch) + "_n" + std::to_string(slots)},
        {"device", ctx.device_name()},
        {"forward",
         layer.last_forward_kernel() == models::e29a::RecurrenceKernel::persistent ? "persistent" : "hybrid"},
        {"backward",
         layer.last_backward_kernel() == models::e29a::RecurrenceKernel::persistent ? "persistent" : "hybrid"},
        {"ours_ms", ms},
        {"fwd_ms", median(fwd)},
        {"bwd_ms", median(bwd)},
        {"recurrence_ms", median(rec_total)},
        {"recurrence_fwd_ms", median(rec_fwd)},
        {"recurrence_bwd_ms", median(rec_bwd)},
        {"tok_s", static_cast<double>(batch * steps) / (ms * 1e-3)},
        {"tflops", flops / (ms * 1e-3) / 1e12},
        {"batch", batch},
        {"steps", steps},
        {"dim", dim},
        {"slots", slots},
        {"checkpoint_interval", layer.checkpoint_interval()},
        {"cluster_forward", shape_forward.cluster},
        {"cluster_backward", shape_backward.cluster},
        {"batch_parts_forward", shape_forward.batch_parts},
        {"batch_parts_backward", shape_backward.batch_parts},
        {"activation_mib", static_cast<double>(layer.activation_bytes()) / (1 << 20)},
        {"iterations", iterations},
    };
    // A profile array: ns in the four phase kinds for block 0 and the last block, then block 0's
    // sequence phase split into `parts`; written as us per step under `key`.
    auto put_profile = [&](const char* key, const core::Buffer& device_ns, const std::vector<const char*>& parts) {
      std::vector<std::uint64_t> ns(8 + parts.size());
      CUDA_CHECK(cudaMemcpy(ns.data(), device_ns.data(), ns.size() * sizeof(std::uint64_t), cudaMemcpyDeviceToHost));
      const char* kinds[] = {"rows", "wait_after_rows", "sequences", "wait_after_sequences"};
      for (std::size_t k = 0; k < ns.size(); ++k) {
        const double us = static_cast<double>(ns[k]) * 1e-3 / static_cast<double>(steps);
        if (k < 8) {
          out[key][k < 4 ? "block0" : "last_block"][kinds[k % 4]] = us;
        } else {
          out[key]["block0_parts"][parts[k - 8]] = us;
        }
      }
    };
    if (profile) {
      put_profile("profile_us_per_step", profile_ns,
                  {"loads_and_write_scores", "update_and_read_scores", "read_pass", "outputs"});
      if (layer.last_backward_kernel() == models::e29a::RecurrenceKernel::persistent) {
        put_profile("backward_profile_us_per_step", backward_profile_ns,
                    {"replay_and_early_loads", "loads_and_score_pass", "sums_and_softmaxes", "gradient_pass"});
      }
    }
    std::printf("%s\n", out.dump().c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "e29a_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
