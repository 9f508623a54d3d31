#include "models/qwen3/family.h"

#include <cmath>
#include <type_traits>
#include <variant>

#include "core/error.h"
#include "models/model_config.h"
#include "models/qwen3/decoder.h"
#include "models/qwen3/decoder_cuda.h"
#include "models/qwen3/megakernel_decoder.h"
#include "models/qwen3/model.h"

namespace models::qwen3 {

namespace {

constexpr double kMaxDim = 1 << 20;
constexpr double kMaxVocab = 1 << 30;
constexpr double kMaxLayers = 4096;

const Qwen3Config kDefaults;  // Qwen3-0.6B: every field's fallback

// A field of the table and the member of Qwen3Config that holds it (none for run options, which
// the shape carries: recompute). The fallback is the struct's default.
struct Bound {
  ConfigField field;
  std::variant<std::monostate, std::int64_t Qwen3Config::*, double Qwen3Config::*, bool Qwen3Config::*> member;
};

Bound integer(std::int64_t Qwen3Config::*member, const char* key, const char* hf_key, nlohmann::json hf_default,
              double max, const char* help) {
  return {{.key = key,
           .hf_key = hf_key,
           .type = FieldType::integer,
           .fallback = kDefaults.*member,
           .hf_default = std::move(hf_default),
           .min = 1,
           .max = max,
           .help = help},
          member};
}

Bound number(double Qwen3Config::*member, const char* key, const char* hf_key, double hf_default, double min,
             double max, const char* help) {
  return {{.key = key,
           .hf_key = hf_key,
           .type = FieldType::number,
           .fallback = kDefaults.*member,
           .hf_default = hf_default,
           .min = min,
           .max = max,
           .help = help},
          member};
}

Bound boolean(bool Qwen3Config::*member, const char* key, const char* hf_key, bool hf_default, const char* help) {
  return {{.key = key,
           .hf_key = hf_key,
           .type = FieldType::boolean,
           .fallback = kDefaults.*member,
           .hf_default = hf_default,
           .help = help},
          member};
}

// The one description of Qwen3's config: YAML and shape key, config.json key, what transformers
// assumes when config.json lacks it, range, meaning.
const std::vector<Bound>& bound_table() {
  static const std::vector<Bound> rows = {
      integer(&Qwen3Config::vocab_size, "vocab_size", "vocab_size", nullptr, kMaxVocab, "vocabulary size"),
      integer(&Qwen3Config::hidden_size, "hidden_size", "hidden_size", nullptr, kMaxDim,
              "width of the residual stream"),
      integer(&Qwen3Config::intermediate_size, "intermediate_size", "intermediate_size", nullptr, kMaxDim,
              "width of the MLP"),
      integer(&Qwen3Config::num_layers, "num_layers", "num_hidden_layers", nullptr, kMaxLayers, "decoder layers"),
      integer(&Qwen3Config::num_heads, "num_heads", "num_attention_heads", nullptr, 4096, "query heads"),
      integer(&Qwen3Config::num_kv_heads, "num_kv_heads", "num_key_value_heads", nullptr, 4096,
              "key/value heads (GQA)"),
      integer(&Qwen3Config::head_dim, "head_dim", "head_dim", 128, 1024, "width of a head"),
      number(&Qwen3Config::rope_theta, "rope_theta", "rope_parameters.rope_theta|rope_theta", 10000.0, 1e-6, 1e300,
             "RoPE base"),
      number(&Qwen3Config::rms_norm_eps, "rms_norm_eps", "rms_norm_eps", 1e-6, 1e-30, 1.0, "RMSNorm epsilon"),
      boolean(&Qwen3Config::tie_word_embeddings, "tie_word_embeddings", "tie_word_embeddings", false,
              "lm_head shares the embedding"),
      integer(&Qwen3Config::max_position_embeddings, "max_position_embeddings", "max_position_embeddings", 32768,
              1 << 24, "longest sequence"),
      {{.key = "recompute",
        .type = FieldType::choice,
        .fallback = "none",
        .choices = {"none", "mlp", "full"},
        .shape = false,
        .help = "activation recompute on cuda"},
       {}},
  };
  return rows;
}

const std::vector<ConfigField>& table() {
  static const std::vector<ConfigField> fields = [] {
    std::vector<ConfigField> f;
    for (const Bound& row : bound_table()) f.push_back(row.field);
    return f;
  }();
  return fields;
}

// The presets: the fields each sets over the defaults.
const std::vector<std::pair<std::string, Shape>>& preset_table() {
  static const std::vector<std::pair<std::string, Shape>> presets = {
      {"qwen3-0.6b", Shape::object()},
      {"qwen3-1.7b", {{"hidden_size", 2048}, {"intermediate_size", 6144}}},
      // Qwen/Qwen3-4B and Qwen/Qwen3-8B, their config.json (the rest as Qwen3-0.6B's: head_dim 128,
      // rope_theta 1e6, max_position_embeddings 40960, vocabulary 151936).
      {"qwen3-4b",
       {{"hidden_size", 2560},
        {"intermediate_size", 9728},
        {"num_layers", 36},
        {"num_heads", 32},
        {"num_kv_heads", 8}}},
      {"qwen3-8b",
       {{"hidden_size", 4096},
        {"intermediate_size", 12288},
        {"num_layers", 36},
        {"num_heads", 32},
        {"num_kv_heads", 8},
        {"tie_word_embeddings", false}}},
      // A byte-level model for quick runs.
      {"qwen3-tiny",
       {{"vocab_size", 256},
        {"hidden_size", 128},
        {"intermediate_size", 384},
        {"num_layers", 4},
        {"num_heads", 4},
        {"num_kv_heads", 2},
        {"head_dim", 64},
        {"rope_theta", 10000.0},
        {"max_position_embeddings", 4096}}},
      // The shape of tests/fixtures/qwen3.
      {"qwen3-test",
       {{"vocab_size", 1000},
        {"hidden_size", 64},
        {"intermediate_size", 160},
        {"num_layers", 3},
        {"num_heads", 4},
        {"num_kv_heads", 2},
        {"head_dim", 64},
        {"rope_theta", 10000.0},
        {"max_position_embeddings", 256}}},
  };
  return presets;
}

Recompute recompute_of(const Shape& shape) {
  return recompute_from_string(shape.contains("recompute") ? shape["recompute"].get<std::string>() : "none");
}

// The fp32 cpu model as a TrainableModel.
class CpuModel final : public TrainableModel {
 public:
  CpuModel(const Qwen3Config& config, optim::Slab& slab, const float* full_weights, optim::WeightSource* source)
      : model_(config, slab, const_cast<float*>(full_weights), source) {}
  void forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                        float grad_scale) override {
    const auto n = static_cast<std::size_t>(batch * seq);
    loss_ = static_cast<float>(model_.step({ids, n}, {targets, n}, batch, seq, true, grad_scale).loss);
  }
  void forward_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                    std::int64_t seq) override {
    const auto n = static_cast<std::size_t>(batch * seq);
    token_losses_.resize(n);
    loss_ = static_cast<float>(model_.step({ids, n}, {targets, n}, batch, seq, false, 1.0, token_losses_).loss);
  }
  const float* loss() const override { return &loss_; }
  const float* token_losses() const override { return token_losses_.data(); }

