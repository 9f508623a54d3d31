// Benchmark of a fused optimizer step (statistics + update + mirror + grad zeroing) on the
// Qwen3-0.6B parameter list, fp32 gradients. Prints one JSON object with the median step time,
// achieved bandwidth at the bytes the step must move, and the device-to-device copy bandwidth
// measured in the same run. PyTorch peers are bench/peer_*.py; bench/record.py joins them.
//
// Bytes per element the step must move (bf16 mirror):
//   adamw:     stats read g (4); update reads g, w, m, v (16), writes w, m, v, g=0 (16), mirror (2): 38
//   adamw8bit: as adamw with 1-byte m and v (+ 2 fp32 scales per 256 elements): 26 + 2/32
//   adafactor: g read 3 times (row/column statistics, sum of U*U, update), w read twice and
//              written once, mirror 2, g=0 4: 30 (ours reads g once more for the global norm: 34)
//   muon:      AdamW's 38 for the embedding and norms; a hidden-matrix element: stats read g (4),
//              momentum reads g and buf, writes buf and the assembly (16), the normalisation reads
//              the assembly and writes bf16 X (6), the update reads X and w, writes w, mirror,
//              g=0 (16): 42, plus Newton-Schulz's products (counted as FLOPs, `ns_flop`)
// With muon it also times Newton-Schulz's products alone (the step's cuBLASLt products over every
// matrix, as the optimizer batches them by shape: `ns_tflops`) and plain bf16 cuBLASLt products of
// the same shapes in the same run (bench/plain_gemm.h: `gemm_tflops`), and their ratio
// `ns_over_gemm`; `gemm_square_tflops` is a large square product's rate, the GPU's bf16 rate.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/event_timer.h"
#include "bench/plain_gemm.h"
#include "bench/qwen3_params.h"
#include "core/error.h"
#include "core/rng.h"
#include "optim/muon_gemm.h"
#include "optim/muon_load.h"
#include "optim/muon_plan.h"
#include "optim/newton_schulz_buffers.h"
#include "optim/optimizer.h"

namespace {

__global__ void fill_normal(float* x, std::int64_t n, std::uint64_t seed, float scale) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = scale * core::normal01(seed, static_cast<std::uint64_t>(i));
  }
}

void fill(core::Buffer& b, std::uint64_t seed, float scale, cudaStream_t stream) {
  const auto n = static_cast<std::int64_t>(b.bytes() / sizeof(float));
  fill_normal<<<4096, 256, 0, stream>>>(b.as<float>(), n, seed, scale);
  CUDA_CHECK_LAUNCH("fill_normal");
}

__global__ void fill_normal_bf16(__nv_bfloat16* x, std::int64_t n, std::uint64_t seed, float scale) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = __float2bfloat16(scale * core::normal01(seed, static_cast<std::uint64_t>(i)));
  }
}

void fill_bf16(core::Buffer& b, std::uint64_t seed, float scale, cudaStream_t stream) {
  const auto n = static_cast<std::int64_t>(b.bytes() / 2);
  fill_normal_bf16<<<4096, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(b.data()), n, seed, scale);
  CUDA_CHECK_LAUNCH("fill_normal_bf16");
}

