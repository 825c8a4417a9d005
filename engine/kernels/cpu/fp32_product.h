// The fp32 matrix products of matrix_linear.cpp, on AVX2's FMA:
//
//   C [rows][cols] (fp32, rows ldc apart) = A [rows][depth] (fp32, rows lda apart) x B (+ C where
//   `accumulate`), B packed in groups of 16 columns, each group's rows of 16 contiguous:
//   B[k][16 g + n] at b[g * group_stride + k * 16 + n].
//
// Each output is one chain of FMAs over the depth, in order: a block of rows and columns
// starts from zero (or from C, which holds the chain's sum so far: a product over the first
// part of the depth, continued over the next with `accumulate`, sums in the same order and
// gives the same bits as one over the whole depth). So a row's result depends on nothing but
// its own inputs and the weight, whatever the row count, the blocking or the threads.
//
// Register blocks, as for bf16_product.h's FMA loops: 6 rows x 2 vectors (one group) keep 12
// chains of FMAs in flight, enough to hide their latency; one and two rows (decode) take 8 and
// 4 vectors (4 and 2 groups at once). A group's rows are contiguous so that a block reads B as
// a stream, which the CPU's own prefetchers follow from memory; rows of 64 columns, of which
// a 6 x 16 block reads one cache line in four, measured much slower.
//
// Built for AVX2 CPUs without AVX-512, where it was measured; elsewhere fp32 linear layers stay
// on torch's products (linear.py).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PREFIXGATE_FP32_PRODUCTS 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace prefixgate {

constexpr int64_t kFp32Group = 16;  // columns per group of B

#if defined(PREFIXGATE_FP32_PRODUCTS)

template <int Rows, int Vectors>
inline void fp32_block(int64_t depth, const float* a, int64_t lda, const float* b,
                       int64_t group_stride, float* c, int64_t ldc, bool accumulate) {
  // Without this return (fp32_product handles an empty depth), GCC kept each sum on the stack
  // too, a store after every FMA (as in bf16_product.h's FMA blocks).
  if (depth <= 0) return;
  __m256 sums[Rows][Vectors];
  for (int i = 0; i < Rows; ++i) {
    for (int j = 0; j < Vectors; ++j) {
      sums[i][j] = accumulate ? _mm256_loadu_ps(c + i * ldc + j * 8) : _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    __m256 columns[Vectors];
    for (int j = 0; j < Vectors; ++j) {
      columns[j] = _mm256_loadu_ps(b + (j / 2) * group_stride + k * kFp32Group + (j % 2) * 8);
    }
    for (int i = 0; i < Rows; ++i) {
      const __m256 value = _mm256_broadcast_ss(a + i * lda + k);
      for (int j = 0; j < Vectors; ++j) sums[i][j] = _mm256_fmadd_ps(value, columns[j], sums[i][j]);
    }
  }
  for (int i = 0; i < Rows; ++i) {
    for (int j = 0; j < Vectors; ++j) _mm256_storeu_ps(c + i * ldc + j * 8, sums[i][j]);
  }
}

// One block of `Rows` rows across all columns (a multiple of 16).
template <int Rows>
inline void fp32_rows(int64_t cols, int64_t depth, const float* a, int64_t lda, const float* b,
                      int64_t group_stride, float* c, int64_t ldc, bool accumulate) {
  constexpr int kWide = Rows == 1 ? 8 : Rows == 2 ? 4 : 2;
  int64_t n = 0;
  for (; n + kWide * 8 <= cols; n += kWide * 8) {
    fp32_block<Rows, kWide>(depth, a, lda, b + n / kFp32Group * group_stride, group_stride,
                            c + n, ldc, accumulate);
  }
  for (; n < cols; n += kFp32Group) {
    fp32_block<Rows, 2>(depth, a, lda, b + n / kFp32Group * group_stride, group_stride, c + n,
                        ldc, accumulate);
  }
}

// The product at the top of this file: rows in blocks of 6, then the 1-5 left.
inline void fp32_product(int64_t rows, int64_t cols, int64_t depth, const float* a, int64_t lda,
                         const float* b, int64_t group_stride, float* c, int64_t ldc,
                         bool accumulate) {
  if (depth <= 0) {  // the blocks return at once
    for (int64_t r = 0; r < rows && !accumulate; ++r) std::fill_n(c + r * ldc, cols, 0.0f);
    return;
  }
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) {
    fp32_rows<6>(cols, depth, a + r * lda, lda, b, group_stride, c + r * ldc, ldc, accumulate);
  }
  const float* rest = a + r * lda;
  float* target = c + r * ldc;
  switch (rows - r) {
    case 5: fp32_rows<5>(cols, depth, rest, lda, b, group_stride, target, ldc, accumulate); break;
    case 4: fp32_rows<4>(cols, depth, rest, lda, b, group_stride, target, ldc, accumulate); break;
    case 3: fp32_rows<3>(cols, depth, rest, lda, b, group_stride, target, ldc, accumulate); break;
    case 2: fp32_rows<2>(cols, depth, rest, lda, b, group_stride, target, ldc, accumulate); break;
    case 1: fp32_rows<1>(cols, depth, rest, lda, b, group_stride, target, ldc, accumulate); break;
    default: break;
  }
}

#endif

// What an fp32 product says where this build has none (linear.py's NO_PRODUCTS matches it).
constexpr const char* kNoFp32Products = "this build has no fp32 matrix products";

// Whether this build has the fp32 products above.
inline bool fp32_products_available() {
#if defined(PREFIXGATE_FP32_PRODUCTS)
  return true;
#else
  return false;
#endif
}

}  // namespace prefixgate
