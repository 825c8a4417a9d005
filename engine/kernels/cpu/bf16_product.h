// The bf16 matrix products of the CPU kernels (paged_attention_matrix.cpp, matrix_linear.cpp):
//
//   C [rows][cols] (fp32, rows ldc apart) = A [rows][depth] (bf16, rows lda apart) x B
//   (+ C where `accumulate`), B packed as VNNI pairs: the 32-bit word at b[(k / 2) * ldb + n]
//   holds B[k][n] in its low half and B[k + 1][n] in its high half.
//
// On a CPU with AMX they run on oneDNN's micro-kernels (torch's `cpublas::brgemm`); on one with
// AVX512_BF16 but no AMX (AMD Zen 4 and later, Intel Cooper Lake), or while oneDNN is switched
// off in torch, on the vdpbf16ps loops below; on one with AVX2 and FMA but no AVX-512, on fp32
// FMA loops that widen each bf16 to fp32 on the way. All take the same layouts, so one packed
// tile or weight serves any of them. Each output is one sum over the whole depth, in order,
// whatever the row count.
//
// One vdpbf16ps multiplies 16 such pairs by a broadcast pair of A and adds both products to 16
// fp32 sums. A block of up to 6 rows x 4 vectors (64 columns) keeps its 24 sums in registers
// through the whole depth: per pair of depth it loads 4 vectors of B, broadcasts 6 words of A
// and issues 24 vdpbf16ps, so the loads never bound it.
//
// A product can also bring other memory into L2 while it runs (`Fetch`, cpu_vector.h): the next
// weight tile of a linear layer, the K/V that decodes read after a shared prefix. A block
// fetches its share of the lines spread evenly over its pairs of depth, at most kFetchPerPair a
// pair: more (4 a pair) stalled the products on the core's miss buffers and measured slower.
// The AMX and FMA products fetch nothing (not measured there).
//
// With AVX2, a bf16 is the high half of the fp32 of the same value: a pair's high element is the
// word with its low half masked off, its low element the word shifted up by 16 bits. Each pair
// then takes two FMAs, the high element's first, the order Intel documents for vdpbf16ps (the
// product of two bf16 is exact in fp32, so each FMA rounds once, as each of its adds does;
// subnormals, which vdpbf16ps flushes to zero, are kept here). A block of 6 rows x 2 vectors
// (16 columns) keeps its 12 sums in registers: 12 chains of FMAs, enough to hide their latency
// (8 were not).
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_vector.h"

// The FMA loops are built for AVX2 CPUs without AVX-512, where they were measured; a CPU with
// AVX-512 but no AVX512_BF16 (Skylake to Ice Lake Xeons) keeps torch's products.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PREFIXGATE_FMA_PRODUCTS 1
#endif

#if defined(__AVX512BF16__) || defined(PREFIXGATE_FMA_PRODUCTS)
#include <immintrin.h>
#endif

