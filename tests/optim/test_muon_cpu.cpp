// Muon on the cpu backend: Newton-Schulz against a straightforward double-precision iteration on
// awkward shapes, the singular values it leaves, whole steps (matrices and the AdamW rest) against
// torch.optim.Muon's formulas evaluated independently in double, the plan of matrices (parts left
// unsplit by the layout, stacked matrices), simulated ZeRO shards stepping exactly like one rank,
// both non-finite policies, and the per-rank load (Newton-Schulz FLOPs and buffers) against hand
// counts.
#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "models/e29a/config.h"
#include "models/qwen3/config.h"
#include "optim/muon.h"
#include "optim/muon_load.h"
#include "optim/newton_schulz.h"
#include "optim/sharded_run_support.h"
#include "support/test_support.h"

namespace {

using optim::OptimizerConfig;
using optim::ParamSpec;
using Matrix = std::vector<double>;  // row-major

// torch.optim.Muon's _zeropower_via_newtonschulz, in double.
Matrix newton_schulz_double(const Matrix& g, std::int64_t rows, std::int64_t cols, int steps, double eps) {
  const bool t = rows > cols;
  const std::int64_t r = t ? cols : rows, c = t ? rows : cols;
  Matrix x(static_cast<std::size_t>(r * c));
  double norm = 0;
  for (double v : g) norm += v * v;
  norm = std::max(std::sqrt(norm), eps);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j)
      x[static_cast<std::size_t>(t ? j * c + i : i * c + j)] = g[i * cols + j] / norm;
  auto at = [](Matrix& m, std::int64_t n, std::int64_t i, std::int64_t j) -> double& {
    return m[static_cast<std::size_t>(i * n + j)];
  };
  for (int s = 0; s < steps; ++s) {
    Matrix a(static_cast<std::size_t>(r * r), 0.0), b(a.size(), 0.0), next(x.size(), 0.0);
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < r; ++j)
        for (std::int64_t k = 0; k < c; ++k) at(a, r, i, j) += at(x, c, i, k) * at(x, c, j, k);
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < r; ++j) {
        double aa = 0;
        for (std::int64_t k = 0; k < r; ++k) aa += at(a, r, i, k) * at(a, r, k, j);
        at(b, r, i, j) = -4.7750 * at(a, r, i, j) + 2.0315 * aa;
      }
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < c; ++j) {
        double bx = 0;
        for (std::int64_t k = 0; k < r; ++k) bx += at(b, r, i, k) * at(x, c, k, j);
        at(next, c, i, j) = 3.4445 * at(x, c, i, j) + bx;
      }
    x = next;
  }
  Matrix out(g.size());
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) out[i * cols + j] = x[static_cast<std::size_t>(t ? j * c + i : i * c + j)];
  return out;
}

// Eigenvalues of the symmetric n x n matrix `a` (cyclic Jacobi rotations).
std::vector<double> symmetric_eigenvalues(Matrix a, std::int64_t n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = i + 1; j < n; ++j) off += a[i * n + j] * a[i * n + j];
    if (off < 1e-26) break;
    for (std::int64_t p = 0; p < n; ++p) {
      for (std::int64_t q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (std::fabs(apq) < 1e-300) continue;
        const double theta = (a[q * n + q] - a[p * n + p]) / (2 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double cs = 1 / std::sqrt(t * t + 1), sn = t * cs;
        for (std::int64_t k = 0; k < n; ++k) {  // columns p, q
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = cs * akp - sn * akq;
          a[k * n + q] = sn * akp + cs * akq;
        }
        for (std::int64_t k = 0; k < n; ++k) {  // rows p, q
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = cs * apk - sn * aqk;
          a[q * n + k] = sn * apk + cs * aqk;
        }
      }
    }
  }
  std::vector<double> eig;
  for (std::int64_t i = 0; i < n; ++i) eig.push_back(a[i * n + i]);
  return eig;
}

