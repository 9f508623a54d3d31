#include "models/qwen3/megakernel_decoder.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/buffer.h"
#include "core/error.h"
#include "models/ops/sampling.h"
#include "models/qwen3/decode_megakernel_plan.h"
#include "models/qwen3/prefill_cuda.h"

namespace models::qwen3 {

namespace mk = megakernel;

namespace {

// Epochs restart (counters and tags zeroed) before the counters could overflow: the largest
// counter target is units * (epoch + 1) with at most a few hundred units of a phase.
constexpr std::uint32_t kEpochLimit = 1u << 20;

const char* kind_name(int kind) {
  switch (kind) {
    case -1: return "producer";
    case 0: return "qkv";
    case 1: return "attention";
    case 2: return "o_proj";
    case 3: return "gate_up";
    case 4: return "down";
    case 5: return "lm_head";
    case 6: return "argmax";
    default: return "?";
  }
}

const char* what_name(int what) {
  switch (what) {
    case mk::wait_counter: return "a phase counter";
    case mk::wait_tagged: return "a tagged activation";
    case mk::wait_page_full: return "a weight page to arrive";
    case mk::wait_page_empty: return "a free page";
    case mk::wait_cache: return "the cache appends";
    default: return "?";
  }
}

// Bytes of one layer's bf16 matrices (qkv, o_proj, gate_up, down): what a token streams per layer.
std::int64_t layer_weight_bytes(const Qwen3Config& c) {
  return 2 * ((c.qkv_size() + c.q_size()) * c.hidden_size + 3 * c.intermediate_size * c.hidden_size);
}

// Page size when the settings leave it open. With one page in flight a block streams about one
// page per copy latency: 32 KB where a token is bound by its chain of hand-offs (a layer's weights
// are a few hundred KB a block: Qwen3-0.6B), 48 KB where the weights bound it (Qwen3-1.7B, 0.76 MB
// a block); measured on an H100 (docs/megakernel.md). Never less than the longest row.
int default_page_bytes(const Qwen3Config& c, int blocks) {
  const int page = layer_weight_bytes(c) / std::max(1, blocks) > 512 * 1024 ? 48 * 1024 : 32 * 1024;
  const auto longest_row = static_cast<int>(2 * std::max({c.hidden_size, c.q_size(), c.intermediate_size}));
  return std::max(page, (longest_row + 1023) / 1024 * 1024);
}

}  // namespace

struct MegakernelDecoder::Impl {
  Qwen3Config c;
  optim::Slab& slab;
  const void* whole_mirror = nullptr;  // DecoderOptions::whole_mirror
  const core::DeviceContext& ctx;
  cudaStream_t stream;
  MegakernelSettings settings;
  mk::Params base;  // everything but the launch fields
  mk::Schedule schedule;
  std::int64_t capacity = 0, position = 0;
  std::uint32_t epoch = 0;  // tokens decoded since the state was zeroed
  bool has_logits = false;
  int threads = 0;

  core::Buffer cache;                        // k then v
  core::Buffer state;                        // activations, tagged words, counters, abort record (zeroed together)
  core::Buffer tables;                       // units, block starts, group counts, layer weights, rope, logits
  std::unique_ptr<Qwen3CudaPrefill> prompt;  // prefill()'s batched path
  core::Buffer argmax_workspace;             // the greedy id after a prefill (ops::sample_cuda)
  std::size_t state_bytes = 0;
  std::uint64_t* token_word = nullptr;
  float* logits = nullptr;
  std::int32_t* prompt_id = nullptr;  // that id

  Impl(const Qwen3Config& config, optim::Slab& s, const core::DeviceContext& context, MegakernelSettings st)
      : c(config), slab(s), ctx(context), stream(context.stream()), settings(st) {}

  const std::uint16_t* w(int tensor) {
    const auto* p = static_cast<const std::uint16_t*>(decoder_mirror_tensor(slab, whole_mirror, tensor));
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0)
      throw core::Error("MegakernelDecoder: a mirror tensor is not 16-byte aligned");
    return p;
  }

