// Linear layers of a bf16 model on the CPU's bf16 matrix products (bf16_product.h: oneDNN's AMX
// micro-kernels, or its own loops without AMX: vdpbf16ps with AVX512_BF16, fp32 FMA with AVX2),
// and of an fp32 model on fp32 FMA products where the CPU has AVX2 without AVX-512
// (fp32_product.h), with one fixed order of arithmetic for every output: a row's result never
// depends on how many rows share the call, nor on how many threads run it.
//
// oneDNN's own matmul and torch's plain `linear` choose their blocking by the row count, and
// for some counts they split the sum over input features differently (measured here: SmolLM2's
// down projection, 1,536 inputs, gave other bits for a row at 130-300 rows than alone). A step's
// rows are every sequence's tokens of the step, so there a request's projections, and at a
// near-tie its greedy tokens, would depend on what else was in the step, other tenants'
// requests included, and a prompt computed in one pass would round differently from the same
// prompt extended after cached blocks.
//
// Here each output element is one micro-kernel product over all input features, in order, in
// fp32 (bias added in fp32), rounded once (to bf16, or kept in fp32 for an LM head's logits and
// for an fp32 model). The weight is packed once at start into column tiles of kColumns outputs:
// bf16 in the VNNI layout (pairs of input features side by side), fp32 in fp32_product.h's
// groups of 16 columns, the inputs in passes of kDepthBlock. Work items are (up to kGroupRows
// rows) x (up to kChunkTiles column tiles): a group's rows stay in L2 while a chunk's tiles
// stream past them.
// `gated`: the weight is a fused gate-and-up projection ([gate; up]), and the result is
// silu(gate) * up, the way elementwise.cpp's gated_silu computes it from the unfused product's
// output (the same bits), without writing and reading back the product.
//
// Against oneDNN's packed matmul and torch's products, these run few rows faster (no primitive
// to run) and many rows at about the same speed; other blockings measured no better.
// (Measurements: docs/performance.md.)
//
// A row group of kFetchMinRows or more rows brings the next tile its thread takes into L2 while
// it multiplies the current one (bf16_product.h's `Fetch`; vdpbf16ps only). There a tile's
// products take longer than reading it, and without the fetch each tile's first row block
// waited on memory while the others ran from L2: a layer took about the sum of its reads and
// its arithmetic. Below kFetchMinRows fetching measured slower: there the products keep up
// with memory, and a second stream only competes with the first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "bf16_product.h"
#include "fp32_product.h"
#include "cpu_vector.h"

namespace prefixgate {
namespace {

constexpr int64_t kColumns = 64;     // outputs per packed tile
constexpr int64_t kRowBlock = 32;    // rows per micro-kernel call
constexpr int64_t kGroupRows = 256;  // rows per work item
constexpr int64_t kChunkTiles = 8;   // column tiles per work item (at most)
constexpr int64_t kDepthBlock = 128;  // input features per pass of fp32 products
constexpr int64_t kFetchMinRows = 12;  // smaller row groups fetch no tile ahead (see the top)

// weight [out, in] bf16 -> [tiles][in / 2][kColumns] pairs, fp32 -> [tiles][4][in][16] (groups
// of 16 columns, fp32_product.h). Outputs past `out` are zero.
at::Tensor pack_matrix_weight(const at::Tensor& weight) {
  const bool fp32 = weight.scalar_type() == at::kFloat;
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (fp32 || (weight.scalar_type() == at::kBFloat16 && weight.size(1) % 2 == 0)),
              "the weight must be a contiguous bf16 [out, in] matrix with an even `in`, or fp32");
  TORCH_CHECK(fp32 ? fp32_products_available() : bf16_products_available(),
              fp32 ? kNoFp32Products : kNoBf16Products);
  const int64_t out = weight.size(0), features = weight.size(1);
  const int64_t tiles = (out + kColumns - 1) / kColumns;
  if (fp32) {
    constexpr int64_t kGroups = kColumns / kFp32Group;
    at::Tensor packed = at::zeros({tiles, kGroups, features, kFp32Group}, weight.options());
    const float* source = weight.data_ptr<float>();
    float* target = packed.data_ptr<float>();
    at::parallel_for(0, tiles * kGroups, 1, [&](int64_t begin, int64_t end) {
      for (int64_t group = begin; group < end; ++group) {  // of all tiles
        for (int64_t n = 0; n < kFp32Group && group * kFp32Group + n < out; ++n) {
          const float* row = source + (group * kFp32Group + n) * features;
          float* column = target + group * features * kFp32Group + n;
          for (int64_t k = 0; k < features; ++k) column[k * kFp32Group] = row[k];
        }
      }
    });
    return packed;
  }
  const int64_t pairs = features / 2;
  at::Tensor packed = at::empty({tiles, pairs, kColumns, 2}, weight.options());
  const c10::BFloat16* source = weight.data_ptr<c10::BFloat16>();
  auto* target = reinterpret_cast<uint32_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint32_t* tile = target + t * pairs * kColumns;
      for (int64_t c = 0; c < kColumns; ++c) {
        const int64_t row = t * kColumns + c;
        for (int64_t p = 0; p < pairs; ++p) {
          uint32_t pair = 0;  // two bf16 side by side (memcpy: the weight may be 2-aligned)
          if (row < out) std::memcpy(&pair, source + row * 2 * pairs + 2 * p, sizeof(pair));
          tile[p * kColumns + c] = pair;
        }
      }
    }
  });
  return packed;
}

