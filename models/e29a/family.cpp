#include "models/e29a/family.h"

#include <cmath>

#include "core/error.h"
#include "models/e29a/layer_kernels.h"
#include "models/e29a/model.h"
#include "models/e29a/model_cuda.h"
#include "models/model_config.h"

namespace models::e29a {

namespace {

constexpr double kMaxDim = 1 << 16;
constexpr double kMaxVocab = 1 << 30;
constexpr double kMaxLayers = 4096;
constexpr std::int64_t kMaxSequence = std::int64_t{1} << 24;

ConfigField integer(const char* key, const char* hf_key, std::int64_t fallback, double min, double max,
                    const char* help) {
  return {.key = key,
          .hf_key = hf_key,
          .type = FieldType::integer,
          .fallback = fallback,
          .hf_default = nullptr,
          .min = min,
          .max = max,
          .help = help};
}

const std::vector<ConfigField>& table() {
  static const std::vector<ConfigField> fields = {
      integer("vocab_size", "vocab_size", 256, 1, kMaxVocab, "vocabulary size (256: bytes)"),
      integer("hidden_size", "hidden_size", 1024, 1, kMaxDim, "width D of the residual stream and the recurrence"),
      integer("num_layers", "num_hidden_layers", 8, 1, kMaxLayers, "E29a layers"),
      integer("n_slots", "n_slots", 8, 1, kernels::kMaxSlots, "tape slots N"),
      {.key = "tie_word_embeddings",
       .hf_key = "tie_word_embeddings",
       .type = FieldType::boolean,
       .fallback = true,
       .hf_default = true,
       .help = "lm_head shares the embedding"},
      {.key = "tape_init",
       .hf_key = "tape_init",
       .type = FieldType::choice,
       .fallback = "learned",
       .hf_default = "learned",
       .choices = {"learned", "zeros"},
       .init_only = true,
       .help = "initial tape H_0: learned (random start) or zeros (upstream's start: every slot stays equal)"},
      {.key = "residual",
       .hf_key = "residual",
       .type = FieldType::choice,
       .fallback = "pre_norm",
       .hf_default = "pre_norm",
       .choices = {"pre_norm", "normed_sum"},
       .help = "x + layer(norm(x)) (pre_norm), or that sum divided by its RMS (normed_sum)"},
      {.key = "tape_init_std",
       .type = FieldType::number,
       .fallback = 0.5,
       .min = 0.0,
       .max = 1e6,
       .shape = false,
       .help = "standard deviation of the learned tape's initial values"},
      {.key = "rms_norm_eps",
       .hf_key = "rms_norm_eps",
       .type = FieldType::number,
       .fallback = 1e-6,
       .hf_default = 1e-6,
       .min = 1e-30,
       .max = 1.0,
       .help = "RMSNorm epsilon"},
      {.key = "checkpoint_interval",
       .type = FieldType::integer,
       .fallback = 0,
       .min = 0,
       .max = kMaxSequence,
       .shape = false,
       .help = "cuda: tape checkpoint every K steps for the backward (0: about sqrt(seq_len))"},
      {.key = "detach_scores",
       .type = FieldType::choice,
       .fallback = "none",
       .choices = {"none", "read", "write", "both"},
       .shape = false,
       .help = "attention scores that get no gradient in the backward (none: the exact gradient)"},
      {.key = "carry_grad_clip",
       .type = FieldType::number,
       .fallback = 0.0,
       .min = 0.0,
       .max = 1e30,
       .shape = false,
       .help = "bound on the norm of the gradient a sequence carries from one step to the one before (0: off)"},
      {.key = "recurrence_kernel",
       .type = FieldType::choice,
       .fallback = "automatic",
       .choices = {"automatic", "hybrid", "persistent"},
       .shape = false,
       .help = "cuda: the recurrence's kernels in training (automatic: persistent where the shape fits)"},
  };
  return fields;
}

struct Preset {
  const char* name;
  std::int64_t vocab, dim, layers, slots;
};

// Upstream's settings (byte-level, D 1024, depth 8 with N 8 or depth 6 with N 16) and small ones.
constexpr Preset kPresets[] = {
    {"e29a-tiny", 256, 64, 2, 8},
    {"e29a-quickstart", 256, 256, 4, 8},
    {"e29a-d1024-l8-n8", 256, 1024, 8, 8},
    {"e29a-d1024-l6-n16", 256, 1024, 6, 16},
};

class E29aSpec final : public ModelSpec {
 public:
  explicit E29aSpec(const Shape& shape)
      : shape_(shape), config_(config_from_shape(shape)), params_(parameter_specs(config_)) {}

