// The plan of the Qwen3 decode megakernel, shared by the host (which builds it) and the device
// (which runs it): the work units, how a unit's weights or KV-cache rows are cut into shared-memory
// pages, how attention is split over the sequence, the counters, and the kernel's parameters.
// Page cuts and chunking are __host__ __device__ functions, so the producer warp, the consumer
// warps and the CPU tests all derive the same page sequence from one definition.
// docs/megakernel.md describes the design.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#if defined(__CUDACC__)
#define MK_HD __host__ __device__
#else
#define MK_HD
#endif

namespace models::qwen3::megakernel {

constexpr int kMaxConsumerWarps = 11;  // with the producer, 12 warps: 3 per SM sub-partition, 168 registers each
constexpr int kMaxGroup = 8;           // query heads per kv head

// The phases of one token, in dependency order. A unit of a phase reads only what units of
// earlier phases (of this token or an earlier one) wrote.
enum class UnitKind : std::uint8_t { qkv, attention, o_proj, gate_up, down, lm_head, argmax };

// One unit of work. Matrix units own rows [a, b) of their layer's matrix (gate_up: act rows, each
// a gate row and its up row). Attention units own kv head a and chunk slot b of the sequence.
struct Unit {
  UnitKind kind = UnitKind::qkv;
  std::uint8_t reserved = 0;
  std::uint16_t layer = 0;  // lm_head and argmax: the number of layers
  std::int32_t a = 0;
  std::int32_t b = 0;
  std::int32_t index = 0;  // position among its phase's units (lm_head: its partial's slot)
};

// Model shape as the kernel sees it.
struct Dims {
  int hidden = 0, q_size = 0, kv_size = 0, qkv_size = 0, ffn = 0, vocab = 0, layers = 0;
  int heads = 0, kv_heads = 0, head_dim = 0, group = 0;  // group: query heads per kv head
  float eps = 0.0f;
};

// How the kernel is laid over the GPU.
struct Geometry {
  int blocks = 0;          // persistent blocks, one per SM, all co-resident
  int consumer_warps = 0;  // warps computing; one more warp streams pages
  int page_bytes = 0;      // shared-memory page
  int pages = 0;           // pages in the ring
  int max_splits = 0;      // attention chunks per kv head, at most (the chunk slots)
  int min_chunk = 0;       // positions per attention chunk, at least (rounded up to whole pages)
  int inflight = 0;        // pages a producer has in flight at most (0: the whole ring)
};

// Elements of one row of a matrix unit (its dot-product length).
MK_HD inline int row_length(UnitKind kind, const Dims& d) {
  switch (kind) {
    case UnitKind::o_proj: return d.q_size;
    case UnitKind::down: return d.ffn;
    default: return d.hidden;  // qkv, gate_up, lm_head
  }
}

// Bytes one row of a matrix unit takes in a page (gate_up: the gate row and the up row).
MK_HD inline int row_bytes(UnitKind kind, const Dims& d) {
  return row_length(kind, d) * 2 * (kind == UnitKind::gate_up ? 2 : 1);
}

// A page of an attention unit holds K rows in its first half and V rows in its second.
MK_HD inline int positions_per_page(const Geometry& g, const Dims& d) { return g.page_bytes / (4 * d.head_dim); }

// Attention over positions [0, position] is cut into `splits` chunks of `length` positions (whole
// pages); chunk c covers [c * length, min((c + 1) * length, position + 1)). Short contexts take
// one chunk (no merge work); long ones up to max_splits, so that all SMs stream the cache.
struct Chunking {
  std::int64_t length = 0;
  int splits = 0;
};

MK_HD inline Chunking attention_chunking(std::int64_t position, const Geometry& g, const Dims& d) {
  const std::int64_t n = position + 1;
  const std::int64_t per_page = positions_per_page(g, d);
  std::int64_t length = (n + g.max_splits - 1) / g.max_splits;
  if (length < g.min_chunk) length = g.min_chunk;
  length = (length + per_page - 1) / per_page * per_page;
  return {length, static_cast<int>((n + length - 1) / length)};
}

// The cache rows an attention unit streams at `position`: [first, end) of its chunk without the
// current position, whose K and V come from this token's qkv instead. `holds_current`: the unit's
// chunk contains `position` (it appends K and V to the cache).
struct AttentionRange {
  bool active = false;
  bool holds_current = false;
  std::int64_t first = 0;
  std::int64_t end = 0;
};

MK_HD inline AttentionRange attention_range(const Unit& u, std::int64_t position, const Geometry& g, const Dims& d) {
  const Chunking c = attention_chunking(position, g, d);
  AttentionRange r;
  if (u.b >= c.splits) return r;
  r.active = true;
  r.first = static_cast<std::int64_t>(u.b) * c.length;
  const std::int64_t chunk_end = r.first + c.length;  // exclusive
  r.holds_current = chunk_end > position;
  r.end = r.holds_current ? position : chunk_end;
  return r;
}

// Rows (matrix units) or cache positions (attention units) of one page: [first, first + count).
struct Span {
  std::int64_t first = 0;
  int count = 0;
};

MK_HD inline int unit_pages(const Unit& u, std::int64_t position, const Geometry& g, const Dims& d) {
  if (u.kind == UnitKind::argmax) return 0;
  if (u.kind == UnitKind::attention) {
    const AttentionRange r = attention_range(u, position, g, d);
    const std::int64_t per_page = positions_per_page(g, d);
    return r.end > r.first ? static_cast<int>((r.end - r.first + per_page - 1) / per_page) : 0;
  }
  const int per_page = g.page_bytes / row_bytes(u.kind, d);
  return (u.b - u.a + per_page - 1) / per_page;
}

// Page k of a unit. Matrix units: rows relative to the unit's first row a. Attention: absolute
// cache positions.
MK_HD inline Span page_span(const Unit& u, std::int64_t position, int k, const Geometry& g, const Dims& d) {
  Span s;
  if (u.kind == UnitKind::attention) {
    const AttentionRange r = attention_range(u, position, g, d);
    const std::int64_t per_page = positions_per_page(g, d);
    s.first = r.first + k * per_page;
    const std::int64_t left = r.end - s.first;
    s.count = static_cast<int>(left < per_page ? left : per_page);
    return s;
  }
  const int per_page = g.page_bytes / row_bytes(u.kind, d);
  s.first = static_cast<std::int64_t>(k) * per_page;
  const int left = u.b - u.a - static_cast<int>(s.first);
  s.count = left < per_page ? left : per_page;
  return s;
}

// Whether qkv rows [a, b) include rows of kv head g's group (its query heads, its k, its v).
MK_HD inline bool qkv_rows_touch_group(int a, int b, int g, const Dims& d) {
  const int q0 = g * d.group * d.head_dim, q1 = q0 + d.group * d.head_dim;
  const int k0 = d.q_size + g * d.head_dim, k1 = k0 + d.head_dim;
  const int v0 = d.q_size + d.kv_size + g * d.head_dim, v1 = v0 + d.head_dim;
  return (a < q1 && b > q0) || (a < k1 && b > k0) || (a < v1 && b > v0);
}

// Completion counters (uint32, each on its own 128-byte line), counted since the state was last
// zeroed: every unit adds 1 to its phase's counter once per token, so a phase is complete for the
// token of epoch e when its counter reaches units * (e + 1). cache(l) counts the cache appends of
// layer l (kv_heads per token), released after the rows are stored: the producers acquire it
// before streaming cache rows.
constexpr int kCounterStride = 32;

struct Counters {
  int layers = 0, kv_heads = 0;
  MK_HD int group(int l, int g) const { return l * kv_heads + g; }  // qkv rows of kv head g done
  MK_HD int attention(int l) const { return layers * kv_heads + l; }
  MK_HD int o_proj(int l) const { return layers * kv_heads + layers + l; }
  MK_HD int gate_up(int l) const { return layers * kv_heads + 2 * layers + l; }
  MK_HD int down(int l) const { return layers * kv_heads + 3 * layers + l; }
  MK_HD int cache(int l) const { return layers * kv_heads + 4 * layers + l; }
  MK_HD int lm_head() const { return layers * kv_heads + 5 * layers; }
  MK_HD int tokens() const { return layers * kv_heads + 5 * layers + 1; }
  // Arrivals of the active chunks of (layer l, kv head g), counted since zeroing; the last
  // arrival of a token merges the chunks.
  MK_HD int arrive(int l, int g) const { return layers * kv_heads + 5 * layers + 2 + l * kv_heads + g; }
  MK_HD int count() const { return 2 * layers * kv_heads + 5 * layers + 2; }
};

// Written by the first wait that times out (the kernel then ends early); read by the host.
struct AbortRecord {
  int flag = 0;
  int block = 0;
  int kind = 0;  // UnitKind, or -1: the producer warp
  int layer = 0;
  int token = 0;  // token of the launch
  int what = 0;   // WaitWhat
  std::uint32_t want = 0;
  std::uint32_t seen = 0;
};

enum WaitWhat : int { wait_counter = 1, wait_tagged = 2, wait_page_full = 3, wait_page_empty = 4, wait_cache = 5 };

// Device pointers of one layer's weights in the bf16 mirror.
struct LayerWeights {
  const std::uint16_t* input_norm = nullptr;
  const std::uint16_t* qkv = nullptr;
  const std::uint16_t* q_norm = nullptr;
  const std::uint16_t* k_norm = nullptr;
  const std::uint16_t* o_proj = nullptr;
  const std::uint16_t* post_norm = nullptr;
  const std::uint16_t* gate_up = nullptr;
  const std::uint16_t* down = nullptr;
};

// Everything the kernel reads. Activations between units are plain bf16 words, published by a
// release-add of their phase counter and read after acquiring it. A few small words are "tagged":
// 64-bit words holding a value (low half) and the epoch + 1 of the token that wrote it (high half),
// stored and loaded as single 64-bit accesses, so a reader knows a value is this token's.
inline constexpr int kTraceWords = 9;
inline constexpr int kTraceEnd = 7;  // word of a unit's end; the last word: ns its leader spent waiting for pages

struct Params {
  Dims dims;
  Geometry geo;
  Counters counter_index;