// One row of fp32 sums (plus bias) -> `columns` outputs of `target`, fp32 or rounded to bf16.
// A partial last tile goes through full-width buffers, so every output rounds the same way.
void store_row(const float* sums, const float* bias, int64_t columns, bool fp32_out,
               void* target) {
  if (columns == kColumns) {
    for (int64_t c = 0; c < kColumns; c += kLanes) {
      vfloat v = load(sums + c);
      if (bias != nullptr) v += load(bias + c);
      if (fp32_out) {
        store(static_cast<float*>(target) + c, v);
      } else {
        store(static_cast<c10::BFloat16*>(target) + c, v);
      }
    }
    return;
  }
  alignas(64) float padded_bias[kColumns] = {};
  if (bias != nullptr) std::memcpy(padded_bias, bias, columns * sizeof(float));
  alignas(64) float wide[kColumns];
  alignas(64) c10::BFloat16 narrow[kColumns];
  for (int64_t c = 0; c < kColumns; c += kLanes) {
    const vfloat v = load(sums + c) + load(padded_bias + c);
    store(wide + c, v);
    store(narrow + c, v);
  }
  if (fp32_out) {
    std::memcpy(target, wide, columns * sizeof(float));
  } else {
    std::memcpy(target, narrow, columns * sizeof(c10::BFloat16));
  }
}

// One row of a gated product: silu(gate) * up, each of gate, up and silu(gate) rounded to the
// output's dtype first (nothing to round in fp32), as the unfused product's output and
// gated_silu round them.
template <typename scalar_t>
void store_gated_row(const float* gate, const float* up, const float* gate_bias,
                     const float* up_bias, scalar_t* target) {
  for (int64_t c = 0; c < kColumns; c += kLanes) {
    vfloat g = load(gate + c), u = load(up + c);
    if (gate_bias != nullptr) {
      g += load(gate_bias + c);
      u += load(up_bias + c);
    }
    g = round_to(g, target);
    u = round_to(u, target);
    store(target + c, round_to(silu(g), target) * u);
  }
}

// `count` rows of fp32 inputs times one packed fp32 tile, into `sums` (rows kColumns apart),
// the depth in blocks of kDepthBlock: a block's part of the tile (32 KB) stays near the core
// (L1, else L2) while every 6-row block of the rows runs over it. The sums are the same bits as
// in one pass (fp32_product.h). No inputs: zeros.
void product_fp32(int64_t count, int64_t features, const float* a, const float* tile,
                  float* sums) {
#if defined(PREFIXGATE_FP32_PRODUCTS)
  int64_t k = 0;
  do {  // once at least: an empty depth writes the zeros
    fp32_product(count, kColumns, std::min(kDepthBlock, features - k), a + k, features,
                 tile + k * kFp32Group, features * kFp32Group, sums, kColumns, k > 0);
    k += kDepthBlock;
  } while (k < features);
#else
  TORCH_CHECK(false, kNoFp32Products);
#endif
}

