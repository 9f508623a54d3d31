// Training-quality comparison of the optimizers on a real problem: a byte-level next-byte MLP
// language model on a text corpus (the King James Bible), trained three times from the same
// initial weights on the same batches -- fp32 AdamW, adamw8bit with the companded code, adamw8bit
// with the linear code -- and evaluated on held-out text. Runs on the cpu backend (plain C++
// forward/backward with OpenMP, the optimizers' CPU references, whose codes are the GPU's).
//
// Model: the embeddings (32) of the previous 8 bytes, concatenated (256) -> tanh layer (512) ->
// 256-way softmax. Parameters live in an optim::Slab; forward and backward read the fp32 master
// weights and write the fp32 gradient slab. Schedule: linear warmup, cosine decay to 10%.
// Appends one JSON line to --out: {"bench": "adamw8bit_quality", "device": "cpu", "steps",
// "fp32_loss", "int8_loss", "linear_int8_loss", "rel_diff", "linear_rel_diff", "date", "commit", ...};
// a loss that is not finite (a diverged run) is written as null.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "optim/optimizer.h"

namespace {

constexpr int kContext = 8;                // previous bytes seen
constexpr int kEmbed = 32;                 // embedding width per byte
constexpr int kInput = kContext * kEmbed;  // 256
constexpr int kHidden = 512;
constexpr int kVocab = 256;

struct Corpus {
  std::vector<std::uint8_t> bytes;
  std::int64_t train_end = 0;  // [kContext, train_end) train targets; [train_end + kContext, size) held out
};

Corpus load_corpus(const std::string& path, double held_out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw core::InputError("adamw8bit_quality: cannot open corpus '" + path + "'");
  Corpus c;
  c.bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (c.bytes.size() < 100000) throw core::InputError("adamw8bit_quality: corpus '" + path + "' is too small");
  c.train_end = static_cast<std::int64_t>(static_cast<double>(c.bytes.size()) * (1.0 - held_out));
  return c;
}

std::vector<optim::ParamSpec> model_params() {
  return {{.name = "embedding", .shape = {kVocab, kEmbed}},
          {.name = "w1", .shape = {kInput, kHidden}},
          {.name = "b1", .shape = {kHidden}, .decay = false},
          {.name = "w2", .shape = {kHidden, kVocab}},
          {.name = "b2", .shape = {kVocab}, .decay = false}};
}

// The MLP over views of a slab's master weights and gradients.
class MlpLm {
 public:
  explicit MlpLm(optim::Slab& slab)
      : emb_(slab.master_view(0).as<float>()),
        w1_(slab.master_view(1).as<float>()),
        b1_(slab.master_view(2).as<float>()),
        w2_(slab.master_view(3).as<float>()),
        b2_(slab.master_view(4).as<float>()),
        d_emb_(slab.grad_view(0).as<float>()),
        d_w1_(slab.grad_view(1).as<float>()),
        d_b1_(slab.grad_view(2).as<float>()),
        d_w2_(slab.grad_view(3).as<float>()),
        d_b2_(slab.grad_view(4).as<float>()) {}

  void init(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    auto normal = [&](float* p, std::int64_t n, float sd) {
      std::normal_distribution<float> d(0.0f, sd);
      for (std::int64_t i = 0; i < n; ++i) p[i] = d(rng);
    };
    normal(emb_, kVocab * kEmbed, 1.0f);
    normal(w1_, kInput * kHidden, 1.0f / std::sqrt(static_cast<float>(kInput)));
    std::fill(b1_, b1_ + kHidden, 0.0f);
    normal(w2_, kHidden * kVocab, 1.0f / std::sqrt(static_cast<float>(kHidden)));
    std::fill(b2_, b2_ + kVocab, 0.0f);
  }

  // Mean cross-entropy of the targets at `positions`; with `backward`, writes the gradients of
  // that mean into the gradient slab (which the optimizer zeroes after every step).
  double run(const std::uint8_t* text, const std::vector<std::int64_t>& positions, bool backward) {
    const auto n = static_cast<std::int64_t>(positions.size());
    x_.resize(static_cast<std::size_t>(n * kInput));
    h_.resize(static_cast<std::size_t>(n * kHidden));
    p_.resize(static_cast<std::size_t>(n * kVocab));
    losses_.resize(static_cast<std::size_t>(n));
#pragma omp parallel for schedule(static)
    for (std::int64_t b = 0; b < n; ++b) forward_one(text, positions[static_cast<std::size_t>(b)], b);
    double loss = 0;
    for (double l : losses_) loss += l;
    loss /= static_cast<double>(n);
    if (backward) backward_all(text, positions);
    return loss;
  }