  const LayerWeights* layers = nullptr;  // [layers]
  const std::uint16_t* embed = nullptr;  // [vocab, hidden]
  const std::uint16_t* head = nullptr;   // [vocab, hidden] (the embedding when tied)
  const std::uint16_t* final_norm = nullptr;

  std::uint16_t* k_cache = nullptr;  // [layers, kv_heads, capacity, head_dim] bf16
  std::uint16_t* v_cache = nullptr;
  std::int64_t capacity = 0;
  const float* rope = nullptr;  // [capacity, head_dim / 2, 2]: cos, sin

  // Activations between units: bf16, rounded where the plain CUDA decoder rounds.
  std::uint16_t* x = nullptr;      // [layers + 1, hidden] layer inputs (x[0] unused: the embedding)
  std::uint16_t* x_mid = nullptr;  // [layers, hidden] after attention
  std::uint16_t* qkv = nullptr;    // [layers, qkv_size] raw q, k, v
  float* part = nullptr;           // [layers, max_splits, heads, head_dim + 2] (m, l, acc) per chunk
  std::uint16_t* att = nullptr;    // [layers, q_size] attention output, merged over the chunks
  std::uint16_t* act = nullptr;    // [layers, ffn] silu(gate) * up
  // Tagged words (see above).
  std::uint64_t* base = nullptr;     // [layers, kv_heads] arrival count when the token began
  std::uint64_t* lm_part = nullptr;  // [lm_units, 2] (max logit, its row)
  std::uint64_t* token = nullptr;    // [1] (next greedy id, epoch + 1 of the token it follows)
  std::uint32_t* counters = nullptr;
  AbortRecord* abort = nullptr;