  void zero_state() {
    CUDA_CHECK(cudaMemsetAsync(state.data(), 0, state_bytes, stream));
    epoch = 0;
  }

  // The cache as the batched prompt path writes it: [layers, kv_heads, capacity, head_dim].
  KvCacheView cache_view() const {
    const std::int64_t hd = c.head_dim;
    return {reinterpret_cast<decode::bf16*>(base.k_cache),
            reinterpret_cast<decode::bf16*>(base.v_cache),
            c.num_kv_heads * capacity * hd,
            {hd, capacity * hd}};
  }

  void check_room(std::int64_t tokens) const { check_decoder_room(position, tokens, capacity); }
  void check_id(std::int32_t id) const { check_decoder_ids({&id, 1}, c.vocab_size); }

  // One launch of `tokens` tokens from the current position.
  void launch(mk::Params p, int tokens) {
    if (epoch + static_cast<std::uint32_t>(tokens) >= kEpochLimit) {
      // Zero the counters and tags (the argmax id stays in the token word, retagged for epoch 0).
      const std::size_t keep = reinterpret_cast<char*>(token_word) - static_cast<char*>(state.data());
      CUDA_CHECK(cudaMemsetAsync(state.data(), 0, keep, stream));
      CUDA_CHECK(cudaMemsetAsync(static_cast<char*>(state.data()) + keep + 128, 0, state_bytes - keep - 128, stream));
      mk::retag_token_word(token_word, stream);
      epoch = 0;
    }
    p.position = position;
    p.epoch = epoch;
    p.tokens = tokens;
    mk::launch_megakernel(p, stream);
    position += tokens;
    epoch += static_cast<std::uint32_t>(tokens);
    has_logits = true;
  }
};