// input [rows, in] bf16 x packed weight (+ bias, fp32) -> [rows, out], fp32 or bf16; `gated`:
// -> silu(gate) * up, [rows, out / 2] bf16 (see the top of this file). An fp32 input and weight
// give fp32 outputs (`fp32_out` is then moot).
at::Tensor matrix_linear(const at::Tensor& input, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t out, bool fp32_out,
                         bool gated) {
  const bool fp32 = input.scalar_type() == at::kFloat;
  TORCH_CHECK(input.dim() == 2 && input.is_contiguous() &&
                  (fp32 || input.scalar_type() == at::kBFloat16),
              "the input must be a contiguous bf16 or fp32 [rows, in] matrix");
  const bool layout_matches = fp32 ? packed.dim() == 4 && packed.size(1) == kColumns / kFp32Group &&
                                 packed.size(3) == kFp32Group
                           : packed.dim() == 4 && packed.size(2) == kColumns && packed.size(3) == 2;
  const int64_t depth = fp32 ? packed.size(2) : packed.size(1) * 2;
  TORCH_CHECK(packed.scalar_type() == input.scalar_type() && packed.is_contiguous() &&
                  layout_matches && depth == input.size(1) &&
                  out > (packed.size(0) - 1) * kColumns && out <= packed.size(0) * kColumns,
              "the packed weight does not match the input and `out`");
  fp32_out = fp32_out || fp32;
  // Asked each call: AMX products are off while oneDNN is switched off in torch.
  const bool on_amx = !fp32 && amx_products();
  TORCH_CHECK(fp32 ? fp32_products_available() : on_amx || bf16_products_available(),
              fp32 ? kNoFp32Products : kNoBf16Products);
  TORCH_CHECK(!bias.has_value() ||
                  (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                   bias->dim() == 1 && bias->size(0) == out),
              "the bias must be a contiguous fp32 vector of `out` values");
  TORCH_CHECK(!gated || ((fp32 || !fp32_out) && out % (2 * kColumns) == 0),
              "a gated product has the input's dtype and halves a multiple of 64 wide");
  const int64_t rows = input.size(0), features = input.size(1);
  const int64_t width = gated ? out / 2 : out;  // outputs per row
  const int64_t tiles = (width + kColumns - 1) / kColumns;  // of the output (the gate's)
  at::Tensor result =
      at::empty({rows, width}, input.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  if (rows == 0) return result;
  const void* a = input.data_ptr();
  const void* b = packed.data_ptr();
  const float* bias_values = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto* target = static_cast<char*>(result.data_ptr());
  const int64_t element = fp32_out ? 4 : 2;
  const int64_t groups = (rows + kGroupRows - 1) / kGroupRows;
  // Enough column chunks for every thread when there are few row groups (decode).
  const int64_t threads = at::get_num_threads();
  int64_t chunks = std::min<int64_t>(
      tiles, std::max<int64_t>((tiles + kChunkTiles - 1) / kChunkTiles,
                               (threads + groups - 1) / groups));
  // Whole rounds of items for the threads where the tiles allow, so that no thread waits for
  // another's extra chunk.
  while (chunks < tiles && (groups * chunks) % threads != 0) ++chunks;
  // Rows [row, row + count) times column tile `tile` (of the packed weight) into `sums`.
  const int64_t tile_lines = features * kColumns * 2 / 64;  // of a packed bf16 tile
  const bool fetches = !fp32 && products_fetch(on_amx);
  // `fetch`: while at it, the next tile into L2 (see the top of this file).
  const auto product = [&](int64_t row, int64_t count, int64_t tile, float* sums, bool fetch) {
    if (fp32) {
      product_fp32(count, features, static_cast<const float*>(a) + row * features,
                   static_cast<const float*>(b) + tile * features * kColumns, sums);
    } else {
      const auto* tiles_at = static_cast<const c10::BFloat16*>(b);
      const char* next = reinterpret_cast<const char*>(tiles_at + (tile + 1) * features * kColumns);
      FetchQueue queue{&next, 1, tile_lines};
      bf16_product(on_amx, count, kColumns, features, features, kColumns, kColumns, false,
                   static_cast<const c10::BFloat16*>(a) + row * features,
                   tiles_at + tile * features * kColumns, sums, {&queue, fetch ? tile_lines : 0});
    }
  };
  at::parallel_for(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kRowBlock * kColumns];
    alignas(64) float up_sums[kRowBlock * kColumns];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t group = item / chunks, chunk = item % chunks;
      const int64_t first_row = group * kGroupRows;
      const int64_t last_row = std::min(rows, first_row + kGroupRows);
      const int64_t last_tile = tiles * (chunk + 1) / chunks;
      for (int64_t t = tiles * chunk / chunks; t < last_tile; ++t) {
        const int64_t first = t * kColumns, columns = std::min(kColumns, width - first);
        for (int64_t row = first_row; row < last_row; row += kRowBlock) {
          const int64_t count = std::min(kRowBlock, last_row - row);
          // The next tile in memory, where this thread takes it next (in this item or the next).
          const bool fetch = fetches && row == first_row &&
                             last_row - first_row >= kFetchMinRows &&
                             (t + 1 < last_tile || (item + 1 < end && chunk + 1 < chunks));
          product(row, count, t, sums, fetch);
          if (gated) product(row, count, t + tiles, up_sums, fetch);  // the up tile paired with t
          for (int64_t r = 0; r < count; ++r) {
            char* destination = target + ((row + r) * width + first) * element;
            const float* bias_at = bias_values ? bias_values + first : nullptr;
            const float* up_bias = bias_values ? bias_values + width + first : nullptr;
            if (gated && fp32) {
              store_gated_row(sums + r * kColumns, up_sums + r * kColumns, bias_at, up_bias,
                              reinterpret_cast<float*>(destination));
            } else if (gated) {
              store_gated_row(sums + r * kColumns, up_sums + r * kColumns, bias_at, up_bias,
                              reinterpret_cast<c10::BFloat16*>(destination));
            } else {
              store_row(sums + r * kColumns, bias_at, columns, fp32_out, destination);
            }
          }
        }
      }
    }
    release_products(on_amx);
  });
  return result;
}

}  // namespace
}  // namespace prefixgate

TORCH_LIBRARY_FRAGMENT(prefixgate, m) {
  m.def("pack_matrix_weight(Tensor weight) -> Tensor");
  m.def(
      "matrix_linear(Tensor input, Tensor packed, Tensor? bias, int out, bool fp32_out, "
      "bool gated=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) {
  m.impl("pack_matrix_weight", &prefixgate::pack_matrix_weight);
  m.impl("matrix_linear", &prefixgate::matrix_linear);
}
