// e29a_gradient_probe CHECKPOINT --data SHARD [--sequences B] [--seq T] [--offset TOKEN]: one batch's
// gradient at a trained E29a state, on the GPU (the hybrid CUDA path, bf16 mirror) and on the CPU
// (the fp32 reference, fed the same bf16-rounded weights, and again the unrounded fp32 master).
// Per tensor: both norms and the normwise error ||cuda - cpu|| / ||cpu||; the cpu-vs-cpu column
// (bf16 against fp32 weights, same arithmetic) is the state's own sensitivity, the yardstick for
// the kernel's error. Then, per layer, the reference's backward through time: the norms of
// dL/dh_t and dL/dH_{t-1} every `--every` steps going back from the last step, and the largest
// score gradients of the read and write attentions, which say which path a growing gradient takes.
// With --variants, the reference's gradient norm (whole model and per layer) under each backward
// option of layer.h: exact, either attention's scores detached, both, the carried gradient bounded.
// Prints one JSON object per line.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/half.h"
#include "models/e29a/family.h"
#include "models/e29a/model.h"
#include "optim/slab.h"
#include "text/token_shard.h"
#include "trainer/pretrained.h"

namespace {

struct Gradients {
  double loss = 0;
  std::vector<float> grad;  // global element order of the layout
};

Gradients cpu_gradients(const trainer::PretrainedWeights& weights, const std::vector<float>& full,
                        const std::vector<std::int32_t>& ids, const std::vector<std::int32_t>& targets,
                        std::int64_t batch, std::int64_t seq,
                        std::vector<models::e29a::LayerBackwardTrace<float>>* traces,
                        const models::e29a::LayerBackwardOptions& options = {}) {
  const core::DeviceContext context(core::Device::cpu());
  optim::Slab slab(weights.layout, context);
  std::copy(full.begin(), full.end(), slab.master().as<float>());
  models::e29a::E29aConfig config = models::e29a::config_from_shape(weights.spec->shape());
  config.backward = options;
  models::e29a::E29aCpu model(config, slab, full.data());
  model.set_backward_trace(traces);
  model.forward_backward(ids.data(), targets.data(), batch, seq, 1.0f);
  Gradients out;
  out.loss = *model.loss();
  const float* g = slab.grad().as<float>();
  out.grad.assign(g, g + weights.layout.total_elements());
  return out;
}

Gradients cuda_gradients(const trainer::PretrainedWeights& weights, const std::vector<std::int32_t>& ids,
                         const std::vector<std::int32_t>& targets, std::int64_t batch, std::int64_t seq) {
  const core::DeviceContext context(core::Device::cuda(0));
  optim::Slab slab(weights.layout, context);
  core::copy_bytes(slab.master().data(), weights.master.data(), weights.master.size() * sizeof(float),
                   context.stream());
  slab.write_mirror(context);
  const auto model = weights.spec->trainable(slab, context, {.max_tokens = batch * seq});
  core::Buffer ids_dev(core::Device::cuda(0), ids.size() * sizeof(std::int32_t));
  core::Buffer targets_dev(core::Device::cuda(0), targets.size() * sizeof(std::int32_t));
  core::copy_bytes(ids_dev.data(), ids.data(), ids.size() * sizeof(std::int32_t), context.stream());
  core::copy_bytes(targets_dev.data(), targets.data(), targets.size() * sizeof(std::int32_t), context.stream());
  model->forward_backward(ids_dev.as<std::int32_t>(), targets_dev.as<std::int32_t>(), batch, seq, 1.0f);
  Gradients out;
  float loss = 0;
  core::copy_bytes(&loss, model->loss(), sizeof(float), context.stream());
  out.grad.resize(static_cast<std::size_t>(weights.layout.total_elements()));
  core::copy_bytes(out.grad.data(), slab.grad().data(), out.grad.size() * sizeof(float), context.stream());
  context.synchronize();
  out.loss = loss;
  return out;
}

double norm(const float* a, std::int64_t n) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * a[i];
  return std::sqrt(s);
}