MegakernelDecoder::MegakernelDecoder(const Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context,
                                     const DecoderOptions& options, MegakernelSettings settings)
    : impl_(std::make_unique<Impl>(config, slab, context, settings)) {
  Impl& m = *impl_;
  m.whole_mirror = options.whole_mirror;
  validate(config, "qwen3 megakernel decoder");
  if (!context.is_cuda() || !(slab.device() == context.device())) {
    throw core::Error("MegakernelDecoder: needs a cuda slab and context");
  }
  if (slab.mirror_dtype() != core::DType::bf16) throw core::Error("MegakernelDecoder: the slab's mirror must be bf16");
  int major = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, context.device().index));
  if (major < 9) throw core::InputError("qwen3 megakernel: needs compute capability 9.0 or later (Hopper)");
  if (options.max_tokens <= 0) {
    throw core::InputError("decoder: max_tokens (prompt + new tokens) must be positive, got " +
                           std::to_string(options.max_tokens));
  }
  if (config.head_dim != 64 && config.head_dim != 128) {
    throw core::InputError("qwen3 megakernel: head_dim " + std::to_string(config.head_dim) +
                           " not supported (64 or 128)");
  }
  const std::int64_t group = config.num_heads / config.num_kv_heads;
  if (group > mk::kMaxGroup) {
    throw core::InputError("qwen3 megakernel: " + std::to_string(group) + " query heads per kv head (at most " +
                           std::to_string(mk::kMaxGroup) + ")");
  }
  if (config.hidden_size % 8 != 0 || config.intermediate_size % 8 != 0) {
    throw core::InputError("qwen3 megakernel: hidden and intermediate sizes must be multiples of 8");
  }
  if (settings.max_prefill_chunk <= 0) throw core::InputError("qwen3 megakernel: max_prefill_chunk must be positive");

  mk::Dims d;
  d.hidden = static_cast<int>(config.hidden_size);
  d.q_size = static_cast<int>(config.q_size());
  d.kv_size = static_cast<int>(config.kv_size());
  d.qkv_size = static_cast<int>(config.qkv_size());
  d.ffn = static_cast<int>(config.intermediate_size);
  d.vocab = static_cast<int>(config.vocab_size);
  d.layers = static_cast<int>(config.num_layers);
  d.heads = static_cast<int>(config.num_heads);
  d.kv_heads = static_cast<int>(config.num_kv_heads);
  d.head_dim = static_cast<int>(config.head_dim);
  d.group = static_cast<int>(group);
  d.eps = static_cast<float>(config.rms_norm_eps);

  mk::Geometry g;
  g.blocks = settings.blocks > 0 ? settings.blocks : std::max(1, context.multiprocessor_count());
  g.consumer_warps = settings.consumer_warps;
  g.page_bytes = settings.page_bytes > 0 ? settings.page_bytes : default_page_bytes(config, g.blocks);
  g.max_splits = settings.max_splits;
  g.min_chunk = settings.min_chunk;
  g.inflight = settings.inflight_pages;
  const int max_smem = mk::megakernel_max_smem(d.head_dim, d.group);
  if (settings.pages > 0) {
    g.pages = settings.pages;
  } else {
    g.pages = 2;
    for (;;) {
      g.pages += 1;
      m.schedule = mk::build_schedule(d, g);
      if (mk::layout_smem(d, g, m.schedule).bytes > max_smem) {
        g.pages -= 1;
        break;
      }
    }
  }
  const std::string bad = mk::check_geometry(d, g);
  if (!bad.empty()) throw core::InputError("qwen3 megakernel: " + bad);
  m.schedule = mk::build_schedule(d, g);
  const mk::SmemLayout smem = mk::layout_smem(d, g, m.schedule);
  if (smem.bytes > max_smem) {
    throw core::InputError("qwen3 megakernel: " + std::to_string(smem.bytes) +
                           " bytes of shared memory per block (at most " + std::to_string(max_smem) + ")");
  }
  m.threads = 32 * (g.consumer_warps + 1);
  const int per_sm = mk::prepare_megakernel(d.head_dim, d.group, m.threads, smem.bytes);
  if (per_sm < 1 || g.blocks > per_sm * std::max(1, context.multiprocessor_count())) {
    throw core::InputError("qwen3 megakernel: " + std::to_string(g.blocks) + " blocks cannot all be resident (" +
                           std::to_string(per_sm) + " per multiprocessor)");
  }

  mk::Params& p = m.base;
  p.dims = d;
  p.geo = g;
  p.counter_index = {d.layers, d.kv_heads};
  p.qkv_units = m.schedule.qkv_units;
  p.o_units = m.schedule.o_units;
  p.gate_up_units = m.schedule.gate_up_units;
  p.down_units = m.schedule.down_units;
  p.lm_units = m.schedule.lm_units;
  p.attention_slots = m.schedule.attention_slots;
  p.smem_barriers = smem.barriers;
  p.smem_vec = smem.vec;
  p.vec_floats = smem.vec_floats;
  p.smem_small = smem.small;
  p.merge_floats = smem.merge_floats;
  p.smem_bytes = smem.bytes;
  p.evict_first = settings.evict_first ? 1 : 0;
  p.timeout_ns = static_cast<std::int64_t>(settings.timeout_seconds * 1e9);
  m.capacity = options.max_tokens;

  // Weights in the mirror.
  const Qwen3TensorIndex index(config, slab.layout(), "MegakernelDecoder");
  std::vector<mk::LayerWeights> layers;
  for (const Qwen3LayerTensors& t : index.layers) {
    layers.push_back({m.w(t.input_norm), m.w(t.qkv), m.w(t.q_norm), m.w(t.k_norm), m.w(t.o_proj), m.w(t.post_norm),
                      m.w(t.gate_up), m.w(t.down)});
  }
  p.embed = m.w(index.embed);
  p.head = m.w(index.head);
  p.final_norm = m.w(index.final_norm);

  // The cache.
  const auto cache_elements = static_cast<std::size_t>(config.num_layers * config.kv_size() * m.capacity);
  m.cache = core::Buffer(context.device(), 2 * cache_elements * 2);
  p.k_cache = m.cache.as<std::uint16_t>();
  p.v_cache = p.k_cache + cache_elements;
  p.capacity = m.capacity;

  // Zeroed state: activations, tagged words, counters, the abort record.
  std::size_t at = 0;
  auto reserve = [&](std::size_t bytes) {
    const std::size_t offset = at;
    at = (at + bytes + 127) / 128 * 128;
    return offset;
  };
  const std::size_t L = static_cast<std::size_t>(d.layers), hd = static_cast<std::size_t>(d.head_dim);
  const std::size_t x_at = reserve((L + 1) * d.hidden * 2);
  const std::size_t x_mid_at = reserve(L * d.hidden * 2);
  const std::size_t qkv_at = reserve(L * d.qkv_size * 2);
  const std::size_t part_at = reserve(L * g.max_splits * d.heads * (hd + 2) * 4);
  const std::size_t att_at = reserve(L * d.q_size * 2);
  const std::size_t base_at = reserve(L * d.kv_heads * 8);
  const std::size_t act_at = reserve(L * d.ffn * 2);
  const std::size_t lm_at = reserve(2 * static_cast<std::size_t>(p.lm_units) * 8);
  const std::size_t counters_at = reserve(static_cast<std::size_t>(p.counter_index.count()) * mk::kCounterStride * 4);
  const std::size_t abort_at = reserve(sizeof(mk::AbortRecord));
  const std::size_t token_at = reserve(128);  // last: kept when epochs restart
  m.state_bytes = at;
  m.state = core::Buffer(context.device(), m.state_bytes);
  char* base = static_cast<char*>(m.state.data());
  p.x = reinterpret_cast<std::uint16_t*>(base + x_at);
  p.x_mid = reinterpret_cast<std::uint16_t*>(base + x_mid_at);
  p.qkv = reinterpret_cast<std::uint16_t*>(base + qkv_at);
  p.part = reinterpret_cast<float*>(base + part_at);
  p.att = reinterpret_cast<std::uint16_t*>(base + att_at);
  p.base = reinterpret_cast<std::uint64_t*>(base + base_at);
  p.act = reinterpret_cast<std::uint16_t*>(base + act_at);
  p.lm_part = reinterpret_cast<std::uint64_t*>(base + lm_at);
  p.counters = reinterpret_cast<std::uint32_t*>(base + counters_at);
  p.abort = reinterpret_cast<mk::AbortRecord*>(base + abort_at);
  p.token = reinterpret_cast<std::uint64_t*>(base + token_at);
  m.token_word = p.token;

  // Tables: units, block starts, group counts, layer weights, rope, logits.
  at = 0;
  const std::size_t units_at = reserve(m.schedule.units.size() * sizeof(mk::Unit));
  const std::size_t begin_at = reserve(m.schedule.block_begin.size() * 4);
  const std::size_t groups_at = reserve(m.schedule.group_counts.size() * 4);
  const std::size_t layers_at = reserve(layers.size() * sizeof(mk::LayerWeights));
  const std::size_t rope_at = reserve(static_cast<std::size_t>(m.capacity) * hd * 4);
  const std::size_t logits_at = reserve(static_cast<std::size_t>(d.vocab) * 4);
  const std::size_t prompt_id_at = reserve(4);
  m.tables = core::Buffer(context.device(), at);
  char* t = static_cast<char*>(m.tables.data());
  std::vector<char> host(rope_at);
  std::memcpy(host.data() + units_at, m.schedule.units.data(), m.schedule.units.size() * sizeof(mk::Unit));
  std::memcpy(host.data() + begin_at, m.schedule.block_begin.data(), m.schedule.block_begin.size() * 4);
  std::memcpy(host.data() + groups_at, m.schedule.group_counts.data(), m.schedule.group_counts.size() * 4);
  std::memcpy(host.data() + layers_at, layers.data(), layers.size() * sizeof(mk::LayerWeights));
  core::copy_bytes(t, host.data(), host.size(), m.stream);
  p.units = reinterpret_cast<const mk::Unit*>(t + units_at);
  p.block_begin = reinterpret_cast<const std::int32_t*>(t + begin_at);
  p.group_counts = reinterpret_cast<const std::int32_t*>(t + groups_at);
  p.layers = reinterpret_cast<const mk::LayerWeights*>(t + layers_at);
  float* rope = reinterpret_cast<float*>(t + rope_at);
  mk::fill_rope_table(rope, m.capacity, d.head_dim, config.rope_theta, m.stream);
  p.rope = rope;
  m.logits = reinterpret_cast<float*>(t + logits_at);
  m.prompt_id = reinterpret_cast<std::int32_t*>(t + prompt_id_at);
  m.argmax_workspace = core::Buffer(context.device(), ops::sample_cuda_workspace_bytes(config.vocab_size));
  CUDA_CHECK(cudaMemsetAsync(m.logits, 0, static_cast<std::size_t>(d.vocab) * 4, m.stream));
  m.prompt = std::make_unique<Qwen3CudaPrefill>(
      config, slab, context, std::min(m.capacity, settings.max_prefill_chunk),
      decode::default_attention_splits(context.multiprocessor_count(), config.num_kv_heads), options.whole_mirror);
  m.zero_state();
  context.synchronize();  // the host tables are pageable sources
}

