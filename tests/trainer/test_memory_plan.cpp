// The memory plan (`trainer --plan`): per-rank bytes of each term against hand-computed values
// for the Qwen3-0.6B and 8B shapes, and the optimizers' planned state against what they allocate;
// Muon's working buffers and its Newton-Schulz load per rank.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "core/error.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "optim/optimizer.h"
#include "trainer/config.h"
#include "trainer/memory_plan.h"
#include "support/test_family.h"

namespace {

trainer::RunConfig config_for(const std::string& preset, const std::string& device, int stage,
                              const std::string& optimizer = "adamw", int seq_len = 2048) {
  const std::string yaml = "run:\n  output_dir: /nonexistent/out\ndevice: " + device + "\nmodel:\n  preset: " + preset +
                           "\ndata:\n  train: /nonexistent/train.bin\n  seq_len: " + std::to_string(seq_len) +
                           "\ntraining:\n  max_steps: 1\n"
                           "  precision: " +
                           (device == "cuda" ? "bf16" : "fp32") + "\noptimizer:\n  type: " + optimizer + "\n";
  trainer::RunConfig c = trainer::parse_run_config(yaml, "plan.yaml", {}, {.check_paths = false});
  c.parallel.zero_stage = stage;
  return c;
}

std::int64_t term(const trainer::MemoryPlan& plan, const std::string& name) {
  for (const trainer::MemoryTerm& t : plan.terms) {
    if (t.name == name) return t.bytes.value_or(-1);
  }
  ADD_FAILURE() << "no term " << name;
  return -2;
}

// Qwen3-8B: every tensor is a multiple of 64 elements and the total a multiple of 4 x 256, so
// P is the parameter count.
constexpr std::int64_t kP8b = 8190735360;

TEST(MemoryPlan, Qwen3_8bZero1OnFourGpus) {
  const trainer::RunConfig c = config_for("qwen3-8b", "cuda", 1);
  const trainer::MemoryPlan plan = trainer::plan_memory(c, *trainer::model_spec(c), 4);
  EXPECT_EQ(plan.parameters, kP8b);
  EXPECT_EQ(plan.slab_elements, kP8b);
  EXPECT_EQ(plan.tokens_per_step, 4 * 2048);
  EXPECT_EQ(term(plan, "weights"), 2 * kP8b + 4 * kP8b / 4);  // bf16 mirror + fp32 master shard
  EXPECT_EQ(term(plan, "gradients"), 4 * kP8b);
  EXPECT_EQ(term(plan, "optimizer state"), 8 * kP8b / 4);  // AdamW's two fp32 moments of the shard
  EXPECT_EQ(term(plan, "communication buffers"), 0);
  EXPECT_EQ(term(plan, "samples and evaluation"), 0);  // decoders read the whole mirror in place
  EXPECT_GT(term(plan, "activations"), 0);
  EXPECT_EQ(static_cast<std::size_t>(term(plan, "activations")), *trainer::model_spec(c)->cuda_activation_bytes(2048));
  EXPECT_NE(plan.table().find("optimizer state"), std::string::npos);
}

TEST(MemoryPlan, Qwen3_8bZero3OnFourGpus) {
  const trainer::RunConfig c = config_for("qwen3-8b", "cuda", 3);
  const trainer::MemoryPlan plan = trainer::plan_memory(c, *trainer::model_spec(c), 4);
  EXPECT_EQ(term(plan, "weights"), (2 + 4) * kP8b / 4);
  EXPECT_EQ(term(plan, "gradients"), 4 * kP8b / 4);  // one micro-batch per step: sharded
  EXPECT_EQ(term(plan, "optimizer state"), 8 * kP8b / 4);
  // Staging: two of the largest gradient range, a layer's MLP (post_norm 4096, gate_up
  // 2 x 12288 x 4096, down 4096 x 12288), and the held fp32 buffer of a vocabulary-sized tensor
  // (parallel.vocab_gradient: whole, the default); gathers: two bf16 buffers of the largest weight
  // range, the untied tail (final norm 4096 + lm_head 151936 x 4096).
  const std::int64_t mlp = 4096 + 2 * 12288 * 4096LL + 4096 * 12288LL;
  const std::int64_t vocab = 151936 * 4096LL;
  const std::int64_t tail = 4096 + vocab;
  EXPECT_EQ(term(plan, "communication buffers"), 2 * 4 * mlp + 4 * vocab + 2 * 2 * tail);
  trainer::RunConfig windows = c;
  windows.parallel.vocab_gradient = trainer::VocabGradient::windows;
  EXPECT_EQ(term(trainer::plan_memory(windows, *trainer::model_spec(windows), 4), "communication buffers"),
            2 * 4 * mlp + 2 * 2 * tail);
  EXPECT_EQ(trainer::held_gradient_elements(c, optim::SlabLayout(trainer::model_spec(c)->parameters(), 4), 4), vocab);
  EXPECT_EQ(trainer::held_gradient_elements(c, optim::SlabLayout(trainer::model_spec(c)->parameters(), 1), 1), 0);
  EXPECT_EQ(term(plan, "samples and evaluation"), 2 * kP8b);  // the whole bf16 mirror, gathered
  const trainer::RunConfig cpu = config_for("qwen3-8b", "cpu", 3);
  EXPECT_EQ(term(trainer::plan_memory(cpu, *trainer::model_spec(cpu), 4), "samples and evaluation"), 4 * kP8b);
}

TEST(MemoryPlan, Qwen3_06bOnTwoCpuRanks) {
  constexpr std::int64_t P = 596049920;  // a multiple of 2 x 256
  const trainer::RunConfig c = config_for("qwen3-0.6b", "cpu", 1);
  const trainer::MemoryPlan plan = trainer::plan_memory(c, *trainer::model_spec(c), 2);
  EXPECT_EQ(plan.parameters, P);
  EXPECT_EQ(term(plan, "weights"), 2 * P + 4 * P / 2 + 4 * P);  // + the whole fp32 copy the cpu model reads
  EXPECT_EQ(term(plan, "gradients"), 4 * P);                    // cpu: never sharded
  EXPECT_EQ(term(plan, "optimizer state"), 8 * P / 2);
  EXPECT_EQ(term(plan, "activations"), -1);  // not estimated on cpu
  const trainer::RunConfig zero0 = config_for("qwen3-0.6b", "cpu", 0);
  EXPECT_EQ(term(trainer::plan_memory(zero0, *trainer::model_spec(zero0), 2), "weights"), 2 * P + 4 * P);
}

TEST(MemoryPlan, RefusesWhatDoesNotFit) {
  const trainer::RunConfig c = config_for("qwen3-8b", "cuda", 1);
  const trainer::MemoryPlan plan = trainer::plan_memory(c, *trainer::model_spec(c), 1);
  EXPECT_NO_THROW(trainer::check_plan_fits(plan, plan.total_bytes(), 0));
  try {
    trainer::check_plan_fits(plan, 80LL << 30, 0);
    FAIL() << "expected a refusal";
  } catch (const core::InputError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("parallel.zero_stage"), std::string::npos) << message;
    EXPECT_NE(message.find("training.micro_batch_size"), std::string::npos) << message;
    EXPECT_EQ(message.find("parallel.vocab_gradient"), std::string::npos) << message;  // no such buffer at ZeRO-1
  }
  // With sharded gradients the held vocabulary buffer is one of the things to give up.
  const trainer::RunConfig z2 = config_for("qwen3-8b", "cuda", 2);
  const trainer::MemoryPlan sharded = trainer::plan_memory(z2, *trainer::model_spec(z2), 4);
  try {
    trainer::check_plan_fits(sharded, 10LL << 30, 0);
    FAIL() << "expected a refusal";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.vocab_gradient: windows"), std::string::npos) << e.what();
  }
}

