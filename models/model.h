// The model interface: everything the trainer, checkpoints, tools and benches know of a model
// family. A family is a folder under models/ implementing Family (its config table, presets and
// specs), ModelSpec (one shape: parameters, FLOPs, Hugging Face names, backends) and the
// trainable model and decoder behind it, plus one line in models/registry.cpp. Nothing above
// this header names a family.
//
// A shape is an ordered JSON object of the family's config fields (ConfigField), keyed by YAML
// key. One table per family drives YAML parsing and validation (trainer/config.cpp), config.json
// reading and writing (models/model_config.h), the checkpoint manifest and error messages.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/phase_timer.h"
#include "optim/gradient_sink.h"
#include "optim/param_spec.h"
#include "optim/slab.h"
#include "optim/weight_source.h"

namespace models {

using Shape = nlohmann::ordered_json;

enum class FieldType { integer, number, boolean, choice };

// One config field of a family.
struct ConfigField {
  std::string key;     // YAML key under `model:`, and the key in a shape
  std::string hf_key;  // config.json key; empty: not part of config.json
  FieldType type = FieldType::integer;
  nlohmann::json fallback;  // value when nothing sets it (presets usually do)
  // config.json: the value transformers assumes when the key is absent (null: the key is required).
  nlohmann::json hf_default;
  double min = 0, max = 0;           // inclusive range (integer, number); min > max: no range
  std::vector<std::string> choices;  // FieldType::choice
  // true: part of the model's shape (manifests record it; a resume or init_from must agree);
  // false: a run option that leaves the weights' meaning unchanged (e.g. activation recompute).
  bool shape = true;
  // true: a shape key that only sets the initial weights (a resume may change it: it is unused).
  bool init_only = false;
  std::string help;
};

// A rule broken by a shape: the key it names (a ConfigField key, or a config.json key for
// check_hf) and what was expected.
struct FieldError {
  std::string key;
  std::string message;
};

// A Hugging Face tensor and where it lives in the slab: rows [row_offset, row_offset + rows) of
// parameter `param` (row blocks of fused tensors such as q/k/v). `shape` is the Hugging Face
// shape. An optional tensor (a tied head's lm_head.weight) may be absent from a folder.
struct HfTensor {
  std::string name;
  int param = 0;
  std::int64_t row_offset = 0;
  std::int64_t rows = 0;
  std::vector<std::int64_t> shape;
  bool optional = false;
  // Set for a tied duplicate: the folder may carry it, but it must then equal `param`'s rows.
  bool tied_copy = false;
};

// The index of parameter `name` in `params` (core::Error naming `family` when there is none).
int param_index(const std::vector<optim::ParamSpec>& params, const std::string& name, const std::string& family);

// The lm_head.weight entry of a tied head: the embedding's rows, optional in a folder.
HfTensor tied_head_tensor(int embed_param, std::int64_t vocab, std::int64_t hidden);

// Options of the trainable model on a backend.
struct TrainableOptions {
  std::int64_t max_tokens = 0;  // batch x seq of the largest micro-batch
  // cpu: fp32 weights of the whole slab when the master covers only this rank's shard (kept up
  // to date by the trainer's weight sync); nullptr: the slab's master holds everything.
  const float* full_weights = nullptr;
  // Where the model reads its weights range by range (optim/weight_source.h): ZeRO-3's gather, or
  // on cuda ZeRO-1/2's mirror arriving chunk by chunk; the family must consume its weights by
  // layer. nullptr: the slab (or full_weights) holds them.
  optim::WeightSource* weight_source = nullptr;
};

// A model on a backend, training: forward + backward of a micro-batch into the slab's gradients
// (through the gradient sink), and the loss. Inputs live in the memory of the model's device:
// host on cpu, device on cuda. Nothing here waits for the host on cuda.
class TrainableModel {
 public:
  virtual ~TrainableModel() = default;
  // ids, targets: int32 [batch * seq] (targets -100 = ignored). Adds the gradient of
  // grad_scale * mean loss to the gradients; the loss is left in loss().
  virtual void forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                                std::int64_t seq, float grad_scale) = 0;
  // The loss only (evaluation).
  virtual void forward_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                            std::int64_t seq) = 0;
  // Mean loss of the last call: fp32 scalar in the device's memory.
  virtual const float* loss() const = 0;
  // Each token's loss after forward_loss: fp32 [batch * seq] in the device's memory, -log p(target)
  // (0 where the target is ignored), valid until the next call. Evaluation sums these over a
  // continuation to score it; nullptr when the backend does not keep them.
  virtual const float* token_losses() const { return nullptr; }
  // Device int32 flag set when an input id was outside the vocabulary (cuda); nullptr on cpu,
  // which throws core::InputError at once.
  virtual const std::int32_t* invalid_id_flag() const { return nullptr; }
  // Once the caller has synchronised with the device after a step or an evaluation: throws
  // core::Error for a fault the device recorded on the way (a persistent kernel's wait that passed
  // its deadline, whose outputs are not valid). Nothing by default.
  virtual void check_device_faults() {}
  // optim/gradient_sink.h; nullptr: the slab's gradient buffer. Backends that cannot stream
  // ranges ignore it and report largest_gradient_range() == 0.
  virtual void set_gradient_sink(optim::GradientSink* sink) { (void)sink; }
  virtual std::int64_t largest_gradient_range() const { return 0; }
  // Device bytes held for activations.
  virtual std::size_t activation_bytes() const { return 0; }
  // Events around the phases of forward_backward (core/phase_timer.h), for a step's time
  // breakdown; nullptr (the default) records nothing. Backends without phases ignore it. The
  // timer must outlive its use.
  virtual void set_phase_timer(core::PhaseTimer* timer) { (void)timer; }
};

