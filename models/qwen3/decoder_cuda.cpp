#include "models/qwen3/decoder_cuda.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/error.h"
#include "models/lm_ends_cuda.h"
#include "models/qwen3/prefill_cuda.h"

namespace models::qwen3 {

using decode::bf16;

struct Qwen3CudaDecoder::Impl {
  using LayerWeights = Qwen3LayerTensors;

  Qwen3Config c;
  optim::Slab& slab;
  const void* whole_mirror = nullptr;  // DecoderOptions::whole_mirror
  const core::DeviceContext& ctx;
  cudaStream_t stream;
  CudaDecoderSettings settings;
  std::int64_t capacity = 0, position = 0;
  int splits = 1, matvec_blocks = 1;
  int embed = 0, final_norm = 0, head = 0;
  std::vector<LayerWeights> layers;
  std::unique_ptr<Qwen3CudaPrefill> prompt;  // the batched path of prefill()

  core::Buffer cache;   // k then v, [layers, capacity, kv_size] bf16 each
  core::Buffer memory;  // the step's activations, logits and position
  std::size_t cache_bytes = 0;
  std::size_t x = 0, qkv = 0, q = 0, att = 0, act = 0;
  std::size_t partial = 0, logits = 0, device_position = 0, invalid = 0, inv_freq = 0;
  cudaGraphExec_t graph = nullptr;
  int eager_steps = 0;

  Impl(const Qwen3Config& config, optim::Slab& s, const core::DeviceContext& context, CudaDecoderSettings st)
      : c(config), slab(s), ctx(context), stream(context.stream()), settings(st) {}
  ~Impl() {
    if (graph != nullptr) (void)cudaGraphExecDestroy(graph);
  }

  template <typename T>
  T* at(std::size_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(memory.data()) + offset);
  }
  const bf16* w(int tensor) { return static_cast<const bf16*>(decoder_mirror_tensor(slab, whole_mirror, tensor)); }
  bf16* k_cache(std::size_t layer) {
    return static_cast<bf16*>(cache.data()) + layer * static_cast<std::size_t>(capacity * c.kv_size());
  }
  bf16* v_cache(std::size_t layer) { return k_cache(layer + layers.size()); }
  KvCacheView cache_view() {
    return {k_cache(0), v_cache(0), capacity * c.kv_size(),
            decode::KvLayout::packed(static_cast<int>(c.num_kv_heads), static_cast<int>(c.head_dim))};
  }

  // Final norm + lm_head of one bf16 row into the fp32 logits (advancing the device position).
  void head_logits(const bf16* row, std::int32_t* advance) {
    decode::matvec({.weight = w(head),
                    .rows = c.vocab_size,
                    .in = c.hidden_size,
                    .x = row,
                    .norm_weight = w(final_norm),
                    .eps = static_cast<float>(c.rms_norm_eps),
                    .out = at<float>(logits),
                    .advance = advance},
                   decode::Epilogue::store_f32, matvec_blocks, stream);
  }