// Bytes per parameter element a step must move at least (see the header comment).
double step_bytes_per_element(const std::string& type, const optim::SlabLayout& layout) {
  if (type == "adamw") return 38.0;
  if (type == "adamw8bit") return 26.0 + 2.0 * 4.0 * 2.0 / 256.0;
  if (type == "adafactor") return 30.0;
  if (type == "muon") {
    double matrix = 0;
    for (const auto& t : layout.parameters()) matrix += t.spec.hidden_matrix ? static_cast<double>(t.numel) : 0.0;
    const auto all = static_cast<double>(layout.parameter_count());
    return (42.0 * matrix + 38.0 * (all - matrix)) / all;
  }
  throw core::Error("no byte count for optimizer type '" + type + "'");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timer {
  cudaEvent_t start{}, stop{};
  Timer() {
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~Timer() {
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
  }
  double elapsed_ms() const {
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  }
};

// Median ms of `reps` timed calls of run() after `warmup` untimed ones.
template <typename Run>
double median_ms(const core::DeviceContext& ctx, int warmup, int reps, const Run& run) {
  Timer t;
  std::vector<double> ms;
  for (int i = 0; i < warmup + reps; ++i) {
    CUDA_CHECK(cudaEventRecord(t.start, ctx.stream()));
    run();
    CUDA_CHECK(cudaEventRecord(t.stop, ctx.stream()));
    const double e = t.elapsed_ms();
    if (i >= warmup) ms.push_back(e);
  }
  return median(ms);
}

// Newton-Schulz's products alone, as Muon runs them (every matrix of the layout, one strided batch
// per shape and product, `steps` iterations), against plain bf16 products of the same shapes on the
// same buffers, and a large square product. `flop`: Newton-Schulz's per step. Adds the figures to `out`.
void time_newton_schulz(const core::DeviceContext& ctx, const optim::SlabLayout& layout, std::int64_t steps,
                        double flop, int warmup, int reps, nlohmann::json& out) {
  const optim::MuonPlan plan = optim::make_muon_plan(layout, {0, layout.total_elements()});
  const optim::NewtonSchulzBuffers buffers = optim::newton_schulz_buffers(plan);
  const std::size_t bf16 = 2;
  core::Buffer x[2] = {core::Buffer(ctx.device(), static_cast<std::size_t>(buffers.x_elements) * bf16),
                       core::Buffer(ctx.device(), static_cast<std::size_t>(buffers.x_elements) * bf16)};
  core::Buffer gram(ctx.device(), static_cast<std::size_t>(buffers.gram_elements) * bf16);
  core::Buffer poly(ctx.device(), static_cast<std::size_t>(buffers.gram_elements) * bf16);
  core::Buffer workspace(ctx.device(), bench::PlainGemm::kWorkspaceBytes);
  // X's Frobenius norm at most 1, as the optimizer's normalisation leaves it, so the iterates stay
  // bounded (the ping-pong overwrites x[0] from one timed call to the next).
  std::int64_t largest = 1;
  for (const optim::NewtonSchulzGroup& g : buffers.groups) largest = std::max(largest, g.r * g.c);
  const float scale = 1.0f / std::sqrt(static_cast<float>(largest));
  fill_bf16(x[0], 11, scale, ctx.stream());
  fill_bf16(x[1], 12, scale, ctx.stream());
  fill_bf16(gram, 13, scale, ctx.stream());
  fill_bf16(poly, 14, scale, ctx.stream());
  auto at = [&](core::Buffer& b, std::int64_t element) {
    return static_cast<char*>(b.data()) + element * static_cast<std::int64_t>(bf16);
  };
  std::vector<std::unique_ptr<optim::NewtonSchulzGemms>> gemms;
  for (const optim::NewtonSchulzGroup& g : buffers.groups) {
    gemms.push_back(std::make_unique<optim::NewtonSchulzGemms>(ctx.cublaslt(), g.r, g.c, g.batch));
  }
  const double ns_ms = median_ms(ctx, warmup, reps, [&] {
    for (std::int64_t step = 0; step < steps; ++step) {
      const int from = static_cast<int>(step % 2);
      for (std::size_t k = 0; k < gemms.size(); ++k) {
        const optim::NewtonSchulzGroup& g = buffers.groups[k];
        gemms[k]->iterate(at(x[from], g.x), at(x[1 - from], g.x), at(gram, g.gram), at(poly, g.gram), ctx.stream());
      }
    }
  });

  // The same products, plain: A = X X^T ([r, r] from [r, c]), A A, B X ([r, c] from [r, r] and
  // [r, c]). They read only x[0] and gram (left bounded by the iterations above) and write only
  // poly and x[1], so their operands do not grow from one call to the next.
  struct Plain {
    std::unique_ptr<bench::PlainGemm> gemm;
    const void *a, *b;
    void* d;
  };
  std::vector<Plain> plain;
  for (const optim::NewtonSchulzGroup& g : buffers.groups) {
    const std::int64_t xs = optim::NewtonSchulzGemms::x_stride(g.r, g.c),
                       gs = optim::NewtonSchulzGemms::gram_stride(g.r);
    const bench::GemmShape products[3] = {{g.r, g.r, g.c, g.batch, xs, xs, gs},
                                          {g.r, g.r, g.r, g.batch, gs, gs, gs},
                                          {g.r, g.c, g.r, g.batch, gs, xs, xs}};
    plain.push_back({std::make_unique<bench::PlainGemm>(ctx.cublaslt(), products[0]), at(x[0], g.x), at(x[0], g.x),
                     at(poly, g.gram)});
    plain.push_back({std::make_unique<bench::PlainGemm>(ctx.cublaslt(), products[1]), at(gram, g.gram),
                     at(gram, g.gram), at(poly, g.gram)});
    plain.push_back({std::make_unique<bench::PlainGemm>(ctx.cublaslt(), products[2]), at(gram, g.gram), at(x[0], g.x),
                     at(x[1], g.x)});
  }
  const double gemm_ms = median_ms(ctx, warmup, reps, [&] {
    for (std::int64_t step = 0; step < steps; ++step) {
      for (const Plain& p : plain) p.gemm->run(p.a, p.b, p.d, workspace.data(), ctx.stream());
    }
  });

  const std::int64_t n = 8192;
  core::Buffer square[3] = {core::Buffer(ctx.device(), static_cast<std::size_t>(n * n) * bf16),
                            core::Buffer(ctx.device(), static_cast<std::size_t>(n * n) * bf16),
                            core::Buffer(ctx.device(), static_cast<std::size_t>(n * n) * bf16)};
  fill_bf16(square[0], 21, 1e-2f, ctx.stream());
  fill_bf16(square[1], 22, 1e-2f, ctx.stream());
  const bench::GemmShape shape{n, n, n, 1, n * n, n * n, n * n};
  const bench::PlainGemm big(ctx.cublaslt(), shape);
  const double square_ms = median_ms(ctx, warmup, reps, [&] {
    big.run(square[0].data(), square[1].data(), square[2].data(), workspace.data(), ctx.stream());
  });

  out["ns_ms"] = ns_ms;
  out["ns_tflops"] = flop / (ns_ms * 1e-3) / 1e12;
  out["gemm_ms"] = gemm_ms;
  out["gemm_tflops"] = flop / (gemm_ms * 1e-3) / 1e12;
  out["ns_over_gemm"] = gemm_ms / ns_ms;
  out["gemm_square_tflops"] = shape.flop() / (square_ms * 1e-3) / 1e12;
  out["ns_over_square"] = (flop / ns_ms) / (shape.flop() / square_ms);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Fused optimizer step benchmark (Qwen3-0.6B parameter list)"};
  int warmup = 5, reps = 30;
  std::string type = "adamw";
  app.add_option("--optimizer", type, "adamw | adamw8bit | adafactor | muon");
  std::vector<std::int64_t> chunks = {4096, 16384, 65536};
  app.add_option("--warmup", warmup, "untimed steps");
  app.add_option("--reps", reps, "timed steps (median reported)");
  app.add_option("--chunks", chunks, "work chunk sizes to try (elements)");
  CLI11_PARSE(app, argc, argv);

  try {
    if (core::cuda_device_count() == 0) {
      std::fprintf(stderr, "optimizer_bench: no CUDA device\n");
      return 1;
    }
    core::DeviceContext ctx(core::Device::cuda(0));
    auto specs = bench::qwen3_0_6b_params();
    if (type == "adafactor") {
      for (auto& spec : specs) spec.factored = spec.shape.size() == 2;
    }
    if (type == "muon") {  // q, k, v, o, gate, up, down; the embedding (the tied head) takes AdamW
      for (auto& spec : specs) spec.hidden_matrix = spec.shape.size() == 2 && spec.name != "model.embed_tokens.weight";
    }
    const optim::SlabLayout layout(specs, 1);
    const auto elements = layout.parameter_count();
    const double bytes_per_element = step_bytes_per_element(type, layout);
    const double bytes = bytes_per_element * static_cast<double>(elements);
    const double copy_gbps = bench::copy_bytes_per_s(ctx, std::size_t{4} << 30, 20) / 1e9;

    optim::OptimizerConfig config;
    config.type = type;
    config.lr = type == "adafactor" ? 1e-2 : 3e-4;
    config.muon.lr = 0.02;
    config.beta1 = 0.9;
    config.beta2 = 0.95;
    config.weight_decay = 0.1;
    config.grad_clip = 1.0;
    nlohmann::json sweep = nlohmann::json::array();
    double best_ms = 1e30;
    std::int64_t best_chunk = 0;
    double state_bytes_per_param = 0;  // optimizer state (all state buffers) per parameter
    for (std::int64_t chunk : chunks) {
      optim::Slab slab(layout, ctx);
      const auto optimizer = optim::make_optimizer(config, slab, ctx, chunk);
      std::size_t state_bytes = 0;
      for (const auto& state : optimizer->state_buffers()) state_bytes += state.buffer->bytes();
      state_bytes_per_param = static_cast<double>(state_bytes) / static_cast<double>(elements);
      fill(slab.master(), 1, 0.02f, ctx.stream());
      Timer t;
      std::vector<double> ms;
      for (int i = 0; i < warmup + reps; ++i) {
        fill(slab.grad(), 100 + static_cast<std::uint64_t>(i), 1e-3f, ctx.stream());  // fresh, untimed
        CUDA_CHECK(cudaEventRecord(t.start, ctx.stream()));
        optimizer->step(config.lr);
        CUDA_CHECK(cudaEventRecord(t.stop, ctx.stream()));
        const double e = t.elapsed_ms();
        if (i >= warmup) ms.push_back(e);
      }
      // Where the time goes: each phase timed alone (same fresh-gradient protocol).
      const int phases = optimizer->phase_count();
      std::vector<cudaEvent_t> marks(static_cast<std::size_t>(phases) + 1);
      for (auto& m : marks) CUDA_CHECK(cudaEventCreate(&m));
      std::vector<std::vector<double>> phase_ms(static_cast<std::size_t>(phases));
      for (int i = 0; i < reps; ++i) {
        fill(slab.grad(), 1000 + static_cast<std::uint64_t>(i), 1e-3f, ctx.stream());
        CUDA_CHECK(cudaEventRecord(marks[0], ctx.stream()));
        for (int p = 0; p < phases; ++p) {
          optimizer->run_phase(p, config.lr);
          CUDA_CHECK(cudaEventRecord(marks[static_cast<std::size_t>(p) + 1], ctx.stream()));
        }
        CUDA_CHECK(cudaEventSynchronize(marks.back()));
        for (int p = 0; p < phases; ++p) {
          float e = 0;
          CUDA_CHECK(
              cudaEventElapsedTime(&e, marks[static_cast<std::size_t>(p)], marks[static_cast<std::size_t>(p) + 1]));
          phase_ms[static_cast<std::size_t>(p)].push_back(e);
        }
      }
      for (auto& m : marks) CUDA_CHECK(cudaEventDestroy(m));
      nlohmann::json phase_medians = nlohmann::json::array();
      for (auto& v : phase_ms) phase_medians.push_back(median(v));
      const auto report = optimizer->report();
      if (report.step != warmup + 2 * reps) throw core::Error("benchmark steps were skipped");
      const double med = median(ms);
      sweep.push_back(
          {{"chunk_elements", chunk}, {"ms", med}, {"gbps", bytes / (med * 1e-3) / 1e9}, {"phase_ms", phase_medians}});
      if (med < best_ms) {
        best_ms = med;
        best_chunk = chunk;
      }
    }
    nlohmann::json out = {
        {"bench", type + "_step"},
        {"device", ctx.device_name()},
        {"params", "qwen3-0.6b"},
        {"tensors", layout.tensors().size()},
        {"elements", elements},
        {"ours_ms", best_ms},
        {"chunk_elements", best_chunk},
        {"bytes_per_element", bytes_per_element},
        {"state_bytes_per_param", state_bytes_per_param},
        {"gbps", bytes / (best_ms * 1e-3) / 1e9},
        {"copy_gbps", copy_gbps},
        {"fraction_of_copy", bytes / (best_ms * 1e-3) / 1e9 / copy_gbps},
        {"sweep", sweep},
    };
    if (type == "muon") {
      // Newton-Schulz's rate is bounded below by its FLOPs over the whole update phase (which also
      // holds the normalisation, the matrices' update and AdamW's launch).
      const double flop = optim::muon_load(layout, 1, config.muon.ns_steps).flop;
      out["ns_flop"] = flop;
      for (auto& entry : out["sweep"]) {
        entry["update_phase_tflops"] = flop / (entry["phase_ms"][2].get<double>() * 1e-3) / 1e12;
      }
      time_newton_schulz(ctx, layout, config.muon.ns_steps, flop, warmup, reps, out);
    }
    std::printf("%s\n", out.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "optimizer_bench: %s\n", e.what());
    return 1;
  }
}