TEST(NewtonSchulzCpu, MatchesDoublePrecisionOnAwkwardShapes) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::pair<std::int64_t, std::int64_t> shapes[] = {{1, 1},   {1, 7},   {7, 1},   {3, 5},   {5, 3},
                                                          {17, 64}, {64, 17}, {33, 65}, {65, 33}, {48, 48}};
  for (const auto& [rows, cols] : shapes) {
    for (int steps : {1, 5}) {
      SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols) + ", " + std::to_string(steps) + " steps");
      const auto g = test::random_normal(rng, static_cast<std::size_t>(rows * cols), 1e-3f);
      std::vector<float> ours(g.size());
      optim::newton_schulz_cpu(g.data(), rows, cols, steps, 1e-7f, ours.data());
      const Matrix expected = newton_schulz_double(Matrix(g.begin(), g.end()), rows, cols, steps, 1e-7);
      // fp32 storage between the products: the iteration's slope (up to ~3.4 per step at small
      // singular values) amplifies the roundings.
      EXPECT_LE(test::normwise_error(ours.data(), expected.data(), ours.size()), 2e-6);
    }
  }
}

TEST(NewtonSchulzCpu, ZeroMatrixStaysZero) {
  std::vector<float> g(12, 0.0f), out(12, 1.0f);
  optim::newton_schulz_cpu(g.data(), 3, 4, 5, 1e-7f, out.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST(NewtonSchulzCpu, SingularValuesNearOne) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{24, 64}, {64, 24}, {16, 128}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    const auto g = test::random_normal(rng, static_cast<std::size_t>(rows * cols));
    std::vector<float> o(g.size());
    optim::newton_schulz_cpu(g.data(), rows, cols, 5, 1e-7f, o.data());
    // Singular values of O: square roots of the eigenvalues of the smaller Gram matrix.
    const std::int64_t r = std::min(rows, cols);
    Matrix gram(static_cast<std::size_t>(r * r), 0.0);
    for (std::int64_t i = 0; i < r; ++i)
      for (std::int64_t j = 0; j < r; ++j)
        for (std::int64_t k = 0; k < std::max(rows, cols); ++k) {
          const auto e = [&](std::int64_t a, std::int64_t b) {
            return static_cast<double>(rows <= cols ? o[static_cast<std::size_t>(a * cols + b)]
                                                    : o[static_cast<std::size_t>(b * cols + a)]);
          };
          gram[static_cast<std::size_t>(i * r + j)] += e(i, k) * e(j, k);
        }
    const auto eig = symmetric_eigenvalues(gram, r);
    for (double e : eig) {
      const double sigma = std::sqrt(std::max(e, 0.0));
      EXPECT_GE(sigma, 0.5);
      EXPECT_LE(sigma, 1.5);
    }
  }
}

OptimizerConfig muon_config(double clip = 0.0, optim::NonFinitePolicy policy = optim::NonFinitePolicy::skip_step) {
  OptimizerConfig c;
  c.type = "muon";
  c.lr = 3e-3;
  c.beta1 = 0.9;
  c.beta2 = 0.95;
  c.eps = 1e-8;
  c.weight_decay = 0.05;
  c.grad_clip = clip;
  c.nonfinite = policy;
  c.muon.lr = 2e-2;
  c.muon.weight_decay = 0.1;
  return c;
}

// Matrices of every kind: fused with parts (split, and unsplit at toy shapes), stacked, tall and
// wide, with lr scale and without decay, between vectors and an embedding-like matrix.
std::vector<ParamSpec> muon_specs() {
  return {{.name = "embed", .shape = {37, 16}, .factored = true},
          {.name = "norm", .shape = {16}, .decay = false},
          {.name = "qkv", .shape = {32, 16}, .hidden_matrix = true, .parts = {{"q", 16}, {"k", 8}, {"v", 8}}},
          {.name = "odd", .shape = {7, 5}, .hidden_matrix = true, .parts = {{"odd_a", 4}, {"odd_b", 3}}},
          {.name = "xz", .shape = {24, 16}, .hidden_matrix = true, .stacked_rows = 12},
          {.name = "wide", .shape = {9, 70}, .lr_scale = 0.5f, .hidden_matrix = true},
          {.name = "tall", .shape = {70, 9}, .decay = false, .hidden_matrix = true},
          {.name = "bias", .shape = {5}, .decay = false}};
}