  // One token from x (row 0) at the device position: every layer, the logits, position + 1.
  void step_body() {
    const std::int64_t d = c.hidden_size, qs = c.q_size(), f = c.intermediate_size;
    const float eps = static_cast<float>(c.rms_norm_eps);
    const std::int32_t* pos = at<std::int32_t>(device_position);
    const auto layout = decode::KvLayout::packed(static_cast<int>(c.num_kv_heads), static_cast<int>(c.head_dim));
    // A branch's first product: the residual row x, RMS-normalised with `norm`, times `weight`
    // [rows, d], into `out` through `epilogue`.
    auto normed_matvec = [&](int weight, std::int64_t rows, int norm, bf16* out, decode::Epilogue epilogue) {
      decode::matvec({.weight = w(weight),
                      .rows = rows,
                      .in = d,
                      .x = at<bf16>(x),
                      .norm_weight = w(norm),
                      .eps = eps,
                      .out = out},
                     epilogue, matvec_blocks, stream);
    };
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const LayerWeights& lw = layers[l];
      normed_matvec(lw.qkv, c.qkv_size(), lw.input_norm, at<bf16>(qkv), decode::Epilogue::store_bf16);
      decode::qk_norm_rope_append(at<bf16>(qkv), w(lw.q_norm), w(lw.k_norm), static_cast<int>(c.num_heads),
                                  static_cast<int>(c.num_kv_heads), static_cast<int>(c.head_dim), eps,
                                  at<double>(inv_freq), pos, at<bf16>(q), k_cache(l), v_cache(l), stream);
      decode::cached_attention(at<bf16>(q), qs, k_cache(l), v_cache(l), layout, static_cast<int>(c.num_heads),
                               static_cast<int>(c.num_kv_heads), static_cast<int>(c.head_dim), pos, 1, splits,
                               at<float>(partial), at<bf16>(att), stream);
      decode::matvec({.weight = w(lw.o_proj), .rows = d, .in = qs, .x = at<bf16>(att), .out = at<bf16>(x)},
                     decode::Epilogue::add_bf16, matvec_blocks, stream);
      normed_matvec(lw.gate_up, f, lw.post_norm, at<bf16>(act), decode::Epilogue::swiglu_bf16);
      decode::matvec({.weight = w(lw.down), .rows = d, .in = f, .x = at<bf16>(act), .out = at<bf16>(x)},
                     decode::Epilogue::add_bf16, matvec_blocks, stream);
    }
    head_logits(at<bf16>(x), at<std::int32_t>(device_position));
  }

  void capture() {
    cudaGraph_t captured = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      step_body();
    } catch (...) {
      (void)cudaStreamEndCapture(stream, &captured);
      if (captured != nullptr) (void)cudaGraphDestroy(captured);
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream, &captured));
    const cudaError_t status = cudaGraphInstantiate(&graph, captured, 0);
    (void)cudaGraphDestroy(captured);
    CUDA_CHECK(status);
  }

  void check_room(std::int64_t tokens) const { check_decoder_room(position, tokens, capacity); }
  void check_id(std::int32_t id) const { check_decoder_ids({&id, 1}, c.vocab_size); }
};

Qwen3CudaDecoder::Qwen3CudaDecoder(const Qwen3Config& config, optim::Slab& slab, const core::DeviceContext& context,
                                   const DecoderOptions& options, CudaDecoderSettings settings)
    : impl_(std::make_unique<Impl>(config, slab, context, settings)) {
  Impl& m = *impl_;
  m.whole_mirror = options.whole_mirror;
  validate(config, "qwen3 decoder");
  check_cuda_slab(slab, context, "Qwen3CudaDecoder");
  check_decoder_capacity(options.max_tokens);
  if (config.head_dim != 64 && config.head_dim != 128) {
    throw core::InputError("qwen3 decoder: head_dim " + std::to_string(config.head_dim) +
                           " not supported on cuda (64 or 128)");
  }
  if (settings.max_prefill_chunk <= 0) throw core::Error("Qwen3CudaDecoder: max_prefill_chunk must be positive");
  const Qwen3TensorIndex index(config, slab.layout(), "Qwen3CudaDecoder");
  m.embed = index.embed;
  m.final_norm = index.final_norm;
  m.head = index.head;
  m.layers = index.layers;
  m.capacity = options.max_tokens;
  const int sms = std::max(1, context.multiprocessor_count());
  m.splits = settings.attention_splits > 0 ? std::min(settings.attention_splits, 65535)
                                           : decode::default_attention_splits(sms, config.num_kv_heads);
  m.matvec_blocks = settings.matvec_blocks > 0 ? settings.matvec_blocks : 8 * sms;

  const auto kv = static_cast<std::size_t>(config.kv_size());
  check_decoder_state_fits(
      2.0 * 2.0 * static_cast<double>(config.num_layers) * static_cast<double>(m.capacity) * static_cast<double>(kv),
      m.capacity, context.device());
  m.cache_bytes = 2 * static_cast<std::size_t>(config.num_layers) * static_cast<std::size_t>(m.capacity) * kv * 2;
  m.cache = core::Buffer(context.device(), m.cache_bytes);

  m.prompt = std::make_unique<Qwen3CudaPrefill>(config, slab, context, std::min(m.capacity, settings.max_prefill_chunk),
                                                m.splits, options.whole_mirror);
  DeviceArena a;
  const auto d = static_cast<std::size_t>(config.hidden_size);
  const auto f = static_cast<std::size_t>(config.intermediate_size), qs = static_cast<std::size_t>(config.q_size());
  m.x = a.reserve(d * 2);
  m.qkv = a.reserve(static_cast<std::size_t>(config.qkv_size()) * 2);
  m.q = a.reserve(qs * 2);
  m.att = a.reserve(qs * 2);
  m.act = a.reserve(f * 2);
  const std::int64_t partial_floats = decode::attention_partial_floats(static_cast<int>(config.num_heads),
                                                                       static_cast<int>(config.head_dim), 1, m.splits);
  m.partial = a.reserve(static_cast<std::size_t>(partial_floats) * 4);
  m.logits = a.reserve(static_cast<std::size_t>(config.vocab_size) * 4);
  m.device_position = a.reserve(4);
  m.invalid = a.reserve(4);
  m.inv_freq = a.reserve(static_cast<std::size_t>(config.head_dim / 2) * 8);
  m.memory = core::Buffer(context.device(), a.size());
  m.memory.fill_bytes(0, m.stream);
  std::vector<double> inv_freq(static_cast<std::size_t>(config.head_dim / 2));
  for (std::size_t i = 0; i < inv_freq.size(); ++i) {
    inv_freq[i] = std::pow(config.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(config.head_dim));
  }
  core::copy_bytes(m.at<double>(m.inv_freq), inv_freq.data(), inv_freq.size() * 8, m.stream);
  context.synchronize();  // the host vector is a pageable source
}