TEST(MemoryPlan, PresetsOfTheLargerShapes) {
  const trainer::RunConfig c4 = config_for("qwen3-4b", "cuda", 1);
  EXPECT_EQ(trainer::model_spec(c4)->parameter_count(), 4022468096);  // tied
  EXPECT_EQ(trainer::model_spec(config_for("qwen3-8b", "cuda", 1))->parameter_count(), kP8b);
}

// The plan's optimizer state is what each optimizer allocates, for several shards of a small model.
TEST(MemoryPlan, OptimizerStateMatchesAllocation) {
  const core::DeviceContext cpu(core::Device::cpu());
  for (const std::string type : {"adamw", "adamw8bit", "adafactor"}) {
    for (int world : {1, 3}) {
      trainer::RunConfig c = config_for("qwen3-test", "cpu", 1, type, 64);
      const auto spec = trainer::model_spec(c);
      for (int rank = 0; rank < world; ++rank) {
        optim::Slab slab(optim::SlabLayout(spec->parameters(), world), cpu, {.rank = rank, .zero_stage = 1});
        const auto optimizer = optim::make_optimizer(c.optimizer, slab, cpu);
        std::int64_t allocated = 0;
        for (const optim::StateBuffer& b : optimizer->state_buffers())
          allocated += static_cast<std::int64_t>(b.buffer->bytes());
        EXPECT_EQ(optim::optimizer_state_bytes(c.optimizer, slab.layout(), slab.owned()), allocated)
            << type << " rank " << rank << " of " << world;
      }
    }
  }
}