TEST(MuonCpu, PlanCutsPartsAndStackedMatrices) {
  const optim::SlabLayout layout(muon_specs(), 1);
  const auto plan = optim::make_muon_plan(layout, {0, layout.total_elements()});
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;
  for (const auto& m : plan.matrices) shapes.push_back({m.rows, m.cols});
  const std::vector<std::pair<std::int64_t, std::int64_t>> expected = {{16, 16}, {8, 16},  {8, 16}, {4, 5}, {3, 5},
                                                                       {12, 16}, {12, 16}, {9, 70}, {70, 9}};
  EXPECT_EQ(shapes, expected);
  EXPECT_EQ(layout.unsplit(), std::vector<std::string>{"odd"});
  EXPECT_EQ(plan.touched.size(), plan.matrices.size());
  std::int64_t packed = 0;
  for (const auto& m : plan.matrices) {
    EXPECT_EQ(m.packed, packed);
    packed += m.rows * m.cols;
  }
  EXPECT_EQ(plan.packed_elements, packed);
  auto bad = muon_specs();
  bad[4].stacked_rows = 7;
  const optim::SlabLayout bad_layout(bad, 1);
  EXPECT_THROW(optim::make_muon_plan(bad_layout, {0, bad_layout.total_elements()}), core::Error);
}

// Each rank orthogonalises the matrices its shard touches. An AdamW embedding [64, 8] (512
// elements) and matrices a [8, 16], b [16, 16], c [32, 8] lie at 0, 512, 640 and 896 (1152
// elements, 1536 on 2 ranks): rank 0 owns [0, 768) (a and the first half of b), rank 1 [768, 1536)
// (b's second half and c). Per iteration (r = min, c = max: 4 r^2 c + 2 r^3): a 5120, b 24576,
// c (as [8, 32]) 9216, 38912 in all. The bf16 Newton-Schulz buffers hold X twice and the Gram and
// polynomial scratch, each matrix rounded up to 128 elements: rank 0 X 128 + 256, Gram 128 + 256;
// rank 1 X 256 + 256, Gram 256 + 128.
TEST(MuonCpu, LoadPerRankMatchesHandCounts) {
  const std::vector<ParamSpec> specs = {{.name = "embed", .shape = {64, 8}},
                                        {.name = "a", .shape = {8, 16}, .hidden_matrix = true},
                                        {.name = "b", .shape = {16, 16}, .hidden_matrix = true},
                                        {.name = "c", .shape = {32, 8}, .hidden_matrix = true}};
  const optim::SlabLayout two(specs, 2);
  ASSERT_EQ(two.tensor("c").offset, 896);
  ASSERT_EQ(two.total_elements(), 1536);
  EXPECT_EQ(optim::newton_schulz_flop(32, 8, 1), 9216.0);
  EXPECT_EQ(optim::newton_schulz_flop(8, 32, 5), 5 * 9216.0);
  const optim::MuonLoad load = optim::muon_load(two, 1, 1);
  ASSERT_EQ(load.ranks.size(), 2u);
  EXPECT_EQ(load.flop, 38912.0);
  EXPECT_EQ(load.ranks[0].matrices, 2);
  EXPECT_EQ(load.ranks[0].flop, 5120.0 + 24576.0);
  EXPECT_EQ(load.ranks[1].matrices, 2);
  EXPECT_EQ(load.ranks[1].flop, 24576.0 + 9216.0);
  EXPECT_DOUBLE_EQ(load.busiest_over_even(), 33792.0 / (38912.0 / 2));
  EXPECT_DOUBLE_EQ(load.redundant(), 24576.0 / 38912.0);
  for (const auto& rank : load.ranks) EXPECT_EQ(rank.assembly_bytes, 4 * (128 + 256 + 256));
  EXPECT_EQ(load.ranks[0].newton_schulz_bytes, 2 * (2 * (128 + 256) + 2 * (128 + 256)));
  EXPECT_EQ(load.ranks[1].newton_schulz_bytes, 2 * (2 * (256 + 256) + 2 * (256 + 128)));
  EXPECT_EQ(load.largest_bytes(false), 4 * 640);
  EXPECT_EQ(load.largest_bytes(true), 4 * 640 + 3584);
  // ZeRO-0: every rank owns, and orthogonalises, everything; one rank is balanced by definition.
  const optim::MuonLoad zero0 = optim::muon_load(two, 0, 1);
  for (const auto& rank : zero0.ranks) EXPECT_EQ(rank.flop, 38912.0);
  EXPECT_DOUBLE_EQ(zero0.redundant(), 1.0);
  const optim::MuonLoad one = optim::muon_load(optim::SlabLayout(specs, 1), 1, 5);
  EXPECT_EQ(one.ranks[0].flop, 5 * 38912.0);
  EXPECT_DOUBLE_EQ(one.busiest_over_even(), 1.0);
  EXPECT_DOUBLE_EQ(one.redundant(), 0.0);
}