  const std::string& family() const override { return name_; }
  const Shape& shape() const override { return shape_; }
  const std::vector<optim::ParamSpec>& parameters() const override { return params_; }
  std::int64_t vocab_size() const override { return config_.vocab_size; }
  std::int64_t max_sequence_length() const override { return kMaxSequence; }
  // 6 per parameter and token (forward + backward of every product), plus per layer and step the
  // two attentions, the read and the tape update over N x D (about 5 N D multiply-adds forward).
  double flops_per_token(std::int64_t /*seq*/) const override {
    return 6.0 * static_cast<double>(config_.parameter_count()) +
           30.0 * static_cast<double>(config_.num_layers * config_.n_slots * config_.hidden_size);
  }
  bool streams_gradients() const override { return true; }
  bool consumes_weights_by_layer() const override { return true; }
  std::vector<optim::Range> weight_ranges(const optim::SlabLayout& layout) const override {
    const TensorIndex index(config_, layout);
    std::vector<optim::Range> ranges = {index.embed_range(layout)};
    for (std::size_t l = 0; l < index.layers.size(); ++l) ranges.push_back(index.layer_range(layout, l));
    ranges.push_back(index.tail_range(layout));
    return ranges;
  }

  std::string hf_architecture() const override { return "E29aForCausalLM"; }
  nlohmann::ordered_json hf_config(const nlohmann::json& carried) const override {
    nlohmann::ordered_json j = {{"architectures", {"E29aForCausalLM"}}, {"model_type", "e29a"}};
    if (carried.is_object()) {
      for (const auto& [key, value] : carried.items()) {
        if (key == "architectures" || key == "torch_dtype") continue;
        j[key] = value;
      }
    }
    j.update(hf_fields(e29a_family(), shape_));
    j["hidden_act"] = "silu";
    return j;
  }
  std::vector<HfTensor> hf_tensors() const override {
    std::vector<HfTensor> out;
    for (const auto& [name, ours] : hf_tensor_names(config_)) {
      const int param = find(ours);
      const auto& spec = params_[static_cast<std::size_t>(param)];
      out.push_back({.name = name, .param = param, .row_offset = 0, .rows = spec.shape[0], .shape = spec.shape});
    }
    if (config_.tie_word_embeddings) {
      out.push_back(tied_head_tensor(find("embed_tokens"), config_.vocab_size, config_.hidden_size));
    }
    return out;
  }

  std::unique_ptr<TrainableModel> trainable(optim::Slab& slab, const core::DeviceContext& context,
                                            const TrainableOptions& options) const override {
    if (context.is_cuda())
      return std::make_unique<E29aCuda>(config_, slab, context, options.max_tokens, options.weight_source);
    return std::make_unique<E29aCpu>(config_, slab, options.full_weights, options.weight_source);
  }
  std::unique_ptr<Decoder> decoder(optim::Slab& slab, const core::DeviceContext& context,
                                   const DecoderOptions& options) const override {
    if (options.kind == DecoderKind::megakernel && options.fallback_reason != nullptr) {
      *options.fallback_reason = "e29a has no megakernel; its recurrent decoder runs";
    }
    if (context.is_cuda()) return std::make_unique<E29aCudaDecoder>(config_, slab, context, options);
    return std::make_unique<E29aCpuDecoder>(config_, slab, context, options);
  }

 private:
  int find(const std::string& name) const { return param_index(params_, name, "E29a"); }