MegakernelDecoder::~MegakernelDecoder() = default;

void MegakernelDecoder::reset() {
  Impl& m = *impl_;
  m.position = 0;
  m.has_logits = false;
  m.zero_state();
}

void MegakernelDecoder::append(const std::int32_t* device_ids, std::int64_t count, float* all_logits) {
  Impl& m = *impl_;
  if (count <= 0) throw core::InputError("decoder: prefill needs at least one token");
  m.check_room(count);
  mk::Params p = m.base;
  p.ids = device_ids;
  p.greedy = 0;
  if (all_logits != nullptr) {
    p.logits = all_logits;
    p.logits_first = 0;
    p.logits_stride = m.c.vocab_size;
  } else {
    p.logits = m.logits;
    p.logits_first = static_cast<int>(count - 1);
    p.logits_stride = 0;
  }
  m.launch(p, static_cast<int>(count));
  if (all_logits != nullptr) {
    CUDA_CHECK(cudaMemcpyAsync(m.logits, all_logits + (count - 1) * m.c.vocab_size,
                               static_cast<std::size_t>(m.c.vocab_size) * 4, cudaMemcpyDeviceToDevice, m.stream));
  }
}

void MegakernelDecoder::prefill(std::span<const std::int32_t> tokens, float* all_logits) {
  Impl& m = *impl_;
  if (tokens.empty()) throw core::InputError("decoder: prefill needs at least one token");
  check_decoder_prompt(tokens, m.position, m.capacity, m.c.vocab_size);
  m.prompt->run(tokens, m.position, m.cache_view(), m.logits, all_logits);
  // The kernel's next token reads the cache rows written here (a launch later) and, when greedy,
  // its id from the token word, which carries the tag of that token's epoch.
  ops::sample_cuda(m.logits, m.c.vocab_size, {}, 0.0f, m.prompt_id, m.argmax_workspace.data(),
                   m.argmax_workspace.bytes(), m.stream);
  mk::set_token_word(m.token_word, m.prompt_id, m.epoch, m.stream);
  m.position += static_cast<std::int64_t>(tokens.size());
  m.has_logits = true;
}

