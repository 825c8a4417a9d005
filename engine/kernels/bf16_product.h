// bf16 matrix products with AVX512_BF16's `vdpbf16ps`, for CPUs that have it without AMX (AMD
// Zen 4 and later, Intel Cooper Lake): the products paged_attention_matrix.cpp otherwise runs on
// oneDNN's AMX micro-kernels, in the same layouts, so one packed tile serves either.
//
//   C [rows][cols] (fp32, rows ldc apart) = A [rows][depth] (bf16, rows lda apart) x B
//   (+ C where `accumulate`), B packed as VNNI pairs: the 32-bit word at b[(k / 2) * ldb + n]
//   holds B[k][n] in its low half and B[k + 1][n] in its high half.
//
// One vdpbf16ps multiplies 16 such pairs by a broadcast pair of A and adds both products to 16
// fp32 sums. A block of up to 6 rows x 4 vectors (64 columns) keeps its 24 sums in registers
// through the whole depth: per pair of depth it loads 4 vectors of B, broadcasts 6 words of A
// and issues 24 vdpbf16ps, so the loads never bound it.
#pragma once

#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace prefixgate {

constexpr int kProductRows = 6;     // rows per register block
constexpr int kProductVectors = 4;  // 16-column vectors per register block

template <int Rows, int Vectors>
inline void product_block(int64_t pairs, const uint32_t* a, int64_t a_words, const uint32_t* b,
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
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * a_words + p]));
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
inline void product_rows(int64_t cols, int64_t pairs, const uint32_t* a, int64_t a_words,
                         const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  constexpr int64_t kBlock = kProductVectors * 16;
  int64_t n = 0;
  for (; n + kBlock <= cols; n += kBlock) {
    product_block<Rows, kProductVectors>(pairs, a, a_words, b + n, ldb, c + n, ldc, accumulate);
  }
  switch ((cols - n) / 16) {
    case 3: product_block<Rows, 3>(pairs, a, a_words, b + n, ldb, c + n, ldc, accumulate); break;
    case 2: product_block<Rows, 2>(pairs, a, a_words, b + n, ldb, c + n, ldc, accumulate); break;
    case 1: product_block<Rows, 1>(pairs, a, a_words, b + n, ldb, c + n, ldc, accumulate); break;
    default: break;
  }
}

// The product above; cols a multiple of 16, depth and lda even.
inline void bf16_product(int64_t rows, int64_t cols, int64_t depth, int64_t lda, int64_t ldb,
                         int64_t ldc, bool accumulate, const uint16_t* a, const uint32_t* b,
                         float* c) {
  const auto* words = reinterpret_cast<const uint32_t*>(a);
  const int64_t pairs = depth / 2, a_words = lda / 2;
  int64_t r = 0;
  for (; r + kProductRows <= rows; r += kProductRows) {
    product_rows<kProductRows>(cols, pairs, words + r * a_words, a_words, b, ldb, c + r * ldc,
                               ldc, accumulate);
  }
  const uint32_t* rest = words + r * a_words;
  float* target = c + r * ldc;
  switch (rows - r) {
    case 5: product_rows<5>(cols, pairs, rest, a_words, b, ldb, target, ldc, accumulate); break;
    case 4: product_rows<4>(cols, pairs, rest, a_words, b, ldb, target, ldc, accumulate); break;
    case 3: product_rows<3>(cols, pairs, rest, a_words, b, ldb, target, ldc, accumulate); break;
    case 2: product_rows<2>(cols, pairs, rest, a_words, b, ldb, target, ldc, accumulate); break;
    case 1: product_rows<1>(cols, pairs, rest, a_words, b, ldb, target, ldc, accumulate); break;
    default: break;
  }
}

}  // namespace prefixgate

#endif  // __AVX512BF16__