// Qwen3-0.6B's hidden matrices per layer: q [2048, 1024], k and v [1024, 1024], o [1024, 2048],
// gate and up [3072, 1024], down [1024, 3072]: 15 x 2^20 elements, so the fp32 assembly buffer is
// 4 x 28 x 15 x 2^20 bytes on every rank. Newton-Schulz per iteration (4 r^2 c + 2 r^3 with
// r = 1024): q and o 10 x 2^30, k and v 6 x 2^30, gate, up and down 14 x 2^30: 74 x 2^30 a layer.
TEST(MemoryPlan, MuonCountsItsBuffersAndLoad) {
  constexpr std::int64_t kAssembly = 4LL * 28 * 15 * (1 << 20);
  const trainer::RunConfig c = config_for("qwen3-0.6b", "cuda", 1, "muon");
  const trainer::MemoryPlan plan = trainer::plan_memory(c, *trainer::model_spec(c), 4);
  ASSERT_TRUE(plan.muon.has_value());
  const optim::MuonLoad& load = *plan.muon;
  ASSERT_EQ(load.ranks.size(), 4u);
  EXPECT_EQ(load.flop, 5.0 * 28 * 74 * (1LL << 30));
  std::int64_t matrices = 0;
  for (const optim::MuonRankLoad& rank : load.ranks) {
    EXPECT_EQ(rank.assembly_bytes, kAssembly);
    matrices += rank.matrices;
  }
  EXPECT_GE(matrices, 7 * 28);           // each matrix at least once, split ones more often
  EXPECT_EQ(load.ranks[0].matrices, 0);  // the first shard holds only the 155M-element embedding
  EXPECT_EQ(load.ranks[0].newton_schulz_bytes, 0);
  EXPECT_GT(load.busiest_over_even(), 1.0);
  EXPECT_EQ(term(plan, "optimizer buffers"), load.largest_bytes(true));
  EXPECT_GT(load.largest_bytes(true), kAssembly);
  EXPECT_EQ(term(plan, "optimizer state"), 8 * plan.slab_elements / 4);
  EXPECT_NE(plan.table().find("busiest rank"), std::string::npos) << plan.table();
  const trainer::RunConfig cpu = config_for("qwen3-0.6b", "cpu", 1, "muon");
  EXPECT_EQ(term(trainer::plan_memory(cpu, *trainer::model_spec(cpu), 4), "optimizer buffers"), kAssembly);
  const trainer::MemoryPlan adamw =
      trainer::plan_memory(config_for("qwen3-0.6b", "cuda", 1), *trainer::model_spec(c), 4);
  EXPECT_FALSE(adamw.muon.has_value());
  for (const trainer::MemoryTerm& t : adamw.terms) EXPECT_NE(t.name, "optimizer buffers");
}

TEST(MemoryPlan, ZeroThreeNeedsLayerwiseWeights) {
  trainer::RunConfig c = config_for("qwen3-test", "cpu", 3, "adamw", 64);
  const models::Family& bigram = test::bigram_family();
  const auto whole = bigram.spec(models::base_shape(bigram, bigram.presets().front()));  // reads its weights whole
  try {
    trainer::check_zero_stage(c, *whole);
    FAIL() << "expected a refusal";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.zero_stage"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(trainer::check_zero_stage(c, *trainer::model_spec(c)));
  // E29a reads its weights layer by layer too: the embedding, each layer, the final norm.
  const models::Family& e29a = models::family("e29a");
  const auto spec = e29a.spec(models::base_shape(e29a, e29a.presets().front()));
  EXPECT_NO_THROW(trainer::check_zero_stage(c, *spec));
  const auto ranges = spec->weight_ranges(optim::SlabLayout(spec->parameters(), 1));
  ASSERT_GE(ranges.size(), 3u);
  for (std::size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].end, ranges[i].begin);
}

}  // namespace
