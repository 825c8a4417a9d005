// The LM head of a bf16 model with fp32 logits: bf16 weights and hidden states, products summed
// and returned in fp32 by oneDNN's bf16 micro-kernels (torch's `cpublas::brgemm`).
//
// A bf16 output would round logits of ~25 to steps of 0.125, and near-ties between the top
// tokens (common: 25.33 against 25.24 for SmolLM2's first answer token to "What is the capital
// of France?") would then be decided by rounding. The weight is packed once at start into
// column tiles of kColumns outputs in the VNNI layout (pairs of input features side by side),
// so each step reads it once, as the bf16 product does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kColumns = 64;  // outputs per packed tile

// weight [out, in] bf16 -> [tiles][in / 2][kColumns] pairs; outputs past `out` are zero.
at::Tensor pack_logits_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous() && weight.size(1) % 2 == 0,
              "the weight must be a contiguous bf16 [out, in] matrix with an even `in`");
  TORCH_CHECK(at::native::cpublas::could_pack(at::kBFloat16),
              "this CPU has no bf16 matrix micro-kernels");
  const int64_t out = weight.size(0), pairs = weight.size(1) / 2;
  const int64_t tiles = (out + kColumns - 1) / kColumns;
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

// input [rows, in] bf16 x packed weight -> logits [rows, out] fp32.
at::Tensor logits_fp32(const at::Tensor& input, const at::Tensor& packed, int64_t out) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kBFloat16 && input.is_contiguous(),
              "the input must be a contiguous bf16 [rows, in] matrix");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kColumns && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(1) * 2 == input.size(1) &&
                  out > (packed.size(0) - 1) * kColumns && out <= packed.size(0) * kColumns,
              "the packed weight does not match the input and `out`");
  const int64_t rows = input.size(0), features = input.size(1), tiles = packed.size(0);
  at::Tensor logits = at::empty({rows, out}, input.options().dtype(at::kFloat));
  if (rows == 0) return logits;
  const c10::BFloat16* a = input.data_ptr<c10::BFloat16>();
  const c10::BFloat16* b = packed.data_ptr<c10::BFloat16>();
  float* c = logits.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float scratch[16 * kColumns];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kColumns, columns = std::min(kColumns, out - first);
      const c10::BFloat16* tile = b + t * features * kColumns;
      for (int64_t row = 0; row < rows; row += 16) {
        const int64_t count = std::min<int64_t>(16, rows - row);
        if (columns == kColumns) {
          at::native::cpublas::brgemm(count, kColumns, features, features, kColumns, out, false,
                                      a + row * features, tile, c + row * out + first, true);
          continue;
        }
        // The last tile's padded outputs go to scratch, the real ones are copied out.
        at::native::cpublas::brgemm(count, kColumns, features, features, kColumns, kColumns,
                                    false, a + row * features, tile, scratch, true);
        for (int64_t r = 0; r < count; ++r) {
          std::memcpy(c + (row + r) * out + first, scratch + r * kColumns, columns * 4);
        }
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return logits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixgate, m) {
  m.def("pack_logits_weight(Tensor weight) -> Tensor");
  m.def("logits_fp32(Tensor input, Tensor packed, int out) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) {
  m.impl("pack_logits_weight", &pack_logits_weight);
  m.impl("logits_fp32", &logits_fp32);
}
