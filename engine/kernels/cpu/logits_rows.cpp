// The sampler's per-row reductions over fp32 logits on the CPU, in one pass:
//
//   argmax_finite: per row, whether every value of the row is finite, and the index of its
//                  greatest value (the first of equal ones, as torch.argmax; for a row that is
//                  not all finite the index is unspecified: the sampler fails such rows)
//
// torch runs these as six ops (argmax; isfinite as eq, abs, ne, and; all), each a pass over
// [rows, vocab], a noticeable part of a decode step; here it is one. Rows are split over
// torch's threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "cpu_vector.h"

namespace {

using namespace prefixgate;

// One row: its argmax, and whether it is all finite.
std::pair<int64_t, bool> argmax_finite_row(const float* x, int64_t width) {
  const vint lane = to_int(lane_index());
  vfloat best = splat(-std::numeric_limits<float>::infinity());
  vint at = splat_int(std::numeric_limits<int32_t>::max());  // each lane's best index
  vint bad = splat_int(0);
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    const vfloat value = load(x + i);
    bad |= (value - value) != 0.0f;  // NaN for infinities and NaN, 0 for every finite value
    const vmask better = value > best;  // strictly: a lane keeps its first greatest
    best = where(better, value, best);
    at = where(better, lane + static_cast<int32_t>(i), at);
  }
  float top = -std::numeric_limits<float>::infinity();
  int64_t index = -1;
  bool finite = true;
  for (int64_t k = 0; k < kLanes; ++k) {
    finite = finite && bad[k] == 0;
    if (at[k] == std::numeric_limits<int32_t>::max()) continue;  // never above -inf
    if (best[k] > top || (best[k] == top && at[k] < index)) {
      top = best[k];
      index = at[k];
    }
  }
  for (; i < width; ++i) {  // the tail, after every full vector: later indices
    finite = finite && x[i] - x[i] == 0.0f;
    if (x[i] > top) {
      top = x[i];
      index = i;
    }
  }
  return {index < 0 ? 0 : index, finite};  // all -inf: 0, as torch.argmax
}

// logits [rows, vocab] fp32, each row contiguous -> (argmax int64 [rows], finite bool [rows]).
std::tuple<at::Tensor, at::Tensor> argmax_finite(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be an fp32 matrix with contiguous rows");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < std::numeric_limits<int32_t>::max(),
              "logits' rows must be 1 to 2^31 - 2 wide");
  const int64_t rows = logits.size(0), width = logits.size(1), stride = logits.stride(0);
  at::Tensor index = at::empty({rows}, logits.options().dtype(at::kLong));
  at::Tensor finite = at::empty({rows}, logits.options().dtype(at::kBool));
  const float* x = logits.data_ptr<float>();
  int64_t* index_out = index.data_ptr<int64_t>();
  bool* finite_out = finite.data_ptr<bool>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto [best, all_finite] = argmax_finite_row(x + r * stride, width);
      index_out[r] = best;
      finite_out[r] = all_finite;
    }
  });
  return {index, finite};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixgate, m) {
  m.def("argmax_finite(Tensor logits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) { m.impl("argmax_finite", &argmax_finite); }