void MegakernelDecoder::step(std::int32_t token, const std::int32_t* device_token) {
  Impl& m = *impl_;
  m.check_room(1);
  mk::Params p = m.base;
  if (device_token == nullptr) {
    m.check_id(token);
    p.host_id = token;
  }
  p.ids = device_token;  // out-of-vocabulary device ids are read as 0
  p.greedy = 0;
  p.logits = m.logits;
  p.logits_first = 0;
  m.launch(p, 1);
}

bool MegakernelDecoder::append_greedy(std::int64_t count, std::int32_t* ids_out) {
  greedy(count, ids_out);
  check();
  return true;
}

void MegakernelDecoder::greedy(std::int64_t count, std::int32_t* ids_out) {
  Impl& m = *impl_;
  if (count <= 0) return;
  if (!m.has_logits) throw core::InputError("decoder: greedy() needs logits first (prefill or step)");
  m.check_room(count);
  mk::Params p = m.base;
  p.greedy = 1;
  p.ids_out = ids_out;
  p.logits = m.logits;
  p.logits_first = static_cast<int>(count - 1);
  m.launch(p, static_cast<int>(count));
}

namespace {

// Raw unit marks of tokens [2, 10) of a profile (fewer when it is shorter), one unit a line.
void write_unit_trace(const std::string& path, const std::vector<std::uint64_t>& host, std::int64_t count,
                      const mk::Schedule& schedule) {
  constexpr int kWords = mk::kTraceWords;
  const std::vector<mk::Unit>& units = schedule.units;
  std::vector<int> block_of(units.size());
  for (std::size_t b = 0; b + 1 < schedule.block_begin.size(); ++b) {
    for (int i = schedule.block_begin[b]; i < schedule.block_begin[b + 1]; ++i) {
      block_of[static_cast<std::size_t>(i)] = static_cast<int>(b);
    }
  }
  std::ofstream out(path);
  if (!out) throw core::InputError("decoder: cannot write the unit trace to '" + path + "'");
  out << "# token unit block kind layer a b, then " << kWords
      << " trace words (ns: start, marks 1-6, end; ns waiting for pages)\n";
  const std::int64_t first = std::min<std::int64_t>(2, count - 1), end = std::min<std::int64_t>(count, first + 8);
  for (std::int64_t t = first; t < end; ++t) {
    const std::uint64_t* row = host.data() + static_cast<std::size_t>(t) * units.size() * kWords;
    for (std::size_t i = 0; i < units.size(); ++i) {
      const mk::Unit& u = units[i];
      out << t << ' ' << i << ' ' << block_of[i] << ' ' << static_cast<int>(u.kind) << ' ' << u.layer << ' ' << u.a
          << ' ' << u.b;
      for (int k = 0; k < kWords; ++k) out << ' ' << row[kWords * i + static_cast<std::size_t>(k)];
      out << '\n';
    }
  }
  if (!out) throw core::InputError("decoder: writing the unit trace to '" + path + "' failed");
}

}  // namespace