 private:
  Qwen3Model model_;
  float loss_ = 0;
  std::vector<float> token_losses_;
};

class Qwen3Spec final : public ModelSpec {
 public:
  explicit Qwen3Spec(const Shape& shape)
      : shape_(shape), config_(config_from_shape(shape)), params_(parameter_specs(config_)) {}

  const std::string& family() const override { return name_; }
  const Shape& shape() const override { return shape_; }
  const std::vector<optim::ParamSpec>& parameters() const override { return params_; }
  std::int64_t vocab_size() const override { return config_.vocab_size; }
  std::int64_t max_sequence_length() const override { return config_.max_position_embeddings; }
  double flops_per_token(std::int64_t seq) const override {
    return 6.0 * static_cast<double>(config_.parameter_count()) +
           6.0 * static_cast<double>(config_.num_layers * config_.num_heads * config_.head_dim * seq);
  }
  bool streams_gradients() const override { return true; }
  bool consumes_weights_by_layer() const override { return true; }
  std::optional<std::size_t> cuda_activation_bytes(std::int64_t max_tokens) const override {
    return Qwen3Cuda::planned_activation_bytes(config_, max_tokens, recompute_of(shape_));
  }
  std::vector<optim::Range> weight_ranges(const optim::SlabLayout& layout) const override {
    const Qwen3TensorIndex index(config_, layout, "qwen3");
    std::vector<optim::Range> ranges = {index.embed_range(layout)};
    for (std::size_t l = 0; l < index.layers.size(); ++l) ranges.push_back(index.layer_range(layout, l));
    ranges.push_back(index.tail_range(layout));
    return ranges;
  }
  std::int64_t largest_gradient_range(const optim::SlabLayout& layout) const override {
    return Qwen3TensorIndex(config_, layout, "qwen3").largest_gradient_range(layout, config_.hidden_size);
  }