// Which decoder a family builds. megakernel: a family's single-launch decoder (Qwen3 on cuda);
// where there is none or it cannot take the model or the GPU, the plain one is built instead and
// the reason goes to DecoderOptions::fallback_reason.
enum class DecoderKind { plain, megakernel };

// Options of a decoder.
struct DecoderOptions {
  std::int64_t max_tokens = 0;          // prompt + new tokens: the state (KV cache) is sized for this
  const float* full_weights = nullptr;  // cpu, as TrainableOptions::full_weights
  // cuda: the whole model's 16-bit weights laid out as the slab (ZeRO-3 gathers them, its mirror
  // holding only a shard); nullptr: the slab's mirror, which then holds the whole model.
  const void* whole_mirror = nullptr;
  DecoderKind kind = DecoderKind::plain;
  std::string* fallback_reason = nullptr;  // set when `kind` was asked for and not built
};

// Stateful generation for one sequence: the state (a KV cache, recurrent states) lives in the
// decoder. prefill() appends a prompt in one pass, step() one token; after each, logits() holds
// the next-token logits (fp32 [vocab] in the device's memory).
class Decoder {
 public:
  virtual ~Decoder() = default;
  // Empties the state; the capacity stays.
  virtual void reset() = 0;
  // Appends `tokens` (host ids; position() + size <= capacity(), else core::InputError). With
  // `all_logits` (fp32 [tokens.size(), vocab] in the device's memory) the logits of every
  // appended position are written there too (teacher forcing).
  virtual void prefill(std::span<const std::int32_t> tokens, float* all_logits = nullptr) = 0;
  // Appends one token; a device-resident id may be given instead (cuda: `device_token` points at
  // an int32 on the device and `token` is ignored), so sampling need not cross to the host.
  virtual void step(std::int32_t token, const std::int32_t* device_token = nullptr) = 0;
  virtual const float* logits() const = 0;
  virtual std::int64_t position() const = 0;
  virtual std::int64_t capacity() const = 0;
  // Greedy decoding in one call where the decoder has a fused path: appends `count` tokens, each
  // the argmax of the logits before it (the first: of logits()), their ids to `ids_out` (int32
  // [count] in the device's memory). false: no such path, nothing done (step one at a time).
  virtual bool append_greedy(std::int64_t count, std::int32_t* ids_out) { return false; }
  // "plain" or "megakernel": what DecoderOptions::kind built.
  virtual std::string kind() const { return "plain"; }
};

// The decoders' input checks (core::InputError): `tokens` more after `position` fit `capacity`;
// every id is in [0, vocab).
void check_decoder_room(std::int64_t position, std::int64_t tokens, std::int64_t capacity);
// A decoder state (KV cache) of `bytes` for `positions` must fit the memory `device` has free
// (host: MemAvailable; cuda: free device memory); else core::InputError with the bytes.
void check_decoder_state_fits(double bytes, std::int64_t positions, const core::Device& device);
void check_decoder_ids(std::span<const std::int32_t> ids, std::int64_t vocab);
// check_decoder_room and check_decoder_ids for a prompt of `tokens` appended at `position`.
void check_decoder_prompt(std::span<const std::int32_t> tokens, std::int64_t position, std::int64_t capacity,
                          std::int64_t vocab);
// A decoder's max_tokens must be positive (core::InputError).
void check_decoder_capacity(std::int64_t max_tokens);
// A CUDA model's or decoder's slab (`what` names it in the core::Error): on the context's cuda
// device, with a bf16 mirror.
void check_cuda_slab(const optim::Slab& slab, const core::DeviceContext& context, const std::string& what);
// Tensor `tensor`'s 16-bit weights for a cuda decoder: inside `whole_mirror` (DecoderOptions::
// whole_mirror) when given, else the slab's mirror (core::Error when that lacks the tensor).
const void* decoder_mirror_tensor(optim::Slab& slab, const void* whole_mirror, int tensor);