  std::string name_ = "e29a";
  Shape shape_;
  E29aConfig config_;
  std::vector<optim::ParamSpec> params_;
};

class E29aFamily final : public Family {
 public:
  std::string name() const override { return "e29a"; }
  std::string hf_architecture() const override { return "E29aForCausalLM"; }
  const std::vector<ConfigField>& fields() const override { return table(); }
  std::vector<std::string> presets() const override {
    std::vector<std::string> names;
    for (const Preset& p : kPresets) names.emplace_back(p.name);
    return names;
  }
  Shape preset(const std::string& name) const override {
    for (const Preset& p : kPresets) {
      if (name == p.name) {
        return {{"vocab_size", p.vocab}, {"hidden_size", p.dim}, {"num_layers", p.layers}, {"n_slots", p.slots}};
      }
    }
    std::string names;
    for (const Preset& p : kPresets) names += (names.empty() ? "" : ", ") + std::string(p.name);
    throw core::InputError("unknown e29a preset '" + name + "' (known: " + names + ")");
  }
  std::optional<FieldError> check(const Shape& s) const override {
    const double params = static_cast<double>(config_from_shape(s).parameter_count());
    if (params > 1e12)
      return FieldError{"hidden_size", "the shape has " + std::to_string(params) + " parameters, more than 1e12"};
    return std::nullopt;
  }
  std::optional<FieldError> check_hf(const nlohmann::json& j) const override {
    if (j.contains("model_type") && j["model_type"] != "e29a") {
      return FieldError{"model_type", "expected 'e29a', got " + describe_value(j["model_type"])};
    }
    if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
      return FieldError{"hidden_act", "expected 'silu', got " + describe_value(j["hidden_act"])};
    }
    return std::nullopt;
  }
  std::unique_ptr<ModelSpec> spec(const Shape& shape) const override { return std::make_unique<E29aSpec>(shape); }
};

}  // namespace

E29aConfig config_from_shape(const Shape& s) {
  E29aConfig c;
  c.vocab_size = s.at("vocab_size");
  c.hidden_size = s.at("hidden_size");
  c.num_layers = s.at("num_layers");
  c.n_slots = s.at("n_slots");
  c.tie_word_embeddings = s.at("tie_word_embeddings");
  c.tape_init_zeros = s.at("tape_init").get<std::string>() == "zeros";
  // Shapes written before the field existed are pre-norm models.
  if (s.contains("residual") && s.at("residual") == "normed_sum") c.residual = Residual::normed_sum;
  if (s.contains("tape_init_std")) c.tape_init_std = s.at("tape_init_std");
  c.rms_norm_eps = s.at("rms_norm_eps");
  if (s.contains("checkpoint_interval")) c.checkpoint_interval = s.at("checkpoint_interval");
  if (s.contains("detach_scores")) {
    const std::string detach = s.at("detach_scores");
    c.backward.detach_read_scores = detach == "read" || detach == "both";
    c.backward.detach_write_scores = detach == "write" || detach == "both";
  }
  if (s.contains("carry_grad_clip")) c.backward.carry_clip = s.at("carry_grad_clip");
  if (s.contains("recurrence_kernel")) {
    const std::string kernel = s.at("recurrence_kernel");
    c.recurrence_kernel = kernel == "hybrid"       ? RecurrenceKernel::hybrid
                          : kernel == "persistent" ? RecurrenceKernel::persistent
                                                   : RecurrenceKernel::automatic;
  }
  return c;
}

Shape shape_from_config(const E29aConfig& c) {
  Shape s = Shape::object();
  s["vocab_size"] = c.vocab_size;
  s["hidden_size"] = c.hidden_size;
  s["num_layers"] = c.num_layers;
  s["n_slots"] = c.n_slots;
  s["tie_word_embeddings"] = c.tie_word_embeddings;
  s["tape_init"] = c.tape_init_zeros ? "zeros" : "learned";
  s["residual"] = c.residual == Residual::normed_sum ? "normed_sum" : "pre_norm";
  s["tape_init_std"] = c.tape_init_std;
  s["rms_norm_eps"] = c.rms_norm_eps;
  s["checkpoint_interval"] = c.checkpoint_interval;
  const bool read = c.backward.detach_read_scores, write = c.backward.detach_write_scores;
  s["detach_scores"] = read && write ? "both" : read ? "read" : write ? "write" : "none";
  s["carry_grad_clip"] = c.backward.carry_clip;
  s["recurrence_kernel"] = c.recurrence_kernel == RecurrenceKernel::hybrid       ? "hybrid"
                           : c.recurrence_kernel == RecurrenceKernel::persistent ? "persistent"
                                                                                 : "automatic";
  return s;
}

const Family& e29a_family() {
  static const E29aFamily family;
  return family;
}

}  // namespace models::e29a