Qwen3CudaDecoder::~Qwen3CudaDecoder() = default;

void Qwen3CudaDecoder::reset() {
  Impl& m = *impl_;
  m.position = 0;
  decode::set_int(m.at<std::int32_t>(m.device_position), 0, m.stream);
}

void Qwen3CudaDecoder::prefill(std::span<const std::int32_t> tokens, float* all_logits) {
  Impl& m = *impl_;
  if (tokens.empty()) throw core::InputError("decoder: prefill needs at least one token");
  check_decoder_prompt(tokens, m.position, m.capacity, m.c.vocab_size);
  m.prompt->run(tokens, m.position, m.cache_view(), m.at<float>(m.logits), all_logits);
  m.position += static_cast<std::int64_t>(tokens.size());
  decode::set_int(m.at<std::int32_t>(m.device_position), static_cast<std::int32_t>(m.position), m.stream);
}

void Qwen3CudaDecoder::step(std::int32_t token, const std::int32_t* device_token) {
  Impl& m = *impl_;
  m.check_room(1);
  if (device_token == nullptr) m.check_id(token);
  decode::embed_token(device_token, token, m.w(m.embed), m.c.vocab_size, m.c.hidden_size, m.at<bf16>(m.x),
                      m.at<std::int32_t>(m.invalid), m.stream);
  if (m.graph != nullptr) {
    CUDA_CHECK(cudaGraphLaunch(m.graph, m.stream));
  } else if (m.settings.cuda_graph && m.eager_steps > 0) {
    m.capture();
    CUDA_CHECK(cudaGraphLaunch(m.graph, m.stream));
  } else {
    m.step_body();  // the first step runs eagerly (first launches configure their kernels)
    ++m.eager_steps;
  }
  ++m.position;
}

const float* Qwen3CudaDecoder::logits() const { return impl_->at<float>(impl_->logits); }
std::int64_t Qwen3CudaDecoder::position() const { return impl_->position; }
std::int64_t Qwen3CudaDecoder::capacity() const { return impl_->capacity; }
std::size_t Qwen3CudaDecoder::cache_bytes() const { return impl_->cache_bytes; }
std::size_t Qwen3CudaDecoder::scratch_bytes() const { return impl_->memory.bytes() + impl_->prompt->scratch_bytes(); }
const std::int32_t* Qwen3CudaDecoder::invalid_id_flag() const { return impl_->at<std::int32_t>(impl_->invalid); }

}  // namespace models::qwen3