// The planned buffers are what Muon allocates (cpu: the assembly buffer), rank by rank.
TEST(MuonCpu, PlannedBuffersMatchAllocation) {
  const auto specs = muon_specs();
  for (int world : {1, 3}) {
    const optim::SlabLayout layout(specs, world);
    const optim::MuonLoad load = optim::muon_load(layout, 1, 5);
    test::ShardedRunOf<optim::Muon> cpu(core::Device::cpu(), specs, world, muon_config(0));
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(cpu.opts[static_cast<std::size_t>(r)]->buffer_bytes(),
                load.ranks[static_cast<std::size_t>(r)].bytes(false))
          << "rank " << r << " of " << world;
      EXPECT_EQ(static_cast<std::int64_t>(cpu.opts[static_cast<std::size_t>(r)]->plan().touched.size()),
                load.ranks[static_cast<std::size_t>(r)].matrices);
    }
  }
}

// The families mark the matrices Muon takes: Qwen3's q, k, v, o, gate, up and down; E29a's W_x and
// W_z (its fused input projection's halves), W_h and W_write; no embedding, head, norm or tape.
TEST(MuonCpu, ModelFamiliesMarkTheirHiddenMatrices) {
  auto names_of = [](const optim::SlabLayout& layout) {
    const auto plan = optim::make_muon_plan(layout, {0, layout.total_elements()});
    std::vector<std::string> names;
    for (const auto& m : plan.matrices) {
      names.push_back(layout.parameters()[static_cast<std::size_t>(m.tensor)].spec.name + " " + std::to_string(m.rows) +
                      "x" + std::to_string(m.cols));
    }
    return names;
  };
  models::qwen3::Qwen3Config q;
  q.vocab_size = 256;
  q.hidden_size = 64;
  q.intermediate_size = 128;
  q.num_layers = 1;
  q.num_heads = 2;
  q.num_kv_heads = 1;
  q.head_dim = 32;
  q.tie_word_embeddings = false;
  EXPECT_EQ(
      names_of(optim::SlabLayout(models::qwen3::parameter_specs(q), 1)),
      (std::vector<std::string>{"layers.0.q 64x64", "layers.0.k 32x64", "layers.0.v 32x64", "layers.0.o_proj 64x64",
                                "layers.0.gate 128x64", "layers.0.up 128x64", "layers.0.down 64x128"}));
  models::e29a::E29aConfig e;
  e.hidden_size = 16;
  e.num_layers = 1;
  e.tie_word_embeddings = false;
  EXPECT_EQ(names_of(optim::SlabLayout(models::e29a::parameter_specs(e), 1)),
            (std::vector<std::string>{"layers.0.w_xz 16x16", "layers.0.w_xz 16x16", "layers.0.w_h 16x16",
                                      "layers.0.w_write 16x16"}));
}

// Muon (torch.optim.Muon) for the matrices of the plan and AdamW for the rest, in double.
struct DoubleReference {
  const optim::SlabLayout& layout;
  const optim::MuonPlan plan;
  const OptimizerConfig config;
  std::vector<double> w, m, v;
  long long t = 0;

  DoubleReference(const optim::SlabLayout& l, const OptimizerConfig& c, const std::vector<float>& master)
      : layout(l),
        plan(optim::make_muon_plan(l, {0, l.total_elements()})),
        config(c),
        w(master.begin(), master.end()),
        m(w.size(), 0.0),
        v(w.size(), 0.0) {}