  std::string hf_architecture() const override { return "Qwen3ForCausalLM"; }
  nlohmann::ordered_json hf_config(const nlohmann::json& carried) const override {
    nlohmann::ordered_json j = {{"architectures", {"Qwen3ForCausalLM"}}, {"model_type", "qwen3"}};
    if (carried.is_object()) {
      for (const auto& [key, value] : carried.items()) {
        // Superseded spellings of what the shape sets.
        if (key == "rope_theta" || key == "torch_dtype" || key == "rope_scaling" || key == "architectures") continue;
        j[key] = value;
      }
    }
    const nlohmann::ordered_json fields = hf_fields(qwen3_family(), shape_);
    for (const auto& [key, value] : fields.items()) {
      if (value.is_object() && j.contains(key) && j[key].is_object()) {
        j[key].update(value);
      } else {
        j[key] = value;
      }
    }
    j["rope_parameters"]["rope_type"] = "default";
    j["hidden_act"] = "silu";
    j["attention_bias"] = false;
    j["attention_dropout"] = 0.0;
    j["use_sliding_window"] = false;
    if (!j.contains("initializer_range")) j["initializer_range"] = 0.02;
    return j;
  }
  std::vector<HfTensor> hf_tensors() const override {
    std::vector<HfTensor> out;
    for (const auto& [name, loc] : hf_tensor_map(config_)) {
      const int param = find(loc.name);
      const auto& spec = params_[static_cast<std::size_t>(param)];
      std::vector<std::int64_t> shape = spec.shape;
      shape[0] = loc.rows;
      out.push_back({.name = name, .param = param, .row_offset = loc.row_offset, .rows = loc.rows, .shape = shape});
    }
    if (config_.tie_word_embeddings) {
      out.push_back(tied_head_tensor(find("embed_tokens"), config_.vocab_size, config_.hidden_size));
    }
    return out;
  }

  std::unique_ptr<TrainableModel> trainable(optim::Slab& slab, const core::DeviceContext& context,
                                            const TrainableOptions& options) const override {
    if (context.is_cuda()) {
      return std::make_unique<Qwen3Cuda>(config_, slab, context, options.max_tokens, recompute_of(shape_),
                                         options.weight_source);
    }
    return std::make_unique<CpuModel>(config_, slab, options.full_weights, options.weight_source);
  }
  std::unique_ptr<Decoder> decoder(optim::Slab& slab, const core::DeviceContext& context,
                                   const DecoderOptions& options) const override {
    if (options.kind == DecoderKind::megakernel) {
      std::string reason = "the megakernel runs on cuda only";
      if (context.is_cuda()) {
        try {
          return std::make_unique<MegakernelDecoder>(config_, slab, context, options);
        } catch (const core::InputError& e) {
          reason = e.what();  // this GPU or shape: the plain decoder takes it
        }
      }
      if (options.fallback_reason != nullptr) *options.fallback_reason = reason;
    }
    if (context.is_cuda()) return std::make_unique<Qwen3CudaDecoder>(config_, slab, context, options);
    return std::make_unique<Qwen3CpuDecoder>(config_, slab, context, options);
  }

 private:
  int find(const std::string& name) const { return param_index(params_, name, "Qwen3"); }

  std::string name_ = "qwen3";
  Shape shape_;
  Qwen3Config config_;
  std::vector<optim::ParamSpec> params_;
};