namespace prefixgate {

#if defined(__AVX512BF16__)

constexpr int kProductRows = 6;     // rows per register block
constexpr int kProductVectors = 4;  // 16-column vectors per register block
constexpr int64_t kFetchPerPair = 2;  // the most lines a block fetches a pair (see the top)

// A's pairs are copied out as words (memcpy): its bf16 storage is never read through a uint32_t.
template <int Rows, int Vectors>
inline void product_block(int64_t pairs, const uint16_t* a, int64_t lda, const uint32_t* b,
                          int64_t ldb, float* c, int64_t ldc, bool accumulate, Fetch fetch) {
  __m512 sums[Rows][Vectors];
  for (int i = 0; i < Rows; ++i) {
    for (int j = 0; j < Vectors; ++j) {
      sums[i][j] = accumulate ? _mm512_loadu_ps(c + i * ldc + j * 16) : _mm512_setzero_ps();
    }
  }
  const auto pair_of_depth = [&](int64_t p) __attribute__((always_inline)) {
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
  };
  const int64_t lines = std::min(fetch.lines, kFetchPerPair * pairs);
  if (lines == 0) {  // a loop of its own: with the fetches in it, GCC loaded B twice a pair
    for (int64_t p = 0; p < pairs; ++p) pair_of_depth(p);
  } else {
    FetchQueue queue = *fetch.queue;  // copied in and out: the loop keeps it in registers
    int64_t spread = 0;
    for (int64_t p = 0; p < pairs; ++p) {
      for (spread += lines; spread >= pairs; spread -= pairs) queue.next();
      pair_of_depth(p);
    }
    *fetch.queue = queue;
  }
  for (int i = 0; i < Rows; ++i) {
    for (int j = 0; j < Vectors; ++j) _mm512_storeu_ps(c + i * ldc + j * 16, sums[i][j]);
  }
}

// One row block of `Rows` rows across all columns: blocks of kProductVectors vectors, then the
// 1-3 vectors left; `fetch`'s lines shared out over the blocks.
template <int Rows>
inline void product_rows(int64_t cols, int64_t pairs, const uint16_t* a, int64_t lda,
                         const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                         Fetch fetch) {
  static_assert(kProductVectors == 4, "the switch below takes blocks of up to 4 vectors");
  constexpr int64_t kBlock = kProductVectors * 16;
  const int64_t blocks = (cols + kBlock - 1) / kBlock;
  for (int64_t k = 0; k < blocks; ++k) {
    const uint32_t* block = b + k * kBlock;
    float* target = c + k * kBlock;
    const Fetch part = fetch.share(k, blocks);
    switch (std::min<int64_t>(kProductVectors, (cols - k * kBlock) / 16)) {
      case 4:
        product_block<Rows, 4>(pairs, a, lda, block, ldb, target, ldc, accumulate, part);
        break;
      case 3:
        product_block<Rows, 3>(pairs, a, lda, block, ldb, target, ldc, accumulate, part);
        break;
      case 2:
        product_block<Rows, 2>(pairs, a, lda, block, ldb, target, ldc, accumulate, part);
        break;
      case 1:
        product_block<Rows, 1>(pairs, a, lda, block, ldb, target, ldc, accumulate, part);
        break;
      default: break;
    }
  }
}

#elif defined(PREFIXGATE_FMA_PRODUCTS)

constexpr int kProductRows = 6;  // rows per register block (of 2 vectors, 16 columns)

// bf16 pairs in 32-bit words -> fp32 of their high and of their low elements.
inline __m256 high_halves(__m256i words) {
  return _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF0000)));
}
inline __m256 low_halves(__m256i words) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

// `a`: A widened to fp32, rows lda apart. Each sum adds a pair's high product before its low
// one. Blocks of 3 or more rows take, per pair of depth, every row's high products first, then
// every row's low ones: B's high and low halves take turns in 2 registers, beside 12 sums and
// a broadcast of A. Blocks of 1 or 2 rows (decode) are wider, 8 or 4 vectors, and go vector
// by vector, both halves at once: a one-row block reads per pair all 64 columns of a weight's
// packed tile (256 bytes) in one pass, a two-row block half of them, which measured much
// faster than 2-vector blocks for weights streaming from memory.
template <int Rows, int Vectors>
inline void product_block(int64_t pairs, const float* a, int64_t lda, const uint32_t* b,
                          int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  static_assert(Rows <= 2 || Vectors == 2, "blocks of 3 or more rows are 2 vectors wide");
  // Without this return (dot_product handles an empty depth), GCC kept each sum on the stack
  // too, a store after every FMA of a 6-row block (12 a pair of depth, besides its 24 FMAs).
  if (pairs <= 0) return;
  __m256 sums[Rows][Vectors];
  for (int i = 0; i < Rows; ++i) {
    for (int j = 0; j < Vectors; ++j) {
      sums[i][j] = accumulate ? _mm256_loadu_ps(c + i * ldc + j * 8) : _mm256_setzero_ps();
    }
  }
  const auto words = [&](int64_t p, int j) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + p * ldb + j * 8));
  };
  for (int64_t p = 0; p < pairs; ++p) {
    if constexpr (Rows <= 2) {
      __m256 high_a[Rows], low_a[Rows];
      for (int i = 0; i < Rows; ++i) {
        high_a[i] = _mm256_broadcast_ss(a + i * lda + 2 * p + 1);
        low_a[i] = _mm256_broadcast_ss(a + i * lda + 2 * p);
      }
      for (int j = 0; j < Vectors; ++j) {
        const __m256i both = words(p, j);
        const __m256 high = high_halves(both), low = low_halves(both);
        for (int i = 0; i < Rows; ++i) {
          sums[i][j] = _mm256_fmadd_ps(high_a[i], high, sums[i][j]);
          sums[i][j] = _mm256_fmadd_ps(low_a[i], low, sums[i][j]);
        }
      }
    } else {
      const __m256 high[2] = {high_halves(words(p, 0)), high_halves(words(p, 1))};
      for (int i = 0; i < Rows; ++i) {
        const __m256 value = _mm256_broadcast_ss(a + i * lda + 2 * p + 1);
        for (int j = 0; j < 2; ++j) sums[i][j] = _mm256_fmadd_ps(value, high[j], sums[i][j]);
      }
      const __m256 low[2] = {low_halves(words(p, 0)), low_halves(words(p, 1))};
      for (int i = 0; i < Rows; ++i) {
        const __m256 value = _mm256_broadcast_ss(a + i * lda + 2 * p);
        for (int j = 0; j < 2; ++j) sums[i][j] = _mm256_fmadd_ps(value, low[j], sums[i][j]);
      }
    }
  }
  for (int i = 0; i < Rows; ++i) {
    for (int j = 0; j < Vectors; ++j) _mm256_storeu_ps(c + i * ldc + j * 8, sums[i][j]);
  }
}

