// The bf16 matrix products of the CPU kernels (paged_attention_matrix.cpp, matrix_linear.cpp):
//
//   C [rows][cols] (fp32, rows ldc apart) = A [rows][depth] (bf16, rows lda apart) x B
//   (+ C where `accumulate`), B packed as VNNI pairs: the 32-bit word at b[(k / 2) * ldb + n]
//   holds B[k][n] in its low half and B[k + 1][n] in its high half.
//
// On a CPU with AMX they run on oneDNN's micro-kernels (torch's `cpublas::brgemm`); on one with
// AVX512_BF16 but no AMX (AMD Zen 4 and later, Intel Cooper Lake), or while oneDNN is switched
// off in torch, on the vdpbf16ps loops below, in the same layouts, so one packed tile or weight
// serves either. Each output is one sum over the whole depth, in order, whatever the row count.
//
// One vdpbf16ps multiplies 16 such pairs by a broadcast pair of A and adds both products to 16
// fp32 sums. A block of up to 6 rows x 4 vectors (64 columns) keeps its 24 sums in registers
// through the whole depth: per pair of depth it loads 4 vectors of B, broadcasts 6 words of A
// and issues 24 vdpbf16ps, so the loads never bound it.
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace prefixgate {

#if defined(__AVX512BF16__)

constexpr int kProductRows = 6;     // rows per register block
constexpr int kProductVectors = 4;  // 16-column vectors per register block

// A's pairs are copied out as words (memcpy): its bf16 storage is never read through a uint32_t.
template <int Rows, int Vectors>
inline void product_block(int64_t pairs, const uint16_t* a, int64_t lda, const uint32_t* b,
                          int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  __m512 sums[Rows][Vectors];
  for (int i = 0; i < Rows; ++i) {
    for (int j = 0; j < Vectors; ++j) {
      sums[i][j] = accumulate ? _mm512_loadu_ps(c + i * ldc + j * 16) : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh columns[Vectors];
    for (int j = 0; j < Vectors; ++j) {
      columns[j] = (__m512bh)_mm512_loadu_si512(b + p * ldb + j * 16);
    }
    for (int i = 0; i < Rows; ++i) {
      int32_t word;
      std::memcpy(&word, a + i * lda + 2 * p, sizeof(word));
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(word);
      for (int j = 0; j < Vectors; ++j) sums[i][j] = _mm512_dpbf16_ps(sums[i][j], pair, columns[j]);
    }
  }
  for (int i = 0; i < Rows; ++i) {
    for (int j = 0; j < Vectors; ++j) _mm512_storeu_ps(c + i * ldc + j * 16, sums[i][j]);
  }
}

// One row block of `Rows` rows across all columns: blocks of kProductVectors vectors, then the
// 1-3 vectors left.
template <int Rows>
inline void product_rows(int64_t cols, int64_t pairs, const uint16_t* a, int64_t lda,
                         const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int64_t kBlock = kProductVectors * 16;
  int64_t n = 0;
  for (; n + kBlock <= cols; n += kBlock) {
    product_block<Rows, kProductVectors>(pairs, a, lda, b + n, ldb, c + n, ldc, accumulate);
  }
  switch ((cols - n) / 16) {
    case 3: product_block<Rows, 3>(pairs, a, lda, b + n, ldb, c + n, ldc, accumulate); break;
    case 2: product_block<Rows, 2>(pairs, a, lda, b + n, ldb, c + n, ldc, accumulate); break;
    case 1: product_block<Rows, 1>(pairs, a, lda, b + n, ldb, c + n, ldc, accumulate); break;
    default: break;
  }
}

// The product on vdpbf16ps; cols a multiple of 16, depth and lda even.
inline void dot_product(int64_t rows, int64_t cols, int64_t depth, int64_t lda, int64_t ldb,
                        int64_t ldc, bool accumulate, const uint16_t* a, const uint32_t* b,
                        float* c) {
  const int64_t pairs = depth / 2;
  int64_t r = 0;
  for (; r + kProductRows <= rows; r += kProductRows) {
    product_rows<kProductRows>(cols, pairs, a + r * lda, lda, b, ldb, c + r * ldc, ldc,
                               accumulate);
  }
  const uint16_t* rest = a + r * lda;
  float* target = c + r * ldc;
  switch (rows - r) {
    case 5: product_rows<5>(cols, pairs, rest, lda, b, ldb, target, ldc, accumulate); break;
    case 4: product_rows<4>(cols, pairs, rest, lda, b, ldb, target, ldc, accumulate); break;
    case 3: product_rows<3>(cols, pairs, rest, lda, b, ldb, target, ldc, accumulate); break;
    case 2: product_rows<2>(cols, pairs, rest, lda, b, ldb, target, ldc, accumulate); break;
    case 1: product_rows<1>(cols, pairs, rest, lda, b, ldb, target, ldc, accumulate); break;
    default: break;
  }
}

#endif  // __AVX512BF16__

// False: the vdpbf16ps loops even where AMX is (tests of them on such a CPU).
inline std::atomic<bool>& amx_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

// Whether products run on AMX now. Asked per call of a kernel: it is false while oneDNN is
// switched off in torch, too.
inline bool amx_products() {
  return amx_allowed() && at::native::cpublas::could_pack(at::kBFloat16);
}

// Whether this CPU has bf16 products at all (AMX, or the kernels were built with AVX512_BF16).
inline bool bf16_products_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return amx_products();
#endif
}

// The product at the top of this file, on AMX where `on_amx` (amx_products() of the caller's
// kernel call), else on vdpbf16ps; cols a multiple of 16, depth and lda even.
inline void bf16_product(bool on_amx, int64_t rows, int64_t cols, int64_t depth, int64_t lda,
                         int64_t ldb, int64_t ldc, bool accumulate, const void* a, const void* b,
                         float* c) {
  TORCH_CHECK(cols % 16 == 0 && depth % 2 == 0 && lda % 2 == 0,
              "a bf16 product takes whole vectors of columns and pairs of depth");
  if (on_amx) {
    at::native::cpublas::brgemm(rows, cols, depth, lda, ldb, ldc, accumulate,
                                static_cast<const c10::BFloat16*>(a),
                                static_cast<const c10::BFloat16*>(b), c, true);
    return;
  }
#if defined(__AVX512BF16__)
  dot_product(rows, cols, depth, lda, ldb, ldc, accumulate, static_cast<const uint16_t*>(a),
              static_cast<const uint32_t*>(b), c);
#else
  TORCH_CHECK(false, "this CPU has no bf16 matrix micro-kernels");
#endif
}

// What a thread that ran AMX products calls when its kernel call is done (oneDNN's tile state).
inline void release_products(bool on_amx) {
  if (on_amx) at::native::cpublas::brgemm_release(true);
}

}  // namespace prefixgate
