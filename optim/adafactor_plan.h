// The work lists and buffer layouts of a fused Adafactor step, built once on the host from the
// slab's segments and shared by the CPU reference and the CUDA kernels.
//
// Factored tensors are processed in tiles of whole rows (up to kAdafactorTileRows rows, every
// column), so each element's row and column are known without division; other tensors in flat
// chunks. Per-rank partial statistics live in two small "statistics slabs" of doubles whose
// layout depends only on the model (not on the rank), so ranks can sum them with one all-reduce:
//   stats:   for each factored tensor its row sums (R values) then column sums (C values) of g*g,
//            then for each tensor the sum of its squared weights;
//   u_stats: for each tensor the sum of U*U.
#pragma once

#include <cstdint>
#include <vector>

#include "optim/segments.h"
#include "optim/slab_layout.h"

namespace optim {

inline constexpr int kAdafactorTileRows = 64;
inline constexpr int kAdafactorReduceColumns = 32;  // columns per reduction item (one per lane)
inline constexpr int kAdafactorEmaSpan = 2048;      // row or column statistics per EMA item

enum AdafactorItemKind : std::int32_t { kChunkItem = 0, kTileItem = 1 };

// One unit of element work: a chunk of a non-factored segment or a tile of a factored one.
struct AdafactorItem {
  std::int64_t first = 0;          // chunk: first global element; tile: global index of (row0, column 0)
  std::int64_t col_partials = -1;  // tile: offset of its column partial sums (cols floats)
  std::int32_t count = 0;          // chunk: elements; tile: rows
  std::int32_t row0 = 0;           // tile: first row
  std::int32_t segment = 0;
  std::int32_t kind = kChunkItem;
};

// Per owned segment: where its items, statistics and state live.
struct AdafactorSegment {
  std::int64_t first_item = 0;  // its items are [first_item, first_item + item_count)
  std::int64_t item_count = 0;
  std::int64_t row_stats = -1;         // factored: offset of the row sums in `stats` (cols follow rows)
  std::int64_t row_state = -1;         // factored: offset of R in the row/column state (C follows R)
  std::int64_t v_state = -1;           // non-factored: offset of its full v in the compact v state
  std::int64_t weight_stats = 0;       // offset of its weight sum of squares in `stats`
  std::int64_t u_stats = 0;            // offset of its sum of U*U in `u_stats`
  std::int64_t first_col_partial = 0;  // factored: column partials of its first tile
  std::int64_t first_row_partial = 0;  // factored: partial sums of its updated R (mean of R)
  std::int64_t row_partial_count = 0;
  double numel = 0;  // elements of the whole tensor
  std::int32_t tensor = 0;
  std::int32_t factored = 0;
};

// A reduction of per-item partials into a statistics slab entry.
enum AdafactorReduceKind : std::int32_t { kReduceColumns = 0, kReduceWeights = 1, kReduceU = 2, kReduceGrad = 3 };
struct AdafactorReduceItem {
  std::int32_t segment = 0;
  std::int32_t kind = kReduceColumns;
  std::int32_t col0 = 0;  // kReduceColumns: first of up to kAdafactorReduceColumns columns
};

// A range of one factored tensor's row (or column) statistics whose EMA one block updates;
// row ranges also write the sum of their new values (partial sums of mean(R)).
struct AdafactorEmaItem {
  std::int64_t begin = 0;
  std::int32_t count = 0;
  std::int32_t segment = 0;
  std::int32_t rows = 1;          // 1: row statistics, 0: column statistics
  std::int32_t row_partial = -1;  // rows: index of its partial sum
};

struct AdafactorPlan {
  std::vector<AdafactorItem> items;
  std::vector<AdafactorSegment> segments;         // parallel to the slab's owned segments
  std::vector<AdafactorReduceItem> reduce_stats;  // columns, weight sums, and (last) the gradient norm
  std::vector<AdafactorReduceItem> reduce_u;      // sums of U*U
  std::vector<AdafactorEmaItem> ema_items;        // statistics EMA work (factored segments)
  std::int64_t stats_size = 0;                    // doubles in `stats`
  std::int64_t u_stats_size = 0;                  // doubles in `u_stats`
  std::int64_t row_col_state_size = 0;            // floats of R and C for every factored tensor
  std::int64_t v_state_size = 0;                  // floats of full v for owned non-factored segments
  std::int64_t col_partials_size = 0;             // floats of tile column partials
  std::int64_t row_partials_size = 0;             // doubles of partial sums of R
  std::int64_t factored_tensors = 0;
};

// `chunk_elements`: size of flat chunks (a positive multiple of 64).
AdafactorPlan make_adafactor_plan(const SlabLayout& layout, const std::vector<Segment>& segments,
                                  std::int64_t chunk_elements);

}  // namespace optim