 private:
  void forward_one(const std::uint8_t* text, std::int64_t pos, std::int64_t b) {
    float* x = x_.data() + b * kInput;
    for (int c = 0; c < kContext; ++c) {
      const float* e = emb_ + text[pos - kContext + c] * kEmbed;
      std::copy(e, e + kEmbed, x + c * kEmbed);
    }
    float* h = h_.data() + b * kHidden;
    std::copy(b1_, b1_ + kHidden, h);
    for (int k = 0; k < kInput; ++k) {
      const float xk = x[k];
      const float* w = w1_ + k * kHidden;
#pragma omp simd
      for (int j = 0; j < kHidden; ++j) h[j] += xk * w[j];
    }
    for (int j = 0; j < kHidden; ++j) h[j] = std::tanh(h[j]);
    float* p = p_.data() + b * kVocab;
    std::copy(b2_, b2_ + kVocab, p);
    for (int j = 0; j < kHidden; ++j) {
      const float hj = h[j];
      const float* w = w2_ + j * kVocab;
#pragma omp simd
      for (int r = 0; r < kVocab; ++r) p[r] += hj * w[r];
    }
    float max_logit = p[0];
    for (int r = 1; r < kVocab; ++r) max_logit = std::max(max_logit, p[r]);
    double sum = 0;
    for (int r = 0; r < kVocab; ++r) {
      p[r] = std::exp(p[r] - max_logit);
      sum += p[r];
    }
    const int target = text[pos];
    losses_[static_cast<std::size_t>(b)] = -(std::log(static_cast<double>(p[target])) - std::log(sum));
    const auto inv = static_cast<float>(1.0 / sum);
    for (int r = 0; r < kVocab; ++r) p[r] *= inv;
  }

  void backward_all(const std::uint8_t* text, const std::vector<std::int64_t>& positions) {
    const auto n = static_cast<std::int64_t>(positions.size());
    const float inv_n = 1.0f / static_cast<float>(n);
    dh_.resize(static_cast<std::size_t>(n * kHidden));
    dx_.resize(static_cast<std::size_t>(n * kInput));
    // p_ becomes dlogits = (softmax - onehot) / n; dh_ the gradient at the tanh's input.
#pragma omp parallel for schedule(static)
    for (std::int64_t b = 0; b < n; ++b) {
      float* dl = p_.data() + b * kVocab;
      dl[text[positions[static_cast<std::size_t>(b)]]] -= 1.0f;
      for (int r = 0; r < kVocab; ++r) dl[r] *= inv_n;
      const float* h = h_.data() + b * kHidden;
      float* dh = dh_.data() + b * kHidden;
      for (int j = 0; j < kHidden; ++j) {
        const float* w = w2_ + j * kVocab;
        float acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int r = 0; r < kVocab; ++r) acc += w[r] * dl[r];
        dh[j] = acc * (1.0f - h[j] * h[j]);
      }
      float* dx = dx_.data() + b * kInput;
      for (int k = 0; k < kInput; ++k) {
        const float* w = w1_ + k * kHidden;
        float acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int j = 0; j < kHidden; ++j) acc += w[j] * dh[j];
        dx[k] = acc;
      }
    }
    // Weight gradients, one output row per thread at a time (no races, fixed order).
#pragma omp parallel for schedule(static)
    for (int j = 0; j < kHidden; ++j) {
      float* g = d_w2_ + j * kVocab;
      for (std::int64_t b = 0; b < n; ++b) {
        const float hj = h_[static_cast<std::size_t>(b * kHidden + j)];
        const float* dl = p_.data() + b * kVocab;
#pragma omp simd
        for (int r = 0; r < kVocab; ++r) g[r] += hj * dl[r];
      }
    }
#pragma omp parallel for schedule(static)
    for (int k = 0; k < kInput; ++k) {
      float* g = d_w1_ + k * kHidden;
      for (std::int64_t b = 0; b < n; ++b) {
        const float xk = x_[static_cast<std::size_t>(b * kInput + k)];
        const float* dh = dh_.data() + b * kHidden;
#pragma omp simd
        for (int j = 0; j < kHidden; ++j) g[j] += xk * dh[j];
      }
    }
    for (std::int64_t b = 0; b < n; ++b) {
      for (int r = 0; r < kVocab; ++r) d_b2_[r] += p_[static_cast<std::size_t>(b * kVocab + r)];
      for (int j = 0; j < kHidden; ++j) d_b1_[j] += dh_[static_cast<std::size_t>(b * kHidden + j)];
      const std::int64_t pos = positions[static_cast<std::size_t>(b)];
      for (int c = 0; c < kContext; ++c) {
        float* g = d_emb_ + text[pos - kContext + c] * kEmbed;
        const float* dx = dx_.data() + b * kInput + c * kEmbed;
        for (int e = 0; e < kEmbed; ++e) g[e] += dx[e];
      }
    }
  }

  float *emb_, *w1_, *b1_, *w2_, *b2_;
  float *d_emb_, *d_w1_, *d_b1_, *d_w2_, *d_b2_;
  std::vector<float> x_, h_, p_, dh_, dx_;
  std::vector<double> losses_;
};

