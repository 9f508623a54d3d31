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

  const auto m = parse(
      "optimizer: {type: muon, lr: 1e-3, betas: [0.9, 0.98], eps: 1e-7, weight_decay: 0.01, muon: {lr: 0.02, "
      "momentum: 0.9, nesterov: false, ns_steps: 4, eps: 1e-6, weight_decay: 0.2, adjust_lr: match_rms_adamw}}");
  EXPECT_EQ(m.type, "muon");
  EXPECT_DOUBLE_EQ(m.beta2, 0.98);
  EXPECT_DOUBLE_EQ(m.muon.lr, 0.02);
  EXPECT_DOUBLE_EQ(m.muon.momentum, 0.9);
  EXPECT_FALSE(m.muon.nesterov);
  EXPECT_EQ(m.muon.ns_steps, 4);
  EXPECT_DOUBLE_EQ(m.muon.eps, 1e-6);
  ASSERT_TRUE(m.muon.weight_decay.has_value());
  EXPECT_DOUBLE_EQ(*m.muon.weight_decay, 0.2);
  EXPECT_EQ(m.muon.adjust_lr, optim::MuonAdjustLr::match_rms_adamw);
  const auto defaults = parse("optimizer: {type: muon}");
  EXPECT_EQ(defaults.muon, optim::MuonConfig{});
  EXPECT_FALSE(defaults.muon.weight_decay.has_value());
}

TEST(OptimizerConfig, MuonWritesBackWhatItReads) {
  const auto m = parse("optimizer: {type: muon, muon: {lr: 0.02, nesterov: false, adjust_lr: match_rms_adamw}}");
  YAML::Emitter out;
  out << YAML::BeginMap;
  trainer::emit_optimizer_config(out, m);
  out << YAML::EndMap;
  const auto again = trainer::optimizer_config_from_yaml(YAML::Load(out.c_str()), "written.yaml");
  EXPECT_EQ(again, m);
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
      {"optimizer:\n  type: sgd\n", "optimizer.type: expected one of [adamw, adamw8bit, adafactor, muon], got 'sgd'"},
      {"optimizer:\n  type: adamw\n  eps1: 1e-30\n",
       "run.yaml:3: optimizer.eps1: applies to adafactor only, but optimizer.type is 'adamw'"},
      {"optimizer:\n  type: adafactor\n  betas: [0.9, 0.9]\n",
       "optimizer.betas: applies to adamw, adamw8bit, muon only"},
      {"optimizer:\n  type: adamw8bit\n  quantization: fp4\n",
       "optimizer.quantization: expected one of [companded, linear], got 'fp4'"},
      {"optimizer:\n  type: adamw8bit\n  min_8bit_size: 1.5\n", "optimizer.min_8bit_size: expected an integer"},
      {"optimizer:\n  type: adafactor\n  relative_step: maybe\n",
       "optimizer.relative_step: expected true or false, got 'maybe'"},
      {"optimizer:\n  type: adafactor\n  decay_rate: 0.8\n", "optimizer.decay_rate: expected a number in [-1, 0)"},
      {"optimizer:\n  type: adafactor\n  beta1: 1.5\n", "optimizer.beta1: expected a number in [0, 1) or null"},
      {"optimizer:\n  grad_clip: -0.5\n", "optimizer.grad_clip: expected a finite number >= 0"},
      {"optimizer: 3\n", "run.yaml: optimizer: expected a mapping"},
      {"optimizer:\n  type: adamw\n  muon: {lr: 0.02}\n",
       "run.yaml:3: optimizer.muon: applies to muon only, but optimizer.type is 'adamw'"},
      {"optimizer:\n  type: muon\n  muon: 0.02\n", "run.yaml:3: optimizer.muon: expected a mapping of Muon settings"},
      {"optimizer:\n  type: muon\n  muon:\n    lr: 0.02\n    momentun: 0.9\n",
       "run.yaml:5: optimizer.muon.momentun: unknown key (known: lr, momentum, nesterov, ns_steps, eps, weight_decay, "
       "adjust_lr)"},
      {"optimizer:\n  type: muon\n  muon: {[1]: 2}\n", "optimizer.muon.a non-scalar value: unknown key"},
      {"optimizer:\n  type: muon\n  muon: {momentum: 1.0}\n", "optimizer.muon.momentum: expected a number in [0, 1)"},
      {"optimizer:\n  type: muon\n  muon: {lr: fast}\n",
       "run.yaml:3: optimizer.muon.lr: expected a number, got 'fast'"},
      {"optimizer:\n  type: muon\n  muon: {ns_steps: 0}\n", "optimizer.muon.ns_steps: expected an integer in [1, 99]"},
      {"optimizer:\n  type: muon\n  muon: {ns_steps: 2.5}\n", "optimizer.muon.ns_steps: expected an integer"},
      {"optimizer:\n  type: muon\n  muon: {nesterov: maybe}\n",
       "optimizer.muon.nesterov: expected true or false, got 'maybe'"},
      {"optimizer:\n  type: muon\n  muon: {eps: 0}\n", "optimizer.muon.eps: expected a finite number > 0"},
      {"optimizer:\n  type: muon\n  muon: {weight_decay: -1}\n", "optimizer.muon.weight_decay: expected a finite"},
      {"optimizer:\n  type: muon\n  muon: {adjust_lr: spectral}\n",
       "optimizer.muon.adjust_lr: expected one of [match_rms_adamw, original], got 'spectral'"},
  };
  for (const auto& c : cases) {
    const std::string what = error_of(c.yaml);
    EXPECT_NE(what.find(c.expected), std::string::npos) << "yaml:\n" << c.yaml << "\nerror: '" << what << "'";
  }
}

}  // namespace
