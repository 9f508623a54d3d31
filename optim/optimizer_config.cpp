#include "optim/optimizer_config.h"

#include <cmath>

#include "core/error.h"

namespace optim {

namespace {

void check(bool ok, const std::string& where, const std::string& key, const std::string& expected, double value) {
  if (!ok) {
    throw core::InputError(where + ": optimizer." + key + ": expected " + expected + ", got " + std::to_string(value));
  }
}

}  // namespace

const char* nonfinite_policy_name(NonFinitePolicy policy) {
  return policy == NonFinitePolicy::skip_step ? "skip_step" : "zero_element";
}

void validate(const OptimizerConfig& c, const std::string& where) {
  if (c.type != "adamw" && c.type != "adamw8bit" && c.type != "adafactor" && c.type != "muon") {
    throw core::InputError(where + ": optimizer.type: expected one of [adamw, adamw8bit, adafactor, muon], got '" +
                           c.type + "'");
  }
  check(std::isfinite(c.lr) && c.lr >= 0, where, "lr", "a finite number >= 0", c.lr);
  check(c.beta1 >= 0 && c.beta1 < 1, where, "betas[0]", "a number in [0, 1)", c.beta1);
  check(c.beta2 >= 0 && c.beta2 < 1, where, "betas[1]", "a number in [0, 1)", c.beta2);
  check(std::isfinite(c.eps) && c.eps > 0, where, "eps", "a finite number > 0", c.eps);
  check(std::isfinite(c.weight_decay) && c.weight_decay >= 0, where, "weight_decay", "a finite number >= 0",
        c.weight_decay);
  check(std::isfinite(c.grad_clip) && c.grad_clip >= 0, where, "grad_clip", "a finite number >= 0 (0 disables)",
        c.grad_clip);
  check(c.adamw8bit.min_8bit_size >= 0, where, "min_8bit_size", "an integer >= 0",
        static_cast<double>(c.adamw8bit.min_8bit_size));
  const AdafactorConfig& a = c.adafactor;
  check(std::isfinite(a.eps1) && a.eps1 >= 0, where, "eps1", "a finite number >= 0", a.eps1);
  check(std::isfinite(a.eps2) && a.eps2 >= 0, where, "eps2", "a finite number >= 0", a.eps2);
  check(std::isfinite(a.clip_threshold) && a.clip_threshold > 0, where, "clip_threshold", "a finite number > 0",
        a.clip_threshold);
  check(a.decay_rate < 0 && a.decay_rate >= -1, where, "decay_rate", "a number in [-1, 0)", a.decay_rate);
  if (a.beta1) check(*a.beta1 >= 0 && *a.beta1 < 1, where, "beta1", "a number in [0, 1) or null", *a.beta1);
  const MuonConfig& m = c.muon;
  check(std::isfinite(m.lr) && m.lr >= 0, where, "muon.lr", "a finite number >= 0", m.lr);
  check(m.momentum >= 0 && m.momentum < 1, where, "muon.momentum", "a number in [0, 1)", m.momentum);
  check(m.ns_steps >= 1 && m.ns_steps < 100, where, "muon.ns_steps", "an integer in [1, 99]",
        static_cast<double>(m.ns_steps));
  check(std::isfinite(m.eps) && m.eps > 0, where, "muon.eps", "a finite number > 0", m.eps);
  if (m.weight_decay) {
    check(std::isfinite(*m.weight_decay) && *m.weight_decay >= 0, where, "muon.weight_decay",
          "a finite number >= 0 or null (null: optimizer.weight_decay)", *m.weight_decay);
  }
}

}  // namespace optim