struct TrainOptions {
  int steps = 2000;
  int batch = 512;
  int warmup = 100;
  double lr = 2e-3;
  std::uint64_t seed = 1234;
  int eval_stride = 1;
};

// Learning rate of step s (0-based): linear warmup, then cosine decay to 10% of the peak.
double schedule(const TrainOptions& o, int s) {
  if (s < o.warmup) return o.lr * (s + 1) / o.warmup;
  const double progress = static_cast<double>(s - o.warmup) / std::max(1, o.steps - o.warmup);
  return o.lr * (0.1 + 0.45 * (1.0 + std::cos(3.14159265358979323846 * progress)));
}

struct TrainResult {
  double val_loss = 0;
  double last_train_loss = 0;  // mean over the last 100 steps
  double seconds = 0;
  std::int64_t skipped = 0;
  int diverged_at = 0;  // first step whose training loss was not finite (0: never)
};

TrainResult train(const Corpus& corpus, const optim::OptimizerConfig& config, const TrainOptions& o,
                  const std::string& label) {
  const auto start = std::chrono::steady_clock::now();
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(optim::SlabLayout(model_params(), 1), cpu);
  const auto optimizer = optim::make_optimizer(config, slab, cpu);
  MlpLm model(slab);
  model.init(o.seed);
  const std::uint8_t* text = corpus.bytes.data();
  std::vector<std::int64_t> batch(static_cast<std::size_t>(o.batch));
  double recent = 0;
  int recent_count = 0;
  int diverged_at = 0;
  for (int s = 0; s < o.steps; ++s) {
    std::mt19937_64 rng(o.seed * 1000003ull + static_cast<std::uint64_t>(s));  // same batches for every optimizer
    std::uniform_int_distribution<std::int64_t> pick(kContext, corpus.train_end - 1);
    for (auto& p : batch) p = pick(rng);
    const double loss = model.run(text, batch, /*backward=*/true);
    optimizer->step(schedule(o, s));
    if (!std::isfinite(loss) && diverged_at == 0) diverged_at = s + 1;
    if (s >= o.steps - 100) {
      recent += loss;
      ++recent_count;
    }
    if ((s + 1) % 250 == 0 || s == 0) {
      std::fprintf(stderr, "[%s] step %d/%d train loss %.4f lr %.2e grad norm %.3f\n", label.c_str(), s + 1, o.steps,
                   loss, schedule(o, s), optimizer->report().grad_norm);
    }
  }
  // Held-out loss over every `eval_stride`-th position of the held-out text, in fixed chunks.
  std::vector<std::int64_t> held_out;
  for (std::int64_t p = corpus.train_end + kContext; p < static_cast<std::int64_t>(corpus.bytes.size());
       p += o.eval_stride) {
    held_out.push_back(p);
  }
  double total = 0;
  const std::size_t chunk = 4096;
  for (std::size_t b = 0; b < held_out.size(); b += chunk) {
    const std::vector<std::int64_t> part(
        held_out.begin() + static_cast<std::ptrdiff_t>(b),
        held_out.begin() + static_cast<std::ptrdiff_t>(std::min(held_out.size(), b + chunk)));
    total += model.run(text, part, /*backward=*/false) * static_cast<double>(part.size());
  }
  TrainResult r;
  r.val_loss = total / static_cast<double>(held_out.size());
  r.last_train_loss = recent / std::max(1, recent_count);
  r.skipped = optimizer->report().skipped_steps;
  r.diverged_at = diverged_at;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "[%s] held-out loss %.5f (%zu positions), %.1f s\n", label.c_str(), r.val_loss, held_out.size(),
               r.seconds);
  return r;
}

