// The per-rank memory plan of a run (memory_plan.h).
#include "trainer/memory_plan.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "optim/optimizer.h"
#include "optim/slab.h"

namespace trainer {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::int64_t largest(const std::vector<optim::Range>& ranges) {
  std::int64_t n = 0;
  for (const optim::Range& r : ranges) n = std::max(n, r.size());
  return n;
}

std::string gib(std::int64_t bytes) { return fmt::format("{:.2f}", static_cast<double>(bytes) / kGiB); }

// Muon's Newton-Schulz work per rank: the matrices its shard touches (optim/muon_load.h).
std::string muon_table(const optim::MuonLoad& load, bool cuda) {
  const double even = load.flop / static_cast<double>(load.ranks.size());
  std::string out =
      fmt::format("muon: Newton-Schulz ({} iterations) of the matrices each rank's shard touches\n", load.ns_steps);
  out += fmt::format("{:<6} {:>9} {:>12} {:>9} {:>14}\n", "rank", "matrices", "TFLOP/step", "of even",
                     cuda ? "buffers GiB" : "assembly GiB");
  for (std::size_t r = 0; r < load.ranks.size(); ++r) {
    const optim::MuonRankLoad& rank = load.ranks[r];
    out += fmt::format("{:<6} {:>9} {:>12.4f} {:>8.2f}x {:>14}\n", r, rank.matrices, rank.flop / 1e12,
                       even > 0 ? rank.flop / even : 1.0, gib(rank.bytes(cuda)));
  }
  out += fmt::format(
      "busiest rank {:.2f}x an even split ({:.4f} TFLOP / {}); redundant work {:.1f}% (matrices split "
      "between ranks)\n",
      load.busiest_over_even(), load.flop / 1e12, load.ranks.size(), 100.0 * load.redundant());
  return out;
}

}  // namespace

bool shards_gradients(const RunConfig& config, int world) {
  return config.device == Device::cuda && config.parallel.zero_stage >= 2 && world > 1 &&
         accumulation_steps(config, world) == 1;
}

std::int64_t held_gradient_elements(const RunConfig& config, const optim::SlabLayout& layout, int world) {
  if (!shards_gradients(config, world) || config.parallel.vocab_gradient != VocabGradient::whole) return 0;
  std::int64_t largest = 0;
  for (const optim::SlabTensor& t : layout.tensors()) largest = std::max(largest, t.range().size());
  return largest;
}

void check_zero_stage(const RunConfig& config, const models::ModelSpec& spec) {
  if (config.parallel.zero_stage != 3) return;
  if (!spec.consumes_weights_by_layer() || spec.weight_ranges(optim::SlabLayout(spec.parameters(), 1)).empty()) {
    throw core::InputError("parallel.zero_stage: 3 needs a model that reads its weights layer by layer; " +
                           spec.family() +
                           " reads them whole (ZeRO-3 supports qwen3 and e29a; use zero_stage 0, 1 or 2)");
  }
}

std::int64_t MemoryPlan::total_bytes() const {
  std::int64_t total = 0;
  for (const MemoryTerm& t : terms) total += t.bytes.value_or(0);
  return total;
}

