// One full training step of Qwen3 on one GPU (forward, backward, the optimizer with clipping:
// AdamW, or with --optimizer muon Muon for the hidden matrices), random tokens: median step time,
// the optimizer's part of it (`optimizer_ms`, its median, and `optimizer_share` of the step),
// tokens/s, MFU ((6N + 6*L*H*hd*T) FLOPs per token against 989 TFLOP/s dense bf16) and device
// memory in use. The transformers peer is bench/peer_qwen3_train.py; bench/record.py joins the two.
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "optim/optimizer.h"

int main(int argc, char** argv) {
  CLI::App app{"Qwen3 training-step benchmark"};
  std::string preset = "qwen3-0.6b", recompute = "none", optimizer_type = "adamw";
  std::int64_t batch = 8, seq = 2048;
  int warmup = 3, steps = 10;
  app.add_option("--preset", preset);
  app.add_option("--batch", batch);
  app.add_option("--seq", seq);
  app.add_option("--recompute", recompute, "none | mlp | full");
  app.add_option("--warmup", warmup);
  app.add_option("--steps", steps);
  app.add_option("--optimizer", optimizer_type, "adamw | muon (Muon's defaults, muon.lr 0.02)")
      ->check(CLI::IsMember({"adamw", "muon"}));
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
    std::printf("%s\n", out.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qwen3_train_bench: %s\n", e.what());
    return 1;
  }
}
