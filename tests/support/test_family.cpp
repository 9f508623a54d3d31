#include "test_family.h"

#include <cmath>

#include "core/error.h"
#include "models/model_config.h"

namespace test {

namespace {

using models::ConfigField;
using models::FieldType;

const std::vector<ConfigField>& table() {
  static const std::vector<ConfigField> fields = {
      {.key = "vocab_size",
       .hf_key = "vocab_size",
       .type = FieldType::integer,
       .fallback = 256,
       .hf_default = nullptr,
       .min = 1,
       .max = 1 << 20},
      {.key = "hidden_size",
       .hf_key = "hidden_size",
       .type = FieldType::integer,
       .fallback = 16,
       .hf_default = nullptr,
       .min = 1,
       .max = 4096},
  };
  return fields;
}

// Parameters: embed [V, D], proj [D, D], bias [D], head [V, D].
class BigramCpu final : public models::TrainableModel {
 public:
  BigramCpu(std::int64_t vocab, std::int64_t dim, optim::Slab& slab, const float* full)
      : v_(vocab), d_(dim), slab_(slab), full_(full) {}

  void forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                        float grad_scale) override {
    run(ids, targets, batch * seq, true, grad_scale);
  }
  void forward_loss(const std::int32_t* ids, const std::int32_t* targets, std::int64_t batch,
                    std::int64_t seq) override {
    run(ids, targets, batch * seq, false, 0.0f);
  }
  const float* loss() const override { return &loss_; }

 private:
  const float* weight(int t) const {
    const auto& tensor = slab_.layout().tensors()[static_cast<std::size_t>(t)];
    return full_ != nullptr ? full_ + tensor.offset
                            : slab_.master().as<float>() + (tensor.offset - slab_.owned().begin);
  }
  float* grad(int t) { return slab_.grad_origin() + slab_.layout().tensors()[static_cast<std::size_t>(t)].offset; }

  void run(const std::int32_t* ids, const std::int32_t* targets, std::int64_t n, bool backward, float scale) {
    const float *E = weight(0), *A = weight(1), *b = weight(2), *U = weight(3);
    double total = 0;
    std::int64_t counted = 0;
    std::vector<double> h(static_cast<std::size_t>(d_)), p(static_cast<std::size_t>(v_));
    for (std::int64_t i = 0; i < n; ++i) {
      if (targets[i] < 0) continue;
      ++counted;
    }
    for (std::int64_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= v_)
        throw core::InputError("bigram: token id " + std::to_string(ids[i]) + " outside the vocabulary");
      if (targets[i] < 0) continue;
      const float* e = E + ids[i] * d_;
      for (std::int64_t r = 0; r < d_; ++r) {
        double s = b[r];
        for (std::int64_t c = 0; c < d_; ++c) s += static_cast<double>(A[r * d_ + c]) * e[c];
        h[static_cast<std::size_t>(r)] = std::tanh(s);
      }
      double top = -1e300;
      for (std::int64_t v = 0; v < v_; ++v) {
        double s = 0;
        for (std::int64_t c = 0; c < d_; ++c) s += static_cast<double>(U[v * d_ + c]) * h[static_cast<std::size_t>(c)];
        p[static_cast<std::size_t>(v)] = s;
        top = std::max(top, s);
      }
      double z = 0;
      for (auto& x : p) z += std::exp(x - top);
      total += top + std::log(z) - p[static_cast<std::size_t>(targets[i])];
      if (!backward) continue;
      const double g = scale / static_cast<double>(counted);
      std::vector<double> dh(static_cast<std::size_t>(d_), 0.0);
      for (std::int64_t v = 0; v < v_; ++v) {
        const double dz = g * (std::exp(p[static_cast<std::size_t>(v)] - top) / z - (v == targets[i] ? 1.0 : 0.0));
        for (std::int64_t c = 0; c < d_; ++c) {
          grad(3)[v * d_ + c] += static_cast<float>(dz * h[static_cast<std::size_t>(c)]);
          dh[static_cast<std::size_t>(c)] += dz * U[v * d_ + c];
        }
      }
      for (std::int64_t r = 0; r < d_; ++r) {
        const double ds =
            dh[static_cast<std::size_t>(r)] * (1 - h[static_cast<std::size_t>(r)] * h[static_cast<std::size_t>(r)]);
        grad(2)[r] += static_cast<float>(ds);
        for (std::int64_t c = 0; c < d_; ++c) {
          grad(1)[r * d_ + c] += static_cast<float>(ds * e[c]);
          grad(0)[ids[i] * d_ + c] += static_cast<float>(ds * A[r * d_ + c]);
        }
      }
    }
    loss_ = counted > 0 ? static_cast<float>(total / static_cast<double>(counted)) : 0.0f;
  }