std::string today_utc() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", &tm);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"adamw8bit vs fp32 AdamW: byte-level MLP language model, held-out loss"};
  std::string data, out = "bench/results/optimizers.jsonl", commit = "unknown";
  TrainOptions o;
  double held_out = 0.1;
  app.add_option("--data", data, "corpus text file (e.g. the King James Bible)")->required();
  app.add_option("--out", out, "JSONL file the result line is appended to");
  app.add_option("--commit", commit, "commit recorded with the result");
  app.add_option("--steps", o.steps, "optimizer steps per run");
  app.add_option("--batch", o.batch, "positions per step");
  app.add_option("--warmup", o.warmup, "warmup steps");
  app.add_option("--lr", o.lr, "peak learning rate");
  app.add_option("--seed", o.seed, "seed of the initial weights and of the batches");
  app.add_option("--eval-stride", o.eval_stride, "evaluate every n-th held-out position");
  app.add_option("--held-out", held_out, "fraction of the corpus held out (its end)");
  CLI11_PARSE(app, argc, argv);

  try {
    if (o.steps < 1 || o.batch < 1 || o.warmup < 1 || o.eval_stride < 1 || !(held_out > 0 && held_out < 0.5)) {
      throw core::InputError(
          "adamw8bit_quality: steps, batch, warmup and eval-stride must be >= 1, held-out in (0, 0.5)");
    }
    const Corpus corpus = load_corpus(data, held_out);
    std::fprintf(stderr, "corpus %zu bytes (%lld train), %d steps x %d positions, %d threads\n", corpus.bytes.size(),
                 static_cast<long long>(corpus.train_end), o.steps, o.batch, omp_get_max_threads());

    optim::OptimizerConfig config;
    config.lr = o.lr;
    config.beta1 = 0.9;
    config.beta2 = 0.95;
    config.eps = 1e-8;
    config.weight_decay = 0.1;
    config.grad_clip = 1.0;
    config.type = "adamw";
    const TrainResult fp32 = train(corpus, config, o, "adamw fp32");
    config.type = "adamw8bit";
    config.adamw8bit.quantization = optim::Quantization::companded;
    const TrainResult companded = train(corpus, config, o, "adamw8bit companded");
    config.adamw8bit.quantization = optim::Quantization::linear;
    const TrainResult linear = train(corpus, config, o, "adamw8bit linear");

    auto rel = [&](double loss) { return loss / fp32.val_loss - 1.0; };
    nlohmann::json line = {
        {"bench", "adamw8bit_quality"},
        {"device", "cpu"},
        {"steps", o.steps},
        {"fp32_loss", fp32.val_loss},
        {"int8_loss", companded.val_loss},
        {"linear_int8_loss", linear.val_loss},
        {"rel_diff", rel(companded.val_loss)},
        {"linear_rel_diff", rel(linear.val_loss)},
        {"date", today_utc()},
        {"commit", commit},
        {"model", "byte MLP: 8 x 32 embeddings -> tanh 512 -> softmax 256 (271,104 parameters)"},
        {"corpus_bytes", corpus.bytes.size()},
        {"batch", o.batch},
        {"lr", o.lr},
        {"schedule", "warmup " + std::to_string(o.warmup) + ", cosine to 10%"},
        {"weight_decay", config.weight_decay},
        {"grad_clip", config.grad_clip},
        {"betas", {config.beta1, config.beta2}},
        {"train_loss_last100", {fp32.last_train_loss, companded.last_train_loss, linear.last_train_loss}},
        {"skipped_steps", {fp32.skipped, companded.skipped, linear.skipped}},
        {"diverged_at_step", {fp32.diverged_at, companded.diverged_at, linear.diverged_at}},  // 0: never
        {"threads", omp_get_max_threads()},
        {"seconds", fp32.seconds + companded.seconds + linear.seconds},
    };
    std::ofstream f(out, std::ios::app);
    if (!f) throw core::InputError("adamw8bit_quality: cannot append to '" + out + "'");
    f << line.dump() << "\n";
    std::printf("%s\n", line.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "adamw8bit_quality: %s\n", e.what());
    return 1;
  }
}