// What the CPU decoders share: the position and capacity, and the next-token logits in a host
// vector (sized by the decoder).
class HostDecoder : public Decoder {
 public:
  void reset() override { position_ = 0; }
  const float* logits() const override { return logits_.data(); }
  std::int64_t position() const override { return position_; }
  std::int64_t capacity() const override { return capacity_; }

 protected:
  std::int64_t capacity_ = 0, position_ = 0;
  std::vector<float> logits_;  // [vocab]
};

// One shape of a family.
class ModelSpec {
 public:
  virtual ~ModelSpec() = default;
  virtual const std::string& family() const = 0;  // the registry name, YAML model.arch
  virtual const Shape& shape() const = 0;
  // Parameters in slab order, layer by layer (one layer's tensors contiguous).
  virtual const std::vector<optim::ParamSpec>& parameters() const = 0;
  virtual std::int64_t vocab_size() const = 0;
  // Longest sequence the model takes (seq_len is checked against it).
  virtual std::int64_t max_sequence_length() const = 0;
  // Training FLOPs per token (forward + backward) at sequence length `seq`, for MFU.
  virtual double flops_per_token(std::int64_t seq) const = 0;
  // Whether the cuda backward hands gradients range by range to a limited sink (ZeRO-2), and
  // whether the forward reads the weights layer by layer (parameter sharding).
  virtual bool streams_gradients() const = 0;
  virtual bool consumes_weights_by_layer() const = 0;
  std::int64_t parameter_count() const;  // elements of parameters()
  // Bytes the trainable model on cuda allocates for activations at micro-batches of `max_tokens`
  // (TrainableModel::activation_bytes() of such a model), computed without a GPU; nullopt where the
  // family does not compute it.
  virtual std::optional<std::size_t> cuda_activation_bytes(std::int64_t max_tokens) const { return std::nullopt; }
  // The slab ranges the trainable model reads its weights in, each whole, in forward order, where
  // it consumes them by layer (consumes_weights_by_layer()): ZeRO-3 gathers one range at a time
  // into a buffer of the largest. `layout` is laid out from parameters(). Empty otherwise.
  virtual std::vector<optim::Range> weight_ranges(const optim::SlabLayout& layout) const { return {}; }
  // The most elements one range handed to a limited gradient sink spans on cuda (the cuda
  // model's largest_gradient_range()); 0 where the family does not compute it.
  virtual std::int64_t largest_gradient_range(const optim::SlabLayout& layout) const { return 0; }

  // Hugging Face folder: the architecture name of config.json, the config.json object of this
  // shape (`carried`: keys of the folder the run started from, e.g. token ids, kept unless the
  // shape sets them), and the tensors of a folder.
  virtual std::string hf_architecture() const = 0;
  virtual nlohmann::ordered_json hf_config(const nlohmann::json& carried) const = 0;
  virtual std::vector<HfTensor> hf_tensors() const = 0;

  // Backends. `slab` is laid out from parameters(); cuda reads the bf16 mirror, cpu the fp32
  // master (or options.full_weights).
  virtual std::unique_ptr<TrainableModel> trainable(optim::Slab& slab, const core::DeviceContext& context,
                                                    const TrainableOptions& options) const = 0;
  // nullptr when the family has no decoder on this backend yet. Families without a megakernel
  // ignore options.kind (the caller sees it in Decoder::kind()).
  virtual std::unique_ptr<Decoder> decoder(optim::Slab& slab, const core::DeviceContext& context,
                                           const DecoderOptions& options) const {
    return nullptr;
  }
};

// A model family: its config table, presets, shape rules and specs.
class Family {
 public:
  virtual ~Family() = default;
  virtual std::string name() const = 0;             // YAML model.arch
  virtual std::string hf_architecture() const = 0;  // config.json architectures[0]
  virtual const std::vector<ConfigField>& fields() const = 0;
  virtual std::vector<std::string> presets() const = 0;
  // Values of the preset's fields (a subset of fields(); the rest take their fallback).
  virtual Shape preset(const std::string& name) const = 0;
  // Rules across fields, after each field passed its own type and range: the first one broken.
  virtual std::optional<FieldError> check(const Shape& shape) const = 0;
  // What a config.json asks that the family cannot represent (rope scaling, sliding windows,
  // biases, other dtypes...): the first such key. Called before the fields are read.
  virtual std::optional<FieldError> check_hf(const nlohmann::json& config) const = 0;
  // `shape` is complete and checked.
  virtual std::unique_ptr<ModelSpec> spec(const Shape& shape) const = 0;
};

}  // namespace models