  void step(const std::vector<float>& grad) {
    ++t;
    double sq = 0;
    for (float g : grad) sq += static_cast<double>(g) * g;
    const double clip = config.grad_clip > 0 ? std::min(1.0, config.grad_clip / (std::sqrt(sq) + 1e-6)) : 1.0;
    const auto& tensors = layout.parameters();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (plan.is_matrix[i]) continue;
      const auto& s = tensors[i];
      const double lr = config.lr * s.spec.lr_scale, wd = s.spec.decay ? config.weight_decay : 0.0;
      const double bc1 = 1 - std::pow(config.beta1, static_cast<double>(t));
      const double bc2 = 1 - std::pow(config.beta2, static_cast<double>(t));
      for (std::int64_t e = s.offset; e < s.offset + s.numel; ++e) {
        const double g = grad[static_cast<std::size_t>(e)] * clip;
        m[e] = config.beta1 * m[e] + (1 - config.beta1) * g;
        v[e] = config.beta2 * v[e] + (1 - config.beta2) * g * g;
        w[e] = w[e] * (1 - lr * wd) - lr / bc1 * m[e] / (std::sqrt(v[e]) / std::sqrt(bc2) + config.eps);
      }
    }
    const double mu = config.muon.momentum;
    for (const auto& mat : plan.matrices) {
      const auto& spec = tensors[static_cast<std::size_t>(mat.tensor)].spec;
      Matrix u(static_cast<std::size_t>(mat.rows * mat.cols));
      for (std::int64_t k = 0; k < mat.rows * mat.cols; ++k) {
        const std::int64_t e = mat.offset + k;
        const double g = grad[static_cast<std::size_t>(e)] * clip;
        m[e] = mu * m[e] + (1 - mu) * g;
        u[static_cast<std::size_t>(k)] = config.muon.nesterov ? (1 - mu) * g + mu * m[e] : m[e];
      }
      const Matrix o = newton_schulz_double(u, mat.rows, mat.cols, static_cast<int>(config.muon.ns_steps), 1e-7);
      const double lr = config.muon.lr * spec.lr_scale;
      const double wd = spec.decay ? *config.muon.weight_decay : 0.0;
      const double a = static_cast<double>(mat.rows), b = static_cast<double>(mat.cols);
      const double adjusted = config.muon.adjust_lr == optim::MuonAdjustLr::original
                                  ? lr * std::sqrt(std::max(1.0, a / b))
                                  : lr * 0.2 * std::sqrt(std::max(a, b));
      for (std::int64_t k = 0; k < mat.rows * mat.cols; ++k) {
        const std::int64_t e = mat.offset + k;
        w[e] = w[e] * (1 - lr * wd) - adjusted * o[static_cast<std::size_t>(k)];
      }
    }
  }
};

void check_against_double(OptimizerConfig config) {
  std::mt19937_64 rng(test::fresh_seed());
  const optim::SlabLayout layout(muon_specs(), 1);
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(layout, cpu);
  optim::Muon muon(config, slab, cpu);
  auto master = test::random_normal(rng, static_cast<std::size_t>(layout.total_elements()), 0.1f);
  test::from_host(slab.master(), master);
  DoubleReference ref(layout, config, master);
  for (int step = 0; step < 4; ++step) {
    const auto g = test::random_grads(rng, layout, step == 2 ? 2.0f : 0.05f);
    test::from_host(slab.grad(), g);
    muon.step(config.lr);
    ref.step(g);
  }
  const auto ours = test::to_host<float>(slab.master());
  for (const auto& t : layout.parameters()) {
    const auto o = static_cast<std::size_t>(t.offset);
    EXPECT_LE(test::normwise_error(ours.data() + o, ref.w.data() + o, static_cast<std::size_t>(t.numel)), 2e-6)
        << t.spec.name;
  }
  for (float g : test::to_host<float>(slab.grad())) ASSERT_EQ(g, 0.0f) << "gradient not zeroed";
  EXPECT_EQ(muon.report().step, 4);
}

TEST(MuonCpu, StepsMatchTorchFormulasInDouble) {
  check_against_double(muon_config());
  auto plain = muon_config(1.0);  // clipping on, no Nesterov, Moonlight's adjustment
  plain.muon.nesterov = false;
  plain.muon.adjust_lr = optim::MuonAdjustLr::match_rms_adamw;
  check_against_double(plain);
}