  std::int64_t v_, d_;
  optim::Slab& slab_;
  const float* full_;
  float loss_ = 0;
};

class BigramSpec final : public models::ModelSpec {
 public:
  explicit BigramSpec(const models::Shape& shape)
      : shape_(shape), v_(shape.at("vocab_size")), d_(shape.at("hidden_size")) {
    params_ = {
        {.name = "embed", .shape = {v_, d_}, .decay = true, .factored = true},
        {.name = "proj", .shape = {d_, d_}, .decay = true, .factored = true, .init = optim::InitKind::xavier_uniform},
        {.name = "bias", .shape = {d_}, .decay = false, .init = optim::InitKind::zeros},
        {.name = "head", .shape = {v_, d_}, .decay = true, .factored = true}};
  }
  const std::string& family() const override { return name_; }
  const models::Shape& shape() const override { return shape_; }
  const std::vector<optim::ParamSpec>& parameters() const override { return params_; }
  std::int64_t vocab_size() const override { return v_; }
  std::int64_t max_sequence_length() const override { return 1 << 20; }
  double flops_per_token(std::int64_t) const override { return 6.0 * static_cast<double>(parameter_count()); }
  bool streams_gradients() const override { return false; }
  bool consumes_weights_by_layer() const override { return false; }
  std::string hf_architecture() const override { return "BigramForTests"; }
  nlohmann::ordered_json hf_config(const nlohmann::json& carried) const override {
    nlohmann::ordered_json j = {{"architectures", {"BigramForTests"}}, {"model_type", "bigram"}};
    const nlohmann::ordered_json fields = models::hf_fields(bigram_family(), shape_);
    j.update(fields);
    return j;
  }
  std::vector<models::HfTensor> hf_tensors() const override {
    return {{.name = "embed.weight", .param = 0, .row_offset = 0, .rows = v_, .shape = {v_, d_}},
            {.name = "proj.weight", .param = 1, .row_offset = 0, .rows = d_, .shape = {d_, d_}},
            {.name = "proj.bias", .param = 2, .row_offset = 0, .rows = d_, .shape = {d_}},
            {.name = "head.weight", .param = 3, .row_offset = 0, .rows = v_, .shape = {v_, d_}}};
  }
  std::unique_ptr<models::TrainableModel> trainable(optim::Slab& slab, const core::DeviceContext& context,
                                                    const models::TrainableOptions& options) const override {
    if (context.is_cuda()) throw core::InputError("the bigram test family runs on the cpu only (device: cpu)");
    return std::make_unique<BigramCpu>(v_, d_, slab, options.full_weights);
  }

 private:
  std::string name_ = "bigram";
  models::Shape shape_;
  std::int64_t v_, d_;
  std::vector<optim::ParamSpec> params_;
};

class BigramFamily final : public models::Family {
 public:
  std::string name() const override { return "bigram"; }
  std::string hf_architecture() const override { return "BigramForTests"; }
  const std::vector<ConfigField>& fields() const override { return table(); }
  std::vector<std::string> presets() const override { return {"bigram-test"}; }
  models::Shape preset(const std::string& name) const override {
    if (name != "bigram-test") throw core::InputError("unknown bigram preset '" + name + "'");
    return {{"vocab_size", 256}, {"hidden_size", 12}};
  }
  std::optional<models::FieldError> check(const models::Shape&) const override { return std::nullopt; }
  std::optional<models::FieldError> check_hf(const nlohmann::json&) const override { return std::nullopt; }
  std::unique_ptr<models::ModelSpec> spec(const models::Shape& shape) const override {
    return std::make_unique<BigramSpec>(shape);
  }
};

}  // namespace

const models::Family& bigram_family() {
  static const BigramFamily family;
  return family;
}

}  // namespace test