class Qwen3Family final : public Family {
 public:
  std::string name() const override { return "qwen3"; }
  std::string hf_architecture() const override { return "Qwen3ForCausalLM"; }
  const std::vector<ConfigField>& fields() const override { return table(); }
  std::vector<std::string> presets() const override { return preset_names(); }
  Shape preset(const std::string& name) const override {
    return weights_shape(*this, shape_from_config(qwen3::preset(name)));
  }
  std::optional<FieldError> check(const Shape& s) const override {
    const std::int64_t heads = s["num_heads"], kv = s["num_kv_heads"], head_dim = s["head_dim"];
    if (heads % kv != 0)
      return FieldError{"num_kv_heads",
                        "expected a divisor of num_heads (" + std::to_string(heads) + "), got " + std::to_string(kv)};
    if (head_dim % 2 != 0)
      return FieldError{"head_dim", "expected an even integer (rotary embedding), got " + std::to_string(head_dim)};
    // Every product of sizes stays far inside 64-bit indexing.
    const double params = static_cast<double>(config_from_shape(s).parameter_count());
    if (params > 1e12)
      return FieldError{"hidden_size", "the shape has " + std::to_string(params) + " parameters, more than 1e12"};
    return std::nullopt;
  }
  std::optional<FieldError> check_hf(const nlohmann::json& j) const override {
    if (j.contains("model_type") && j["model_type"] != "qwen3") {
      return FieldError{"model_type", "expected 'qwen3', got " + describe_value(j["model_type"])};
    }
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
      return FieldError{"rope_scaling", "rope scaling is not supported (expected null)"};
    }
    if (j.contains("rope_parameters")) {
      const auto& rope = j["rope_parameters"];
      if (!rope.is_object()) return FieldError{"rope_parameters", "expected a mapping"};
      for (const auto& [key, value] : rope.items()) {
        if (key == "rope_theta") continue;
        if (key == "rope_type" && value == "default") continue;
        return FieldError{"rope_parameters." + key,
                          "only the default rotary embedding is supported, got " + describe_value(value)};
      }
    }
    const auto set = [&](const char* key) { return j.contains(key) && !j[key].is_null() && j[key] != false; };
    if (set("use_sliding_window")) {
      return FieldError{"use_sliding_window", "sliding-window attention is not supported (expected false)"};
    }
    if (j.contains("layer_types") && j["layer_types"].is_array()) {
      for (const auto& t : j["layer_types"]) {
        if (t != "full_attention")
          return FieldError{"layer_types", "only full_attention layers are supported, got " + describe_value(t)};
      }
    }
    if (set("attention_bias"))
      return FieldError{"attention_bias", "attention biases are not supported (expected false)"};
    if (j.contains("hidden_act") && j["hidden_act"] != "silu") {
      return FieldError{"hidden_act", "expected 'silu', got " + describe_value(j["hidden_act"])};
    }
    for (const char* key : {"dtype", "torch_dtype"}) {
      if (j.contains(key) && !j[key].is_null() && j[key] != "float32" && j[key] != "bfloat16" && j[key] != "float16") {
        return FieldError{key, "expected float32, bfloat16 or float16, got " + describe_value(j[key])};
      }
    }
    return std::nullopt;
  }
  std::unique_ptr<ModelSpec> spec(const Shape& shape) const override { return std::make_unique<Qwen3Spec>(shape); }
};

}  // namespace

Qwen3Config config_from_shape(const Shape& s) {
  Qwen3Config c;
  for (const Bound& row : bound_table()) {
    std::visit(
        [&](auto member) {
          if constexpr (!std::is_same_v<decltype(member), std::monostate>) {
            c.*member = s.at(row.field.key).get<std::remove_reference_t<decltype(c.*member)>>();
          }
        },
        row.member);
  }
  return c;
}

Shape shape_from_config(const Qwen3Config& c, Recompute recompute) {
  Shape s = Shape::object();
  for (const Bound& row : bound_table()) {
    std::visit(
        [&](auto member) {
          if constexpr (!std::is_same_v<decltype(member), std::monostate>) s[row.field.key] = c.*member;
        },
        row.member);
  }
  s["recompute"] = recompute == Recompute::none ? "none" : recompute == Recompute::mlp ? "mlp" : "full";
  return s;
}

Qwen3Config preset(const std::string& name) {
  for (const auto& [preset_name, values] : preset_table()) {
    if (preset_name != name) continue;
    Shape s = shape_from_config(kDefaults);
    s.update(values);
    return config_from_shape(s);
  }
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw core::InputError("unknown Qwen3 preset '" + name + "' (known: " + known + ")");
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, _] : preset_table()) names.push_back(name);
  return names;
}

void validate(const Qwen3Config& config, const std::string& where) {
  check_shape(qwen3_family(), shape_from_config(config), where);
}

const Family& qwen3_family() {
  static const Qwen3Family family;
  return family;
}

}  // namespace models::qwen3
