// One full training step of Qwen3 on one GPU (forward, backward, the optimizer with clipping:
// AdamW, or with --optimizer muon Muon for the hidden matrices), random tokens: median step time,
// the optimizer's part of it (`optimizer_ms`, its median, and `optimizer_share` of the step),
// tokens/s, MFU ((6N + 6*L*H*hd*T) FLOPs per token against 989 TFLOP/s dense bf16) and device
// memory in use. The transformers peer is bench/peer_qwen3_train.py; bench/record.py joins the two.
// --breakdown: a few more steps with events around every phase (the model's, the optimizer's),
// each phase's milliseconds per step against its floor (bench/qwen3_step_floors.h) at a copy
// bandwidth and a matmul rate measured in the same run; a table on stderr, "breakdown" in the JSON.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench/event_timer.h"
#include "bench/qwen3_step_floors.h"
#include "core/error.h"
#include "core/half.h"
#include "core/phase_timer.h"
#include "core/rng.h"
#include "models/model_config.h"
#include "models/ops/linear.h"
#include "models/registry.h"
#include "optim/optimizer.h"

namespace {

// FLOP/s of one large bf16 product through the model's own linear layer (LinearPlan, cuBLASLt):
// 8192 x 8192 x 8192, random operands (constant ones draw less power and run faster).
double matmul_rate(const core::DeviceContext& ctx) {
  const std::int64_t m = 8192;
  const std::size_t elements = static_cast<std::size_t>(m * m);
  std::vector<std::uint16_t> host(elements);
  for (std::size_t i = 0; i < elements; ++i) host[i] = core::float_to_bf16(2.0f * core::uniform01(7, i) - 1.0f);
  core::Buffer x(ctx.device(), elements * 2), w(ctx.device(), elements * 2), y(ctx.device(), elements * 2);
  core::Buffer workspace(ctx.device(), models::ops::kLinearWorkspaceBytes);
  core::copy_bytes(x.data(), host.data(), x.bytes(), ctx.stream());
  core::copy_bytes(w.data(), host.data(), w.bytes(), ctx.stream());
  models::ops::LinearPlan linear(ctx);
  const double ms = bench::median_ms(ctx.stream(), 3, 10, [&] {
    linear.forward(x.as<__nv_bfloat16>(), w.as<__nv_bfloat16>(), m, m, m, y.as<__nv_bfloat16>(),
                   {workspace.data(), workspace.bytes()});
  });
  return 2.0 * static_cast<double>(m) * static_cast<double>(m) * static_cast<double>(m) / (ms * 1e-3);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Qwen3 training-step benchmark"};
  std::string preset = "qwen3-0.6b", recompute = "none", optimizer_type = "adamw";
  std::int64_t batch = 8, seq = 2048;
  int warmup = 3, steps = 10, breakdown_steps = 3;
  bool breakdown = false;
  double matmul_rate_option = 0.0;
  app.add_option("--preset", preset);
  app.add_option("--batch", batch);
  app.add_option("--seq", seq);
  app.add_option("--recompute", recompute, "none | mlp | full");
  app.add_option("--warmup", warmup);
  app.add_option("--steps", steps);
  app.add_option("--optimizer", optimizer_type, "adamw | muon (Muon's defaults, muon.lr 0.02)")
      ->check(CLI::IsMember({"adamw", "muon"}));
  app.add_flag("--breakdown", breakdown, "after the timed steps, time every phase against its floor");
  app.add_option("--breakdown-steps", breakdown_steps, "steps the breakdown averages")->check(CLI::PositiveNumber);
  app.add_option("--matmul-rate", matmul_rate_option,
                 "FLOP/s of the products' floors (0: measure a 8192^3 bf16 product in this run)");
  CLI11_PARSE(app, argc, argv);
  try {
    std::size_t free0 = 0, total = 0;
    core::DeviceContext ctx(core::Device::cuda(0));
    CUDA_CHECK(cudaMemGetInfo(&free0, &total));
    // Through the model interface, as the trainer builds it.
    const models::Family& family = models::family("qwen3");
    models::Shape shape = models::base_shape(family, preset);
    shape["recompute"] = recompute;
    models::check_shape(family, shape, "qwen3_train_bench");
    const auto spec = family.spec(shape);
    optim::Slab slab(optim::SlabLayout(spec->parameters(), 1), ctx);
    const auto model_owner = spec->trainable(slab, ctx, {.max_tokens = batch * seq});
    models::TrainableModel& model = *model_owner;
    optim::OptimizerConfig oc;
    oc.type = optimizer_type;
    oc.lr = 3e-4;
    oc.grad_clip = 1.0;
    const auto optimizer = optim::make_optimizer(oc, slab, ctx);
    // Weights: small random values through the host (init is not what is timed).
    {
      std::vector<float> w(slab.master().bytes() / 4);
      std::mt19937 rng(1);
      std::normal_distribution<float> dist(0.0f, 0.02f);
      for (auto& x : w) x = dist(rng);
      core::copy_bytes(slab.master().data(), w.data(), slab.master().bytes(), ctx.stream());
      ctx.synchronize();
      slab.write_mirror(ctx);
    }
    const std::int64_t n = batch * seq;
    std::vector<std::int32_t> ids(static_cast<std::size_t>(n)), targets(ids.size());
    std::mt19937 rng(2);
    std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(spec->vocab_size() - 1));
    for (auto& x : ids) x = token(rng);
    for (std::size_t i = 0; i < ids.size(); ++i)
      targets[i] = (i + 1) % static_cast<std::size_t>(seq) ? ids[i + 1] : -100;
    core::Buffer ids_d(ctx.device(), ids.size() * 4), targets_d(ctx.device(), targets.size() * 4);
    core::copy_bytes(ids_d.data(), ids.data(), ids_d.bytes(), ctx.stream());
    core::copy_bytes(targets_d.data(), targets.data(), targets_d.bytes(), ctx.stream());
    ctx.synchronize();

    cudaEvent_t start, backward_done, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&backward_done));
    CUDA_CHECK(cudaEventCreate(&stop));
    std::vector<double> ms, optimizer_ms;
    for (int i = 0; i < warmup + steps; ++i) {
      CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
      model.forward_backward(ids_d.as<std::int32_t>(), targets_d.as<std::int32_t>(), batch, seq, 1.0f);
      CUDA_CHECK(cudaEventRecord(backward_done, ctx.stream()));
      optimizer->step(oc.lr);
      CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
      CUDA_CHECK(cudaEventSynchronize(stop));
      float e = 0, opt = 0;
      CUDA_CHECK(cudaEventElapsedTime(&e, start, stop));
      CUDA_CHECK(cudaEventElapsedTime(&opt, backward_done, stop));
      if (i >= warmup) {
        ms.push_back(e);
        optimizer_ms.push_back(opt);
      }
    }
    std::size_t free1 = 0;
    CUDA_CHECK(cudaMemGetInfo(&free1, &total));
    float loss = 0;
    CUDA_CHECK(cudaMemcpy(&loss, model.loss(), 4, cudaMemcpyDeviceToHost));
    // Steps with the phase timer on: each phase's milliseconds per step, its share of the step and
    // its floor. The optimizer runs phase by phase (what step() does without a reducer) so its
    // gradient statistics and its update are timed apart.
    auto run_breakdown = [&]() -> nlohmann::json {
      core::PhaseTimer timer(ctx.stream());
      model.set_phase_timer(&timer);
      const int phases = optimizer->phase_count();
      auto timed_step = [&] {
        model.forward_backward(ids_d.as<std::int32_t>(), targets_d.as<std::int32_t>(), batch, seq, 1.0f);
        for (int p = 0; p < phases; ++p) {
          const core::PhaseScope scope(&timer, p == 0            ? "optimizer.grad_stats"
                                               : p + 1 == phases ? "optimizer.update"
                                                                 : "optimizer.prepare");
          optimizer->run_phase(p, oc.lr);
        }
      };
      timed_step();  // fills the event pool
      (void)timer.collect();
      std::vector<double> step_ms;
      for (int i = 0; i < breakdown_steps; ++i) {
        CUDA_CHECK(cudaEventRecord(start, ctx.stream()));
        timed_step();
        CUDA_CHECK(cudaEventRecord(stop, ctx.stream()));
        CUDA_CHECK(cudaEventSynchronize(stop));
        float e = 0;
        CUDA_CHECK(cudaEventElapsedTime(&e, start, stop));
        step_ms.push_back(e);
      }
      const auto totals = timer.collect();
      model.set_phase_timer(nullptr);
      const double copy_bps = bench::copy_bytes_per_s(ctx, std::size_t{256} << 20, 20);
      const double flops_per_s = matmul_rate_option > 0 ? matmul_rate_option : matmul_rate(ctx);

      bench::Qwen3StepShape s = bench::qwen3_step_shape(shape, batch, seq, spec->parameter_count());
      s.recompute = recompute;
      s.optimizer = optimizer_type;
      const auto work = bench::qwen3_step_work(s);

      double step = 0;
      for (double e : step_ms) step += e;
      step /= static_cast<double>(step_ms.size());
      const double per_step = 1.0 / static_cast<double>(breakdown_steps);
      nlohmann::json rows = nlohmann::json::array();
      std::fprintf(stderr, "%-24s %10s %6s %7s %10s %7s  %s\n", "phase", "ms/step", "calls", "share", "floor_ms",
                   "x floor", "floor");
      double phased = 0;
      auto add_row = [&](const std::string& name, double phase_ms, double calls) {
        nlohmann::json row = {{"phase", name}, {"ms", phase_ms}, {"calls", calls}, {"share", phase_ms / step}};
        const auto it = work.find(name);
        double floor_ms = 0;
        if (it != work.end() && it->second.flops > 0) {
          floor_ms = it->second.flops / flops_per_s * 1e3;
          row["floor"] = "flops/matmul";
        } else if (it != work.end() && it->second.bytes > 0) {
          floor_ms = it->second.bytes / copy_bps * 1e3;
          row["floor"] = "bytes/copy";
        } else {
          row["floor"] = nullptr;
        }
        row["floor_ms"] = floor_ms > 0 ? nlohmann::json(floor_ms) : nlohmann::json(nullptr);
        std::fprintf(stderr, "%-24s %10.3f %6.0f %6.1f%% %10.3f %7.2f  %s\n", name.c_str(), phase_ms, calls,
                     100.0 * phase_ms / step, floor_ms, floor_ms > 0 ? phase_ms / floor_ms : 0.0,
                     row["floor"].is_null() ? "-" : row["floor"].get<std::string>().c_str());
        rows.push_back(std::move(row));
      };
      for (const auto& e : totals) {
        add_row(e.name, e.ms * per_step, static_cast<double>(e.calls) * per_step);
        phased += e.ms * per_step;
      }
      // What no phase covers: launch gaps, the gaps the events themselves add, unphased work.
      add_row("other", step - phased, 0);
      std::fprintf(stderr, "step %.3f ms with events (copy %.0f GB/s, matmul %.0f TFLOP/s%s)\n", step, copy_bps * 1e-9,
                   flops_per_s * 1e-12, matmul_rate_option > 0 ? ", given" : ", measured");
      return {{"rows", rows},
              {"step_ms", step},
              {"steps", breakdown_steps},
              {"copy_bytes_per_s", copy_bps},
              {"matmul_flops_per_s", flops_per_s},
              {"matmul_rate", matmul_rate_option > 0 ? "given" : "measured"}};
    };
    const nlohmann::json breakdown_json = breakdown ? run_breakdown() : nlohmann::json(nullptr);
    std::sort(ms.begin(), ms.end());
    std::sort(optimizer_ms.begin(), optimizer_ms.end());
    const double med = ms[ms.size() / 2];
    const double optimizer_med = optimizer_ms[optimizer_ms.size() / 2];
    const double params = static_cast<double>(spec->parameter_count());
    const double flops_per_token = spec->flops_per_token(seq);
    const double tok_s = static_cast<double>(n) / (med * 1e-3);
    const nlohmann::json out = {
        {"bench", preset + (optimizer_type == "adamw" ? " train step" : " train step, " + optimizer_type)},
        {"optimizer", optimizer_type},
        {"device", ctx.device_name()},
        {"ours_ms", med},
        {"optimizer_ms", optimizer_med},
        {"optimizer_share", optimizer_med / med},
        {"tok_s", tok_s},
        {"mfu", tok_s * flops_per_token / 989e12},
        {"memory_gib", static_cast<double>(free0 - free1) / (1 << 30)},
        {"activation_gib", static_cast<double>(model.activation_bytes()) / (1 << 30)},
        {"batch", batch},
        {"seq", seq},
        {"recompute", recompute},
        {"final_loss", loss},
    };
    nlohmann::json printed = out;
    if (breakdown) {
      printed["breakdown"] = breakdown_json["rows"];
      for (const char* key : {"step_ms", "steps", "copy_bytes_per_s", "matmul_flops_per_s", "matmul_rate"})
        printed[std::string("breakdown_") + key] = breakdown_json[key];
    }
    std::printf("%s\n", printed.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qwen3_train_bench: %s\n", e.what());
    return 1;
  }
}