double distance(const float* a, const float* b, std::int64_t n) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    s += d * d;
  }
  return std::sqrt(s);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"E29a gradient at a checkpoint: CUDA path against the CPU reference, and the backward through time"};
  std::string path, data;
  std::int64_t batch = 2, seq = 512, offset = 0, every = 32;
  app.add_option("checkpoint", path, "checkpoint step directory or run directory")->required();
  app.add_option("--data", data, "token shard the sequences come from")->required();
  app.add_option("--sequences", batch, "sequences in the batch (default 2)");
  app.add_option("--seq", seq, "tokens per sequence (default 512)");
  app.add_option("--offset", offset, "token index of the first sequence (default 0)");
  app.add_option("--every", every, "trace every this many steps (default 32)");
  bool variants = false;
  double carry_clip = 1.0;
  app.add_flag("--variants", variants, "the reference's gradient under each backward option");
  app.add_option("--carry-clip", carry_clip, "bound of the carried-gradient variant (default 1)");
  CLI11_PARSE(app, argc, argv);
  try {
    const trainer::PretrainedWeights weights = trainer::load_pretrained(path);
    if (weights.spec->family() != "e29a") throw core::InputError(path + ": not an e29a model");
    const text::TokenShard shard(data);
    std::vector<std::int32_t> ids(static_cast<std::size_t>(batch * seq)), targets(ids.size());
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto at = static_cast<std::size_t>(b * seq);
      shard.read_window(static_cast<std::uint64_t>(offset + b * seq), {ids.data() + at, static_cast<std::size_t>(seq)},
                        {targets.data() + at, static_cast<std::size_t>(seq)});
    }
    std::vector<float> rounded(weights.master.size());
    for (std::size_t i = 0; i < rounded.size(); ++i) {
      rounded[i] = core::bf16_to_float(core::float_to_bf16(weights.master[i]));
    }
    std::vector<models::e29a::LayerBackwardTrace<float>> traces;
    const Gradients gpu = cuda_gradients(weights, ids, targets, batch, seq);
    const Gradients cpu = cpu_gradients(weights, rounded, ids, targets, batch, seq, &traces);
    const Gradients cpu32 = cpu_gradients(weights, weights.master, ids, targets, batch, seq, nullptr);
    std::printf("%s\n",
                nlohmann::json({{"checkpoint", path},
                                {"loss_cuda", gpu.loss},
                                {"loss_cpu", cpu.loss},
                                {"loss_cpu_fp32_weights", cpu32.loss},
                                {"grad_norm_cuda", norm(gpu.grad.data(), static_cast<std::int64_t>(gpu.grad.size()))},
                                {"grad_norm_cpu", norm(cpu.grad.data(), static_cast<std::int64_t>(cpu.grad.size()))}})
                    .dump()
                    .c_str());
    for (const optim::SlabTensor& t : weights.layout.parameters()) {
      const float* g = gpu.grad.data() + t.offset;
      const float* c = cpu.grad.data() + t.offset;
      const float* c32 = cpu32.grad.data() + t.offset;
      const double ref = norm(c, t.numel);
      std::printf("%s\n", nlohmann::json({{"tensor", t.spec.name},
                                          {"norm_cuda", norm(g, t.numel)},
                                          {"norm_cpu", ref},
                                          {"error_cuda_vs_cpu", distance(g, c, t.numel) / std::max(ref, 1e-30)},
                                          {"error_cpu_fp32_weights", distance(c32, c, t.numel) / std::max(ref, 1e-30)}})
                              .dump()
                              .c_str());
    }
    for (std::size_t l = 0; l < traces.size(); ++l) {
      const auto& tr = traces[l];
      const std::int64_t steps = seq;
      const std::int64_t slots = static_cast<std::int64_t>(tr.read.size()) / (steps * batch);
      for (std::int64_t t = steps - 1; t >= 0; t -= std::max<std::int64_t>(every, 1)) {
        double dh = 0, dtape = 0, read = 0, write = 0;
        for (std::int64_t b = 0; b < batch; ++b) {
          dh = std::max(dh, tr.state_grad_norm[static_cast<std::size_t>(t * batch + b)]);
          dtape = std::max(dtape, tr.tape_grad_norm[static_cast<std::size_t>(t * batch + b)]);
          for (std::int64_t n = 0; n < slots; ++n) {
            const auto i = static_cast<std::size_t>((t * batch + b) * slots + n);
            read = std::max(read, std::fabs(static_cast<double>(tr.read[i])));
            write = std::max(write, std::fabs(static_cast<double>(tr.write[i])));
          }
        }
        std::printf("%s\n", nlohmann::json({{"layer", l},
                                            {"step", t},
                                            {"state_grad_norm", dh},
                                            {"tape_grad_norm", dtape},
                                            {"read_score_grad_max", read},
                                            {"write_score_grad_max", write}})
                                .dump()
                                .c_str());
      }
    }
    if (variants) {
      models::e29a::LayerBackwardOptions read, write, both, clip;
      read.detach_read_scores = true;
      write.detach_write_scores = true;
      both.detach_read_scores = both.detach_write_scores = true;
      clip.carry_clip = carry_clip;
      const std::pair<const char*, models::e29a::LayerBackwardOptions> list[] = {
          {"exact", {}}, {"detach read", read}, {"detach write", write}, {"detach both", both}, {"carry clip", clip}};
      for (const auto& [name, options] : list) {
        const Gradients g = cpu_gradients(weights, rounded, ids, targets, batch, seq, nullptr, options);
        nlohmann::json layers = nlohmann::json::array();
        for (const optim::SlabTensor& t : weights.layout.tensors()) {
          if (t.spec.name.ends_with(".w_h")) layers.push_back(norm(g.grad.data() + t.offset, t.numel));
        }
        std::printf("%s\n",
                    nlohmann::json({{"variant", name},
                                    {"carry_clip", options.carry_clip},
                                    {"grad_norm", norm(g.grad.data(), static_cast<std::int64_t>(g.grad.size()))},
                                    {"w_h_grad_norm_per_layer", layers}})
                        .dump()
                        .c_str());
      }
    }
    return 0;
  } catch (const core::InputError& e) {
    std::fprintf(stderr, "e29a_gradient_probe: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "e29a_gradient_probe: %s\n", e.what());
    return 1;
  }
}