template <int Rows>
inline void product_rows(int64_t cols, int64_t pairs, const float* a, int64_t lda,
                         const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                         Fetch /*the FMA loops fetch nothing: not measured there*/) {
  constexpr int kWide = Rows == 1 ? 8 : Rows == 2 ? 4 : 2;
  int64_t n = 0;
  for (; n + kWide * 8 <= cols; n += kWide * 8) {
    product_block<Rows, kWide>(pairs, a, lda, b + n, ldb, c + n, ldc, accumulate);
  }
  for (; n < cols; n += 16) {
    product_block<Rows, 2>(pairs, a, lda, b + n, ldb, c + n, ldc, accumulate);
  }
}

// A's rows widened to fp32 into `wide` (rows x depth), for the blocks above.
inline void widen_rows(int64_t rows, int64_t depth, const c10::BFloat16* a, int64_t lda,
                       std::vector<float>& wide) {
  wide.resize(rows * depth);
  for (int64_t r = 0; r < rows; ++r) {
    const c10::BFloat16* source = a + r * lda;
    float* target = wide.data() + r * depth;
    int64_t k = 0;
    for (; k + kLanes <= depth; k += kLanes) store(target + k, load(source + k));
    for (; k < depth; ++k) target[k] = static_cast<float>(source[k]);
  }
}

#endif

#if defined(__AVX512BF16__) || defined(PREFIXGATE_FMA_PRODUCTS)
#define PREFIXGATE_DOT_PRODUCTS 1

// Rows in blocks of kProductRows, then the 1-5 left, each block across all columns; `fetch`'s
// lines shared out over the blocks.
template <typename Scalar>
inline void row_blocks(int64_t rows, int64_t cols, int64_t pairs, const Scalar* a, int64_t lda,
                       const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                       Fetch fetch) {
  static_assert(kProductRows == 6, "the switch below takes blocks of up to 6 rows");
  const int64_t blocks = (rows + kProductRows - 1) / kProductRows;
  for (int64_t k = 0; k < blocks; ++k) {
    const Scalar* block = a + k * kProductRows * lda;
    float* target = c + k * kProductRows * ldc;
    const Fetch part = fetch.share(k, blocks);
    switch (std::min<int64_t>(kProductRows, rows - k * kProductRows)) {
      case 6:
        product_rows<6>(cols, pairs, block, lda, b, ldb, target, ldc, accumulate, part);
        break;
      case 5:
        product_rows<5>(cols, pairs, block, lda, b, ldb, target, ldc, accumulate, part);
        break;
      case 4:
        product_rows<4>(cols, pairs, block, lda, b, ldb, target, ldc, accumulate, part);
        break;
      case 3:
        product_rows<3>(cols, pairs, block, lda, b, ldb, target, ldc, accumulate, part);
        break;
      case 2:
        product_rows<2>(cols, pairs, block, lda, b, ldb, target, ldc, accumulate, part);
        break;
      case 1:
        product_rows<1>(cols, pairs, block, lda, b, ldb, target, ldc, accumulate, part);
        break;
      default: break;
    }
  }
}