std::string MegakernelDecoder::profile_greedy(std::int64_t count, const std::string& trace_path) {
  Impl& m = *impl_;
  if (count <= 0) return {};
  if (!m.has_logits) throw core::InputError("decoder: profile_greedy() needs logits first (prefill or step)");
  m.check_room(count);
  constexpr int kWords = mk::kTraceWords;
  const std::vector<mk::Unit>& units = m.schedule.units;
  const std::size_t words = static_cast<std::size_t>(count) * units.size() * kWords;
  core::Buffer trace(m.ctx.device(), words * 8);
  CUDA_CHECK(cudaMemsetAsync(trace.data(), 0, words * 8, m.stream));
  mk::Params p = m.base;
  p.greedy = 1;
  p.logits = m.logits;
  p.logits_first = static_cast<int>(count - 1);
  p.trace = trace.as<std::uint64_t>();
  m.launch(p, static_cast<int>(count));
  check();
  std::vector<std::uint64_t> host(words);
  CUDA_CHECK(cudaMemcpy(host.data(), trace.data(), words * 8, cudaMemcpyDeviceToHost));

  if (!trace_path.empty()) write_unit_trace(trace_path, host, count, m.schedule);
  // Phases in chain order per token: qkv, attention, o_proj, gate_up, down per layer, then lm_head
  // and argmax; each phase's inputs are complete when the one before it has ended.
  const int layers = static_cast<int>(m.c.num_layers), kinds = 7;
  const int phases = layers * 5 + 2;
  auto phase_of = [&](const mk::Unit& u) {
    const int k = static_cast<int>(u.kind);
    return k <= static_cast<int>(mk::UnitKind::down) ? u.layer * 5 + k : layers * 5 + (k - 5);
  };
  auto kind_of_phase = [&](int ph) { return ph < layers * 5 ? ph % 5 : 5 + (ph - layers * 5); };
  std::vector<double> added(kinds, 0.0), median_after(kinds, 0.0), slowest_after(kinds, 0.0);
  std::vector<int> samples(kinds, 0), marked(kinds, 0);
  std::vector<double> page_waits(kinds, 0.0);            // summed over active units
  std::vector<std::array<double, kWords>> steps(kinds);  // mean time between consecutive marks
  for (auto& row : steps) row.fill(0.0);
  double token_ns = 0.0;
  const std::int64_t skip = std::min<std::int64_t>(2, count - 1);  // the first tokens warm up
  for (std::int64_t t = skip; t < count; ++t) {
    const std::uint64_t* row = host.data() + static_cast<std::size_t>(t) * units.size() * kWords;
    std::vector<std::uint64_t> end_max(static_cast<std::size_t>(phases), 0);
    std::vector<std::uint64_t> start_min(static_cast<std::size_t>(phases), ~0ull);
    for (std::size_t i = 0; i < units.size(); ++i) {
      const auto ph = static_cast<std::size_t>(phase_of(units[i]));
      end_max[ph] = std::max(end_max[ph], row[kWords * i + mk::kTraceEnd]);
      start_min[ph] = std::min(start_min[ph], row[kWords * i]);
    }
    std::vector<std::vector<double>> after(static_cast<std::size_t>(phases));
    for (std::size_t i = 0; i < units.size(); ++i) {
      const int ph = phase_of(units[i]);
      const std::uint64_t* w = row + kWords * i;
      const std::uint64_t ready = ph == 0 ? start_min[0] : end_max[static_cast<std::size_t>(ph - 1)];
      const std::uint64_t end = w[mk::kTraceEnd], begun = std::min(std::max(ready, w[0]), end);
      after[static_cast<std::size_t>(ph)].push_back(static_cast<double>(end - begun));
      // Units that set mark 1 (active ones): the time between consecutive marks they set.
      if (w[1] == 0) continue;
      auto& st = steps[static_cast<std::size_t>(kind_of_phase(ph))];
      std::uint64_t last = w[0];
      page_waits[static_cast<std::size_t>(kind_of_phase(ph))] += static_cast<double>(w[kWords - 1]);
      for (int k = 1; k <= mk::kTraceEnd; ++k) {
        if (w[k] == 0) continue;
        st[static_cast<std::size_t>(k)] += static_cast<double>(w[k] - std::min(last, w[k]));
        last = w[k];
      }
      ++marked[static_cast<std::size_t>(kind_of_phase(ph))];
    }
    for (int ph = 0; ph < phases; ++ph) {
      auto& a = after[static_cast<std::size_t>(ph)];
      if (a.empty()) continue;
      const auto kind = static_cast<std::size_t>(kind_of_phase(ph));
      std::sort(a.begin(), a.end());
      const std::uint64_t previous = ph == 0 ? start_min[0] : end_max[static_cast<std::size_t>(ph - 1)];
      added[kind] += static_cast<double>(end_max[static_cast<std::size_t>(ph)] - previous);
      median_after[kind] += a[a.size() / 2];
      slowest_after[kind] += a.back();
      ++samples[kind];
    }
    token_ns += static_cast<double>(end_max[static_cast<std::size_t>(phases - 1)] - start_min[0]);
  }
  const double tokens = static_cast<double>(count - skip);
  char line[320];
  std::snprintf(
      line, sizeof(line),
      "per token %.1f us over %lld tokens. Per phase kind (us): time added to the token's path, median / "
      "slowest unit once its inputs were complete; active units' mean time between marks 0>1>...>end | mean wait for pages\n",
      token_ns / tokens / 1000.0, static_cast<long long>(tokens));
  std::string out = line;
  for (int k = 0; k < kinds; ++k) {
    const auto i = static_cast<std::size_t>(k);
    if (samples[i] == 0) continue;
    const double n = samples[i];
    std::snprintf(line, sizeof(line), "  %-9s x%-3d %7.2f  %6.2f / %6.2f  |", kind_name(k),
                  static_cast<int>(n / tokens + 0.5), added[i] / n / 1000.0, median_after[i] / n / 1000.0,
                  slowest_after[i] / n / 1000.0);
    out += line;
    if (marked[i] > 0) {
      for (int w = 1; w <= mk::kTraceEnd; ++w) {
        std::snprintf(line, sizeof(line), " %5.2f", steps[i][static_cast<std::size_t>(w)] / marked[i] / 1000.0);
        out += line;
      }
      std::snprintf(line, sizeof(line), " | pages %5.2f", page_waits[i] / marked[i] / 1000.0);
      out += line;
    }
    out += "\n";
  }
  return out;
}