TEST(MuonCpu, ShardsStepExactlyLikeOneRank) {
  std::mt19937_64 rng(test::fresh_seed());
  auto specs = muon_specs();
  specs.push_back({.name = "big", .shape = {96, 80}, .hidden_matrix = true});  // spans several shards
  const OptimizerConfig config = muon_config(1.0);
  for (int world : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    test::ShardedRunOf<optim::Muon> single(core::Device::cpu(), specs, 1, config);
    test::ShardedRunOf<optim::Muon> sharded(core::Device::cpu(), specs, world, config);
    const optim::SlabLayout layout(specs, world);
    const auto master = test::random_normal(rng, static_cast<std::size_t>(layout.total_elements()), 0.1f);
    const std::size_t n1 = static_cast<std::size_t>(single.slabs[0]->full().size());
    for (int step = 0; step < 3; ++step) {
      const auto g = test::random_grads(rng, layout, 0.1f);
      if (step == 0) {
        single.load(std::vector<float>(master.begin(), master.begin() + static_cast<std::ptrdiff_t>(n1)),
                    std::vector<float>(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(n1)));
        sharded.load(master, g);
      } else {
        test::from_host(single.slabs[0]->grad(),
                        std::vector<float>(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(n1)));
        for (auto& s : sharded.slabs) test::from_host(s->grad(), g);
      }
      single.step(config.lr);
      sharded.step(config.lr);
    }
    const auto a = single.master();
    const auto b = sharded.master();
    ASSERT_GE(b.size(), a.size());
    for (std::size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], b[i]) << "element " << i;
    std::vector<float> state;
    for (auto& o : sharded.opts) {
      const auto part = test::to_host<float>(o->exp_avg());
      state.insert(state.end(), part.begin(), part.end());
    }
    const auto one = test::to_host<float>(single.opts[0]->exp_avg());
    for (std::size_t i = 0; i < one.size(); ++i) ASSERT_EQ(one[i], state[i]) << "momentum of element " << i;
  }
}

TEST(MuonCpu, NonFinitePolicies) {
  std::mt19937_64 rng(test::fresh_seed());
  for (auto policy : {optim::NonFinitePolicy::skip_step, optim::NonFinitePolicy::zero_element}) {
    const auto config = muon_config(0.0, policy);
    const optim::SlabLayout layout(muon_specs(), 1);
    core::DeviceContext cpu(core::Device::cpu());
    optim::Slab slab(layout, cpu);
    optim::Muon muon(config, slab, cpu);
    const auto master = test::random_normal(rng, static_cast<std::size_t>(layout.total_elements()), 0.1f);
    test::from_host(slab.master(), master);
    auto g = test::random_grads(rng, layout, 0.1f);
    const std::int64_t poisoned = layout.tensor("wide").offset + 3;
    g[static_cast<std::size_t>(poisoned)] = NAN;
    test::from_host(slab.grad(), g);
    muon.step(config.lr);
    const auto after = test::to_host<float>(slab.master());
    for (float v : test::to_host<float>(slab.grad())) ASSERT_EQ(v, 0.0f);
    const auto report = muon.report();
    EXPECT_EQ(report.nonfinite, 1u);
    if (policy == optim::NonFinitePolicy::skip_step) {
      EXPECT_TRUE(report.skipped);
      EXPECT_EQ(report.step, 0);
      EXPECT_EQ(after, master);
      for (float m : test::to_host<float>(muon.exp_avg())) ASSERT_EQ(m, 0.0f);
    } else {
      // As a step with that element's gradient 0.
      optim::Slab clean_slab(layout, cpu);
      optim::Muon clean(config, clean_slab, cpu);
      test::from_host(clean_slab.master(), master);
      g[static_cast<std::size_t>(poisoned)] = 0.0f;
      test::from_host(clean_slab.grad(), g);
      clean.step(config.lr);
      EXPECT_FALSE(report.skipped);
      EXPECT_EQ(after, test::to_host<float>(clean_slab.master()));
    }
  }
}

}  // namespace