// The product on vdpbf16ps, or on AVX2's FMA with A widened to fp32 once per call (into each
// thread's scratch), not once per block of columns; cols a multiple of 16, depth and lda even.
inline void dot_product(int64_t rows, int64_t cols, int64_t depth, int64_t lda, int64_t ldb,
                        int64_t ldc, bool accumulate, const uint16_t* a, const uint32_t* b,
                        float* c, Fetch fetch) {
  if (depth <= 0) {  // the blocks return at once
    for (int64_t r = 0; r < rows && !accumulate; ++r) std::fill_n(c + r * ldc, cols, 0.0f);
    return;
  }
#if defined(__AVX512BF16__)
  row_blocks(rows, cols, depth / 2, a, lda, b, ldb, c, ldc, accumulate, fetch);
#else
  thread_local std::vector<float> wide;
  widen_rows(rows, depth, reinterpret_cast<const c10::BFloat16*>(a), lda, wide);
  row_blocks(rows, cols, depth / 2, wide.data(), depth, b, ldb, c, ldc, accumulate, fetch);
#endif
}

#endif

// What a bf16 product says where this CPU has none (linear.py's NO_PRODUCTS matches it).
constexpr const char* kNoBf16Products = "this CPU has no bf16 matrix micro-kernels";

// The loops this build has where AMX is not taken: "vdpbf16ps", "fma" (AVX2), or none ("").
inline const char* dot_products_name() {
#if defined(__AVX512BF16__)
  return "vdpbf16ps";
#elif defined(PREFIXGATE_DOT_PRODUCTS)
  return "fma";
#else
  return "";
#endif
}

// False: the vdpbf16ps or FMA loops even where AMX is (tests of them on such a CPU).
inline std::atomic<bool>& amx_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

// Whether products run on AMX now. Asked per call of a kernel: it is false while oneDNN is
// switched off in torch, too.
inline bool amx_products() {
  return amx_allowed() && at::native::cpublas::could_pack(at::kBFloat16);
}

// Whether this CPU has bf16 products at all (AMX, or the kernels were built with AVX512_BF16,
// or with AVX2 and FMA).
inline bool bf16_products_available() {
#if defined(PREFIXGATE_DOT_PRODUCTS)
  return true;
#else
  return amx_products();
#endif
}

// Whether bf16_product, called with `on_amx`, fetches what a `Fetch` asks for (only the
// vdpbf16ps loops do): callers build no queue for it otherwise.
inline bool products_fetch(bool on_amx) {
#if defined(__AVX512BF16__)
  return !on_amx;
#else
  (void)on_amx;
  return false;
#endif
}

// The product at the top of this file, on AMX where `on_amx` (amx_products() of the caller's
// kernel call), else on vdpbf16ps or FMA; cols a multiple of 16, depth and lda even.
inline void bf16_product(bool on_amx, int64_t rows, int64_t cols, int64_t depth, int64_t lda,
                         int64_t ldb, int64_t ldc, bool accumulate, const void* a, const void* b,
                         float* c, Fetch fetch = {}) {
  TORCH_CHECK(cols % 16 == 0 && depth % 2 == 0 && lda % 2 == 0,
              "a bf16 product takes whole vectors of columns and pairs of depth");
  if (on_amx) {
    at::native::cpublas::brgemm(rows, cols, depth, lda, ldb, ldc, accumulate,
                                static_cast<const c10::BFloat16*>(a),
                                static_cast<const c10::BFloat16*>(b), c, true);
    return;
  }
#if defined(PREFIXGATE_DOT_PRODUCTS)
  dot_product(rows, cols, depth, lda, ldb, ldc, accumulate, static_cast<const uint16_t*>(a),
              static_cast<const uint32_t*>(b), c, fetch);
#else
  (void)fetch;
  TORCH_CHECK(false, kNoBf16Products);
#endif
}

// What a thread that ran AMX products calls when its kernel call is done (oneDNN's tile state).
inline void release_products(bool on_amx) {
  if (on_amx) at::native::cpublas::brgemm_release(true);
}

}  // namespace prefixgate