void MegakernelDecoder::check() const {
  const Impl& m = *impl_;
  mk::AbortRecord record;
  CUDA_CHECK(cudaMemcpyAsync(&record, m.base.abort, sizeof(record), cudaMemcpyDeviceToHost, m.stream));
  CUDA_CHECK(cudaStreamSynchronize(m.stream));
  if (record.flag == 0) return;
  char text[320];
  std::snprintf(text, sizeof(text),
                "decode megakernel: block %d (%s unit, layer %d, token %d of its launch) waited %.3g s for %s "
                "(wanted %u, saw %u); the decoder must be reset",
                record.block, kind_name(record.kind), record.layer, record.token, m.settings.timeout_seconds,
                what_name(record.what), record.want, record.seen);
  throw core::Error(text);
}

void MegakernelDecoder::fake_context(std::int64_t position, std::uint64_t seed) {
  Impl& m = *impl_;
  if (position < 0 || position >= m.capacity) throw core::InputError("fake_context: position outside the cache");
  const std::size_t per_layer_head = static_cast<std::size_t>(m.capacity * m.c.head_dim);
  const std::size_t n = static_cast<std::size_t>(position * m.c.head_dim);
  for (std::int64_t row = 0; row < 2 * m.c.num_layers * m.c.num_kv_heads; ++row) {
    mk::fill_bf16_normal(m.cache.as<std::uint16_t>() + row * per_layer_head, static_cast<std::int64_t>(n),
                         seed + static_cast<std::uint64_t>(row), 1.0f, m.stream);
  }
  m.position = position;
}