MemoryPlan plan_memory(const RunConfig& config, const models::ModelSpec& spec, int world) {
  check_zero_stage(config, spec);
  const int stage = config.parallel.zero_stage;
  const bool cuda = config.device == Device::cuda;
  const optim::SlabLayout layout(spec.parameters(), world);
  const bool shard_grads = shards_gradients(config, world);
  const optim::SlabCoverage cover =
      optim::slab_coverage(layout, {.rank = 0, .zero_stage = stage, .shard_gradients = shard_grads});

  MemoryPlan plan;
  plan.model = config.model.preset.empty() ? config.model.arch : config.model.preset;
  plan.cuda = cuda;
  plan.world = world;
  plan.zero_stage = stage;
  plan.optimizer = config.optimizer.type;
  plan.parameters = spec.parameter_count();
  plan.slab_elements = layout.total_elements();
  plan.micro_tokens = config.training.micro_batch_size * config.data.seq_len;
  plan.accumulation = accumulation_steps(config, world);
  plan.tokens_per_step = global_batch_sequences(config, world) * config.data.seq_len;

  const std::int64_t P = layout.total_elements();
  const bool sharded_weights = stage >= 1 && world > 1;
  // The cpu model reads fp32 weights: the whole-model copy up to ZeRO-2 (trainer/gradient_sync.h).
  const bool cpu_full_copy = !cuda && sharded_weights && stage < 3;
  const std::int64_t weights = 2 * cover.mirror.size() + 4 * cover.owned.size() + (cpu_full_copy ? 4 * P : 0);
  plan.terms.push_back({"weights", weights,
                        std::string(stage >= 3 ? "2S mirror" : "2P mirror") +
                            (stage >= 1 ? " + 4S master" : " + 4P master") + (cpu_full_copy ? " + 4P cpu copy" : "")});
  plan.terms.push_back({"gradients", 4 * cover.grad.size(), shard_grads ? "4S" : "4P"});
  plan.terms.push_back({"optimizer state", optim::optimizer_state_bytes(config.optimizer, layout, cover.owned),
                        config.optimizer.type + " over " + (stage >= 1 ? "S" : "P")});
  if (config.optimizer.type == "muon") {
    plan.muon = optim::muon_load(layout, stage, config.optimizer.muon.ns_steps);
    plan.terms.push_back({"optimizer buffers", plan.muon->largest_bytes(cuda),
                          cuda ? "muon: assembly 4M + bf16 Newton-Schulz, busiest rank" : "muon: assembly 4M"});
  }

  std::int64_t comm = 0;
  std::string comm_formula;
  const std::vector<optim::Range> ranges = spec.weight_ranges(layout);
  if (shard_grads) {
    const std::int64_t R = spec.largest_gradient_range(layout);
    comm += 2 * 4 * (R > 0 ? R : largest(ranges));
    comm_formula = "staging 2 x 4R";
    if (const std::int64_t held = held_gradient_elements(config, layout, world); held > 0) {
      comm += 4 * held;
      comm_formula += " + vocabulary 4Vd";
      plan.vocab_buffer = true;
    }
  }
  if (stage >= 3) {
    comm += 2 * (cuda ? 2 : 4) * largest(ranges);
    comm_formula += std::string(comm_formula.empty() ? "" : " + ") + (cuda ? "gather 2 x 2G" : "gather 2 x 4G");
  }
  plan.terms.push_back({"communication buffers", comm, comm_formula.empty() ? "none" : comm_formula});

  std::optional<std::int64_t> activations;
  if (cuda) {
    if (const auto bytes = spec.cuda_activation_bytes(plan.micro_tokens))
      activations = static_cast<std::int64_t>(*bytes);
  }
  plan.terms.push_back(
      {"activations", activations,
       activations ? "micro_batch_size x seq_len tokens" : "not estimated for this family or backend"});
  // ZeRO-3 gathers the whole model for samples and task evaluation (trainer/weight_gather.h) on top
  // of everything above; every run ends with a sample, so it is part of every run's peak.
  const std::int64_t whole = stage >= 3 ? (cuda ? 2 : 4) * P : 0;
  plan.terms.push_back({"samples and evaluation", whole,
                        stage < 3 ? "none: decoders read the weights in place"
                        : cuda    ? "the whole mirror gathered, 2P"
                                  : "the whole fp32 model gathered, 4P"});
  return plan;
}

std::string MemoryPlan::table() const {
  std::string out;
  out += fmt::format("model {}: {} parameters, slab of P = {} elements\n", model, parameters, slab_elements);
  out += fmt::format("{} rank(s) N = {} on {}, ZeRO-{}, optimizer {}, shard S = P / N = {} elements\n", world, world,
                     cuda ? "cuda" : "cpu", zero_stage, optimizer, slab_elements / world);
  out += fmt::format("tokens per step {} ({} tokens per micro-batch x {} accumulation x {} ranks)\n", tokens_per_step,
                     micro_tokens, accumulation, world);
  out += fmt::format("{:<22} {:>16} {:>9}  {}\n", "per rank", "bytes", "GiB", "formula");
  for (const MemoryTerm& t : terms) {
    out += t.bytes ? fmt::format("{:<22} {:>16} {:>9}  {}\n", t.name, *t.bytes, gib(*t.bytes), t.formula)
                   : fmt::format("{:<22} {:>16} {:>9}  {}\n", t.name, "-", "-", t.formula);
  }
  out += fmt::format("{:<22} {:>16} {:>9}\n", "total", total_bytes(), gib(total_bytes()));
  if (muon) out += muon_table(*muon, cuda);
  return out;
}

void check_plan_fits(const MemoryPlan& plan, std::int64_t free_bytes, int gpu) {
  const std::int64_t need = plan.total_bytes();
  if (need <= free_bytes) return;
  std::string change;
  if (plan.zero_stage < 3) change += fmt::format("a higher parallel.zero_stage (now {}), ", plan.zero_stage);
  change +=
      "more ranks, a smaller training.micro_batch_size or data.seq_len, model.recompute: full, or optimizer.type: "
      "adamw8bit";
  if (plan.vocab_buffer) change += ", or parallel.vocab_gradient: windows";
  throw core::InputError(fmt::format(
      "the memory plan needs {} GiB per GPU but GPU {} has {} GiB free (trainer --plan CONFIG --world {} shows the "
      "terms); try {}",
      gib(need), gpu, gib(free_bytes), plan.world, change));
}

}  // namespace trainer
