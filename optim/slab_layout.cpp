#include "optim/slab_layout.h"

#include <algorithm>
#include <unordered_set>

#include "core/error.h"

namespace optim {

namespace {
std::int64_t round_up(std::int64_t x, std::int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }
}  // namespace

void SlabLayout::add_parameters(const SlabTensor& stored, std::unordered_set<std::string>& names) {
  const ParamSpec& spec = stored.spec;
  if (spec.parts.empty()) {
    parameters_.push_back(stored);
    return;
  }
  if (spec.shape.size() != 2) {
    throw core::Error("slab layout: parameter '" + spec.name + "' has parts but shape " + core::shape_str(spec.shape) +
                      " (parts are row blocks of a 2-D tensor)");
  }
  const std::int64_t cols = spec.shape[1];
  std::int64_t rows = 0;
  bool aligned = true;
  for (const ParamPart& part : spec.parts) {
    if (part.rows <= 0 || part.name.empty() || !names.insert(part.name).second) {
      throw core::Error("slab layout: parameter '" + spec.name +
                        "' has a part with no rows, no name or a duplicate name ('" + part.name + "')");
    }
    if (rows * cols % kTensorAlignment != 0) aligned = false;
    rows += part.rows;
  }
  if (rows != spec.shape[0]) {
    throw core::Error("slab layout: the parts of '" + spec.name + "' have " + std::to_string(rows) +
                      " rows, the tensor " + std::to_string(spec.shape[0]));
  }
  if (!aligned) {
    unsplit_.push_back(spec.name);
    parameters_.push_back(stored);
    return;
  }
  std::int64_t row = 0;
  for (const ParamPart& part : spec.parts) {
    SlabTensor logical = stored;
    logical.spec.name = part.name;
    logical.spec.shape = {part.rows, cols};
    logical.spec.parts.clear();
    logical.offset = stored.offset + row * cols;
    logical.numel = part.rows * cols;
    parameters_.push_back(std::move(logical));
    row += part.rows;
  }
}

Range Range::intersect(const Range& r) const {
  const std::int64_t b = std::max(begin, r.begin);
  const std::int64_t e = std::min(end, r.end);
  return e > b ? Range{b, e} : Range{b, b};
}

SlabLayout::SlabLayout(std::vector<ParamSpec> specs, int world_size) : world_size_(world_size) {
  if (world_size < 1) throw core::Error("slab layout: world size must be >= 1, got " + std::to_string(world_size));
  std::unordered_set<std::string> names;
  std::int64_t cursor = 0;
  tensors_.reserve(specs.size());
  for (auto& spec : specs) {
    if (spec.name.empty())
      throw core::Error("slab layout: parameter #" + std::to_string(tensors_.size()) + " has no name");
    if (!names.insert(spec.name).second) throw core::Error("slab layout: duplicate parameter name '" + spec.name + "'");
    for (std::int64_t d : spec.shape) {
      if (d < 0) {
        throw core::Error("slab layout: parameter '" + spec.name + "' has negative dimension in shape " +
                          core::shape_str(spec.shape));
      }
    }
    if (spec.factored && spec.shape.size() != 2) {
      throw core::Error("slab layout: parameter '" + spec.name + "' is marked factored but has shape " +
                        core::shape_str(spec.shape) + " (factored tensors must be 2-D)");
    }
    SlabTensor t;
    t.numel = core::shape_numel(spec.shape);
    t.offset = cursor;
    t.stored = static_cast<int>(tensors_.size());
    t.spec = std::move(spec);
    cursor = round_up(cursor + t.numel, kTensorAlignment);
    add_parameters(t, names);
    tensors_.push_back(std::move(t));
  }
  used_ = cursor;
  total_ = round_up(std::max<std::int64_t>(used_, 1), static_cast<std::int64_t>(world_size) * kShardBlock);
}

std::int64_t SlabLayout::parameter_count() const {
  std::int64_t n = 0;
  for (const auto& t : tensors_) n += t.numel;
  return n;
}

Range SlabLayout::shard(int rank) const {
  if (rank < 0 || rank >= world_size_) {
    throw core::Error("slab layout: rank " + std::to_string(rank) + " outside world of " + std::to_string(world_size_));
  }
  const std::int64_t s = shard_elements();
  return {rank * s, (rank + 1) * s};
}

int SlabLayout::find(std::string_view name) const {
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].spec.name == name) return static_cast<int>(i);
  }
  return -1;
}

const SlabTensor& SlabLayout::tensor(std::string_view name) const {
  const int i = find(name);
  if (i < 0) throw core::Error("slab layout: no parameter named '" + std::string(name) + "'");
  return tensors_[static_cast<std::size_t>(i)];
}

}  // namespace optim