void MegakernelDecoder::stall_next_launch() {
  Impl& m = *impl_;
  const std::uint64_t bogus = 0xfffffff0ull << 32;  // a tag no token of this launch carries
  CUDA_CHECK(cudaMemcpyAsync(m.token_word, &bogus, 8, cudaMemcpyHostToDevice, m.stream));
  CUDA_CHECK(cudaStreamSynchronize(m.stream));
}

const float* MegakernelDecoder::logits() const { return impl_->logits; }
std::int64_t MegakernelDecoder::position() const { return impl_->position; }
std::int64_t MegakernelDecoder::capacity() const { return impl_->capacity; }
std::size_t MegakernelDecoder::cache_bytes() const { return impl_->cache.bytes(); }
std::size_t MegakernelDecoder::scratch_bytes() const {
  return impl_->state.bytes() + impl_->tables.bytes() + impl_->prompt->scratch_bytes();
}
int MegakernelDecoder::blocks() const { return impl_->base.geo.blocks; }

std::size_t MegakernelDecoder::weight_bytes_per_token() const {
  const Qwen3Config& c = impl_->c;
  return static_cast<std::size_t>(c.num_layers * layer_weight_bytes(c) + 2 * c.vocab_size * c.hidden_size);
}

std::size_t MegakernelDecoder::cache_bytes_read(std::int64_t position) const {
  const Qwen3Config& c = impl_->c;
  return 2 * 2 * static_cast<std::size_t>(c.num_layers * c.kv_size() * position);
}

std::string MegakernelDecoder::describe() const {
  const mk::Geometry& g = impl_->base.geo;
  return std::to_string(g.blocks) + " blocks x " + std::to_string(g.consumer_warps) + "+1 warps, " +
         std::to_string(g.pages) + " pages x " + std::to_string(g.page_bytes / 1024) + " KB (" +
         (g.inflight > 0 ? std::to_string(g.inflight) : std::string("all")) + " in flight), splits " +
         std::to_string(g.max_splits) + ", min chunk " + std::to_string(g.min_chunk);
}

}  // namespace models::qwen3
