// The optimizer section of a YAML config: accepted values and clear errors for bad ones.
#include <gtest/gtest.h>

#include "core/error.h"
#include "trainer/optimizer_yaml.h"

namespace {

optim::OptimizerConfig parse(const std::string& text) {
  return trainer::optimizer_config_from_yaml(YAML::Load(text)["optimizer"], "run.yaml");
}

std::string error_of(const std::string& text) {
  try {
    parse(text);
  } catch (const core::InputError& e) {
    return e.what();
  }
  return "";
}

TEST(OptimizerConfig, ReadsAllKeys) {
  const auto c = parse(
      "optimizer:\n  type: adamw\n  lr: 6e-4\n  betas: [0.8, 0.99]\n  eps: 1e-6\n  weight_decay: 0.05\n"
      "  grad_clip: 0.5\n  nonfinite: zero_element\n");
  EXPECT_EQ(c.type, "adamw");
  EXPECT_DOUBLE_EQ(c.lr, 6e-4);
  EXPECT_DOUBLE_EQ(c.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.beta2, 0.99);
  EXPECT_DOUBLE_EQ(c.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.weight_decay, 0.05);
  EXPECT_DOUBLE_EQ(c.grad_clip, 0.5);
  EXPECT_EQ(c.nonfinite, optim::NonFinitePolicy::zero_element);
  EXPECT_EQ(parse("optimizer: {lr: 1e-3}").nonfinite, optim::NonFinitePolicy::skip_step);

  const auto q = parse("optimizer: {type: adamw8bit, min_8bit_size: 100, quantization: linear}");
  EXPECT_EQ(q.adamw8bit.min_8bit_size, 100);
  EXPECT_EQ(q.adamw8bit.quantization, optim::Quantization::linear);

  const auto a = parse(
      "optimizer: {type: adafactor, eps1: 1e-29, eps2: 2e-3, clip_threshold: 2, decay_rate: -0.5, beta1: 0.9,"
      " relative_step: false, scale_parameter: false, warmup_init: true, eps1_mode: clamp, decay_scale: alpha}");
  EXPECT_DOUBLE_EQ(a.adafactor.eps1, 1e-29);
  EXPECT_DOUBLE_EQ(a.adafactor.eps2, 2e-3);
  EXPECT_DOUBLE_EQ(a.adafactor.clip_threshold, 2.0);
  EXPECT_DOUBLE_EQ(a.adafactor.decay_rate, -0.5);
  ASSERT_TRUE(a.adafactor.beta1.has_value());
  EXPECT_DOUBLE_EQ(*a.adafactor.beta1, 0.9);
  EXPECT_FALSE(a.adafactor.relative_step);
  EXPECT_FALSE(a.adafactor.scale_parameter);
  EXPECT_TRUE(a.adafactor.warmup_init);
  EXPECT_EQ(a.adafactor.eps1_mode, optim::Eps1Mode::clamp);
  EXPECT_EQ(a.adafactor.decay_scale, optim::DecayScale::alpha);
  EXPECT_FALSE(parse("optimizer: {type: adafactor, beta1: null}").adafactor.beta1.has_value());
}

TEST(OptimizerConfig, RejectsBadValuesNamingFileLineAndKey) {
  struct Case {
    std::string yaml, expected;
  };
  const Case cases[] = {
      {"optimizer:\n  lr: 1e-3\n  betta: 0.9\n", "run.yaml:3: optimizer.betta: unknown key"},
      {"optimizer:\n  betas: [0.9, 1.0]\n", "optimizer.betas[1]: expected a number in [0, 1), got 1.0"},
      {"optimizer:\n  betas: 0.9\n", "run.yaml:2: optimizer.betas: expected a list of two numbers"},
      {"optimizer:\n  lr: fast\n", "run.yaml:2: optimizer.lr: expected a number, got 'fast'"},
      {"optimizer:\n  lr: -1\n", "optimizer.lr: expected a finite number >= 0"},
      {"optimizer:\n  eps: 0\n", "optimizer.eps: expected a finite number > 0"},
      {"optimizer:\n  nonfinite: ignore\n",
       "run.yaml:2: optimizer.nonfinite: expected one of [skip_step, zero_element], got 'ignore'"},
      {"optimizer:\n  type: sgd\n", "optimizer.type: expected one of [adamw, adamw8bit, adafactor], got 'sgd'"},
      {"optimizer:\n  type: adamw\n  eps1: 1e-30\n",
       "run.yaml:3: optimizer.eps1: applies to adafactor only, but optimizer.type is 'adamw'"},
      {"optimizer:\n  type: adafactor\n  betas: [0.9, 0.9]\n", "optimizer.betas: applies to adamw, adamw8bit only"},
      {"optimizer:\n  type: adamw8bit\n  quantization: fp4\n",
       "optimizer.quantization: expected one of [companded, linear], got 'fp4'"},
      {"optimizer:\n  type: adamw8bit\n  min_8bit_size: 1.5\n", "optimizer.min_8bit_size: expected an integer"},
      {"optimizer:\n  type: adafactor\n  relative_step: maybe\n",
       "optimizer.relative_step: expected true or false, got 'maybe'"},
      {"optimizer:\n  type: adafactor\n  decay_rate: 0.8\n", "optimizer.decay_rate: expected a number in [-1, 0)"},
      {"optimizer:\n  type: adafactor\n  beta1: 1.5\n", "optimizer.beta1: expected a number in [0, 1) or null"},
      {"optimizer:\n  grad_clip: -0.5\n", "optimizer.grad_clip: expected a finite number >= 0"},
      {"optimizer: 3\n", "run.yaml: optimizer: expected a mapping"},
  };
  for (const auto& c : cases) {
    const std::string what = error_of(c.yaml);
    EXPECT_NE(what.find(c.expected), std::string::npos) << "yaml:\n" << c.yaml << "\nerror: '" << what << "'";
  }
}

}  // namespace
