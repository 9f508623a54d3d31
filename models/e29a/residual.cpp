// The residual stream's update between E29a layers on the cpu (residual.h).
#include "models/e29a/residual.h"

#include <algorithm>

#include "models/ops/rmsnorm.h"

namespace models::e29a {

void residual_forward_cpu(Residual kind, std::span<const float> y, std::int64_t rows, std::int64_t dim, double eps,
                          std::span<float> x, ResidualSaved* saved) {
  for (std::size_t i = 0; i < x.size(); ++i) x[i] += y[i];
  if (kind == Residual::pre_norm) return;
  ResidualSaved local;
  ResidualSaved& s = saved != nullptr ? *saved : local;
  s.sum.assign(x.begin(), x.end());
  s.rstd.resize(static_cast<std::size_t>(rows));
  const std::vector<float> unit(static_cast<std::size_t>(dim), 1.0f);
  ops::rmsnorm_forward_cpu<float>(s.sum, unit, rows, dim, eps, x, s.rstd);
}

void residual_backward_cpu(Residual kind, const ResidualSaved& saved, std::int64_t rows, std::int64_t dim,
                           std::span<float> dx) {
  if (kind == Residual::pre_norm) return;
  const std::vector<float> unit(static_cast<std::size_t>(dim), 1.0f);
  std::vector<float> dsum(dx.size()), dunit(unit.size());  // the unit weight's gradient is not used
  ops::rmsnorm_backward_cpu<float>(dx, saved.sum, unit, saved.rstd, rows, dim, dsum, dunit);
  std::copy(dsum.begin(), dsum.end(), dx.begin());
}

}  // namespace models::e29a