  const Unit* units = nullptr;                 // every block's units, block after block
  const std::int32_t* block_begin = nullptr;   // [blocks + 1]
  const std::int32_t* group_counts = nullptr;  // [kv_heads] qkv units touching each group
  int qkv_units = 0, o_units = 0, gate_up_units = 0, down_units = 0, lm_units = 0, attention_slots = 0;

  // Dynamic shared memory layout (byte offsets).
  int smem_barriers = 0;  // 2 * pages mbarriers (full, then empty)
  int smem_vec = 0;       // input vector (vec_floats, two planes) or attention scratch
  int vec_floats = 0;     // largest row length
  int smem_small = 0;     // reductions, broadcast, merge weights, residual rows
  int merge_floats = 0;   // floats of the merge/argmax scratch
  int smem_bytes = 0;

  // This launch.
  std::int64_t position = 0;          // position of its first token
  std::uint32_t epoch = 0;            // tokens decoded since the state was zeroed, before this launch
  int tokens = 0;                     // tokens it decodes
  int greedy = 0;                     // 1: each token is the argmax of the previous one's logits
  const std::int32_t* ids = nullptr;  // teacher forcing: [tokens] ids (device); null: host_id
  std::int32_t host_id = 0;           // teacher forcing, one token, no device ids
  std::int32_t* ids_out = nullptr;    // greedy: the ids it fed, [tokens] (device; may be null)
  float* logits = nullptr;            // token t >= logits_first: logits at logits + (t - logits_first) * stride
  int logits_first = 0;
  std::int64_t logits_stride = 0;
  int evict_first = 1;  // stream weights and cache with an L2 evict-first policy
  std::int64_t timeout_ns = 0;
  // Diagnostics (may be null): [tokens, units, kTraceWords] %globaltimer of each unit (in Schedule
  // order), recorded by its first consumer thread: word 0 at its start, kTraceEnd at its end, marks
  // between (matrix units: 1 inputs' phase complete, 2 inputs loaded, 3 products stored;
  // attention: 1 q/k/v complete, 2 loaded, 3 normed and roped, 4 cache pages done, 5 warps merged,
  // 6 output stored).
  std::uint64_t* trace = nullptr;
};

// The units of every block, in the order the block runs them each token, and the per-token unit
// counts of each phase.
struct Schedule {
  std::vector<Unit> units;
  std::vector<std::int32_t> block_begin;
  std::vector<std::int32_t> group_counts;
  int qkv_units = 0, o_units = 0, gate_up_units = 0, down_units = 0, lm_units = 0, attention_slots = 0;
  int max_unit_rows = 0;  // largest o_proj or down unit (residual rows staged in shared memory)
};

// Matrix phases are cut into at most `blocks` row ranges of near-equal size (whole 8-row granules
// except lm_head's), unit i on block i;
// attention slot s (kv head s % kv_heads, chunk s / kv_heads) on block s % blocks; the argmax on
// the last block. Every block lists its units layer by layer in phase order.
Schedule build_schedule(const Dims& d, const Geometry& g);

// Byte offsets of a block's dynamic shared memory: the page ring, the mbarriers (full, then empty),
// the input vector (two planes) or attention scratch, and the small areas (reductions, broadcast,
// merge/argmax scratch, residual rows).
struct SmemLayout {
  int barriers = 0, vec = 0, vec_floats = 0, small = 0, merge_floats = 0, bytes = 0;
};
SmemLayout layout_smem(const Dims& d, const Geometry& g, const Schedule& s);

// Empty when the geometry can run the shape, else why not.
std::string check_geometry(const Dims& d, const Geometry& g);

// Dependency rank of a unit within a token: a unit waits only on units of smaller rank (or of an
// earlier token), and every block's list is sorted by rank, which rules out deadlock.
inline int unit_rank(const Unit& u) {
  const int phase = u.kind == UnitKind::lm_head ? 0 : u.kind == UnitKind::argmax ? 1 : static_cast<int>(u.kind);
  return u.layer * 5 + phase;
}

// Host side of the kernel (decode_megakernel.cu).
// How many blocks of `threads` threads with `smem_bytes` of dynamic shared memory fit on one SM
// (0: none).
int prepare_megakernel(int head_dim, int group, int threads, int smem_bytes);
// The largest dynamic shared memory one block may take on the current device.
int megakernel_max_smem(int head_dim, int group);
// Launches the kernel: geo.blocks co-resident blocks (cooperative launch).
void launch_megakernel(const Params& p, void* stream);
// rope[pos][i] = (cos, sin)(pos * theta^(-2i / head_dim)) for pos < capacity, in double, rounded.
void fill_rope_table(float* rope, std::int64_t capacity, int head_dim, double theta, void* stream);
// Keeps the id of the token word and sets its tag to 0 (epochs restart after the counters and the
// tagged buffers are zeroed).
void retag_token_word(std::uint64_t* word, void* stream);
// The token word after a prompt run outside the kernel (a batched prefill): the device id (its
// logits' argmax), tagged `tag` (the epoch of the token that will read it).
void set_token_word(std::uint64_t* word, const std::int32_t* id, std::uint32_t tag, void* stream);
// Fills n bf16 words with normal(0, scale) values (benchmark data for the cache).
void fill_bf16_normal(std::uint16_t* data, std::int64_t n, std::uint64_t seed, float scale, void* stream);

}  // namespace models::qwen3::megakernel
