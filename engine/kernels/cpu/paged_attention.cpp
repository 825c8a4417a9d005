// Paged attention on the CPU: queries attend over K/V read in place through each sequence's
// block table; no context is ever copied out of the pool.
//
// One kernel serves decode (one query token per sequence), prefill and extend (many query tokens
// whose context may begin with cached blocks). A sequence's query tokens are the last
// `query_len` positions of its `context_len`: query token t sits at position
// context_len - query_len + t and sees the keys at positions <= its own (and, with a sliding
// window, > its own - window). Grouped-query attention: the `heads / kv_heads` query heads of a
// KV head are computed together, so each K/V element read serves all of them.
//
// Work items are (sequence, kv head, tile of up to 16 query tokens), or for bf16 decodes in the
// decode layout (AVX512_BF16, head_dim a multiple of 32) in batches of two or more a thread
// (sequence, every kv head: `every_head_items` below), dealt to torch's threads so that they finish
// together. Keys are taken 16 positions at a time (a "chunk", whatever the block size) and
// processed with 16-lane vectors (cpu_vector.h: one AVX-512 register, or two 8-lane halves
// elsewhere); the next chunks' rows are prefetched, as they usually sit in other blocks. Decode
// rows take dot products straight from the cache and sum 16 keys at once with a shuffle tree;
// prefill tiles first convert the chunk into a small tile on the stack (K transposed), which their
// many rows then share. Math is fp32 with an online softmax; the pool may hold fp32 or bf16, and
// bf16 on a CPU with AVX512_BF16 multiplies with vdpbf16ps (its decode rows update their softmax
// once per 256 keys: attend_decode_segment).
//
// Sequences with 16 or more query tokens over a bf16 pool go to paged_attention_matrix.cpp
// instead, where the CPU has bf16 matrix products (bf16_product.h: AMX, AVX512_BF16, or AVX2's
// FMA), which prefill faster on AMX and vdpbf16ps (on AVX2's FMA the gain is the same bits
// whether a prompt's beginning came from the cache or not). There, too, decode sequences whose
// tables begin with the same blocks attend over those blocks together ("shared prefixes"
// below), reading them once for all. (Measurements: docs/performance.md.)

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16_product.h"
#include "cpu_vector.h"
#include "paged_attention_matrix.h"
#include "work_items.h"

namespace {

using namespace prefixgate;

constexpr int64_t kTileTokens = 16;   // query tokens per prefill work item
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 16;     // query heads per KV head
// From this many rows on, a chunk is packed first (attend_direct's switch takes fewer).
constexpr int64_t kPackRows = 8;
// Chunks prefetched ahead (each again nearer: `prefetch`): 4, or what build.py measured
// best on this CPU (Zen 4: 2).
#ifndef PREFIXGATE_PREFETCH_AHEAD
#define PREFIXGATE_PREFETCH_AHEAD 4
#endif
constexpr int64_t kAhead = PREFIXGATE_PREFETCH_AHEAD;
constexpr int64_t kSegmentKeys = 256; // keys per softmax update of bf16 decode rows
constexpr int32_t kEveryHead = -1;    // a work item's kv_head: all of them (`every_head_items`)

// Two vectors of partial sums folded into one, level `level` (0-3) of a tree that sums
// sixteen vectors' lanes: with w = 8 >> level, lanes 0-7 of the result come from a and 8-15 from
// b, each the sum of two lanes w apart (lane m: v[base + i] + v[base + w + i], m = seg * w + i,
// base = 2 * seg * w).
inline vfloat fold(vfloat a, vfloat b, int level) {
#if defined(PREFIXGATE_VECTOR_REGISTERS) && defined(__GNUC__) && !defined(__clang__)
  static const vint low[4] = {  // lane indices into a (0-15) and b (16-31)
      {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
      {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
      {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
      {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
  static const vint high[4] = {
      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
      {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
      {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
      {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
  return __builtin_shuffle(a, b, low[level]) + __builtin_shuffle(a, b, high[level]);
#elif !defined(PREFIXGATE_VECTOR_REGISTERS) && defined(__AVX__)
  // A vfloat of two 8-lane halves: a's 16 lanes fold into the result's low half, b's into its
  // high half. Level 0 adds the halves; the others pair 128-bit quarters, then their lanes.
  const auto half = [level](vfloat v) {
    if (level == 0) return v.low + v.high;
    const __m256 x = _mm256_permute2f128_ps((__m256)v.low, (__m256)v.high, 0x20);  // 0-3, 8-11
    const __m256 y = _mm256_permute2f128_ps((__m256)v.low, (__m256)v.high, 0x31);  // 4-7, 12-15
    if (level == 1) return (vfloat8)_mm256_add_ps(x, y);
    if (level == 2) {
      return (vfloat8)_mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    return (vfloat8)_mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return {half(a), half(b)};
#else
  const int64_t w = 8 >> level;
  alignas(64) float out[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) {
    const vfloat& v = k < 8 ? a : b;
    const int64_t m = k % 8, base = 2 * (m / w) * w, i = m % w;
    out[k] = v[base + i] + v[base + w + i];
  }
  return load(out);
#endif
}

// Sixteen vectors into one: lane j of the result is the sum of the lanes of parts[j]. A tree
// of folds (15) instead of sixteen 15-add horizontal sums.
inline vfloat transpose_sum(const vfloat* parts) {
  vfloat level[8];
  for (int i = 0; i < 8; ++i) level[i] = fold(parts[2 * i], parts[2 * i + 1], 0);
  for (int i = 0; i < 4; ++i) level[i] = fold(level[2 * i], level[2 * i + 1], 1);
  for (int i = 0; i < 2; ++i) level[i] = fold(level[2 * i], level[2 * i + 1], 2);
  return fold(level[0], level[1], 3);
}

inline float to_float(float value) { return value; }
inline float to_float(c10::BFloat16 value) { return static_cast<float>(value); }

// One item's rows: query (pre-scaled), running max and sum, and the output accumulator.
struct Rows {
  int64_t count, dim;
  std::vector<float> q, acc, max, sum;
  std::vector<int64_t> position;
  Rows(int64_t rows, int64_t dim_)
      : count(rows), dim(dim_), q(rows * dim_), acc(rows * dim_, 0.0f), max(rows, kMasked),
        sum(rows, 0.0f), position(rows) {}
};

// Scores of a chunk for one row -> probabilities, with the running max and sum updated and the
// accumulator rescaled. Returns false when the row sees no key of the chunk.
inline bool softmax_chunk(Rows& rows, int64_t r, vfloat& scores, int64_t chunk_start,
                          int64_t context_len, int64_t window) {
  const int64_t position = rows.position[r];
  const vfloat key_position = lane_index() + static_cast<float>(chunk_start);
  const float last = static_cast<float>(std::min(position, context_len - 1));
  const float first = window > 0 ? static_cast<float>(position - window + 1) : -1.0f;
  const vmask visible = (key_position <= last) & (key_position >= first);
  scores = where(visible, scores, splat(kMasked));
  const float chunk_max = lanes_max(scores);
  if (chunk_max <= kMasked) return false;
  const float new_max = std::max(rows.max[r], chunk_max);
  const float correction = new_max == rows.max[r] ? 1.0f : std::exp(rows.max[r] - new_max);
  rows.max[r] = new_max;
  scores = where(visible, vexp(scores - new_max), splat(0.0f));
  rows.sum[r] = rows.sum[r] * correction + lanes_sum(scores);
  if (correction != 1.0f) {
    float* acc = rows.acc.data() + r * rows.dim;
    for (int64_t d = 0; d < rows.dim; d += kLanes) store(acc + d, load(acc + d) * correction);
  }
  return true;
}

template <typename scalar_t>
struct Chunk {
  const scalar_t* key[kLanes];
  const scalar_t* value[kLanes];
  int64_t start, count;
};

// Every cache line of a chunk's K and V rows (`row_bytes` each), into the cache ahead of use.
// attend_keys and attend_decode_segment prefetch each chunk kAhead times, kAhead chunks ahead,
// then again at every distance down to one (a range's first chunks fewer times), as some
// requests are lost. Four is the default, the distance measured best where prefetching matters
// most; on a Zen 4 EPYC two measured better, and the build takes two there
// (build.py, prefetch_ahead). (Measurements: docs/performance.md.)
// (The matrix path's tiles prefetch on their own.)
template <typename scalar_t>
void prefetch(const Chunk<scalar_t>& chunk, int64_t row_bytes) {
  for (int64_t j = 0; j < chunk.count; ++j) {
    for (int64_t byte = 0; byte < row_bytes; byte += 64) {
      prefetch_l2(reinterpret_cast<const char*>(chunk.key[j]) + byte);
      prefetch_l2(reinterpret_cast<const char*>(chunk.value[j]) + byte);
    }
  }
}

// AVX2 without AVX-512: decode scores in 8-lane registers (chunk_scores).
#if !defined(PREFIXGATE_VECTOR_REGISTERS) && defined(__AVX2__) && defined(__FMA__)
#define PREFIXGATE_EIGHT_LANE_SCORES 1
#endif

#if defined(PREFIXGATE_EIGHT_LANE_SCORES)
// Eight vectors into one: lane j of the result is the sum of the lanes of parts[j].
inline __m256 transpose_sum8(const __m256* parts) {
  const __m256 t0 = _mm256_hadd_ps(parts[0], parts[1]), t1 = _mm256_hadd_ps(parts[2], parts[3]);
  const __m256 t2 = _mm256_hadd_ps(parts[4], parts[5]), t3 = _mm256_hadd_ps(parts[6], parts[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q.k of a chunk's keys for each row, as 16-lane scores (lane j: key j, 0 past the chunk), on
// 8-lane registers: a row takes 8 keys at a time, their 8 partial sums in 8 registers, and K is
// widened to fp32 once for all rows. The 16-lane form below keeps 16 partial vectors per row, a
// pair of registers each here: they lived on the stack, a load and a store around every FMA.
template <typename scalar_t>
void chunk_scores(const Rows& rows, const Chunk<scalar_t>& chunk, vfloat* scores) {
  const int64_t dim = rows.dim;
  alignas(32) static const float zeros[kMaxHeadDim] = {};
  alignas(32) float widened[kLanes * kMaxHeadDim];
  const float* keys[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    if (j >= chunk.count) {
      keys[j] = zeros;
    } else if constexpr (std::is_same_v<scalar_t, float>) {
      keys[j] = chunk.key[j];
    } else {
      float* target = widened + j * dim;
      for (int64_t d = 0; d < dim; d += kLanes) store(target + d, load(chunk.key[j] + d));
      keys[j] = target;
    }
  }
  for (int64_t r = 0; r < rows.count; ++r) {
    const float* q = rows.q.data() + r * dim;
    __m256 halves[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int h = 0; h < 2 && 8 * h < chunk.count; ++h) {
      __m256 parts[8];
      for (int j = 0; j < 8; ++j) parts[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 query = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j) {
          parts[j] = _mm256_fmadd_ps(query, _mm256_loadu_ps(keys[8 * h + j] + d), parts[j]);
        }
      }
      halves[h] = transpose_sum8(parts);
    }
    scores[r] = vfloat{(vfloat8)halves[0], (vfloat8)halves[1]};
  }
}
#endif

// Decode and short tiles: dot products straight from the cache, each K and V row loaded once
// for all R rows of the item (the query heads of one KV head). R is a template argument so
// that P x V keeps its R accumulators in registers and takes each probability as one broadcast
// from a small array; with R known only at run time, GCC kept the accumulators on the stack (a
// store and a load around every FMA, in one dependent chain per row).
template <int R, typename scalar_t>
void attend_direct_rows(Rows& rows, const Chunk<scalar_t>& chunk, int64_t context_len,
                        int64_t window) {
  const int64_t dim = rows.dim;
  vfloat probabilities[kPackRows];
#if defined(PREFIXGATE_EIGHT_LANE_SCORES)
  chunk_scores(rows, chunk, probabilities);
#else
  vfloat partial[R][kLanes];
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kLanes; ++j) partial[r][j] = splat(0.0f);
  }
  for (int64_t j = 0; j < chunk.count; ++j) {
    for (int64_t d = 0; d < dim; d += kLanes) {
      const vfloat k = load(chunk.key[j] + d);
      for (int r = 0; r < R; ++r) partial[r][j] += load(rows.q.data() + r * dim + d) * k;
    }
  }
  for (int r = 0; r < R; ++r) probabilities[r] = transpose_sum(partial[r]);
#endif
  bool any = false;
  alignas(64) float p[R][kLanes];
  for (int r = 0; r < R; ++r) {
    const bool seen = rows.position[r] >= chunk.start &&
                      softmax_chunk(rows, r, probabilities[r], chunk.start, context_len, window);
    store(p[r], seen ? probabilities[r] : splat(0.0f));
    any = any || seen;
  }
  if (!any) return;
  for (int64_t d = 0; d < dim; d += kLanes) {
    vfloat total[R];
    for (int r = 0; r < R; ++r) total[r] = load(rows.acc.data() + r * dim + d);
    for (int64_t j = 0; j < chunk.count; ++j) {
      const vfloat v = load(chunk.value[j] + d);
      for (int r = 0; r < R; ++r) total[r] += p[r][j] * v;
    }
    for (int r = 0; r < R; ++r) store(rows.acc.data() + r * dim + d, total[r]);
  }
}

template <typename scalar_t>
void attend_direct(Rows& rows, const Chunk<scalar_t>& chunk, int64_t context_len,
                   int64_t window) {
  switch (rows.count) {
    case 1: attend_direct_rows<1>(rows, chunk, context_len, window); break;
    case 2: attend_direct_rows<2>(rows, chunk, context_len, window); break;
    case 3: attend_direct_rows<3>(rows, chunk, context_len, window); break;
    case 4: attend_direct_rows<4>(rows, chunk, context_len, window); break;
    case 5: attend_direct_rows<5>(rows, chunk, context_len, window); break;
    case 6: attend_direct_rows<6>(rows, chunk, context_len, window); break;
    case 7: attend_direct_rows<7>(rows, chunk, context_len, window); break;
    default: TORCH_CHECK(false, "a direct item has 1 to kPackRows - 1 rows");
  }
}

// Prefill tiles: the chunk converted once (K transposed), then shared by 4 rows at a time.
template <typename scalar_t>
void attend_packed(Rows& rows, const Chunk<scalar_t>& chunk, int64_t context_len,
                   int64_t window, float* key_t, float* value) {
  const int64_t dim = rows.dim;
  for (int64_t j = 0; j < kLanes; ++j) {
    for (int64_t d = 0; d < dim; ++d) {
      const bool present = j < chunk.count;
      key_t[d * kLanes + j] = present ? to_float(chunk.key[j][d]) : 0.0f;
      value[j * dim + d] = present ? to_float(chunk.value[j][d]) : 0.0f;
    }
  }
  for (int64_t first = 0; first < rows.count; first += 4) {
    const int64_t n = std::min<int64_t>(4, rows.count - first);
    vfloat scores[4] = {splat(0.0f), splat(0.0f), splat(0.0f), splat(0.0f)};
    const float* q = rows.q.data() + first * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const vfloat k = load(key_t + d * kLanes);
      for (int64_t i = 0; i < 4; ++i) scores[i] += q[(i < n ? i : 0) * dim + d] * k;
    }
    bool any[4] = {false, false, false, false};
    for (int64_t i = 0; i < n; ++i) {
      any[i] = rows.position[first + i] >= chunk.start &&
               softmax_chunk(rows, first + i, scores[i], chunk.start, context_len, window);
      if (!any[i]) scores[i] = splat(0.0f);
    }
    for (int64_t d = 0; d < dim; d += kLanes) {
      vfloat total[4];
      for (int64_t i = 0; i < 4; ++i) total[i] = load(rows.acc.data() + (first + (i < n ? i : 0)) * dim + d);
      for (int64_t j = 0; j < kLanes; ++j) {
        const vfloat v = load(value + j * dim + d);
        for (int64_t i = 0; i < 4; ++i) total[i] += scores[i][j] * v;
      }
      for (int64_t i = 0; i < n; ++i) {
        if (any[i]) store(rows.acc.data() + (first + i) * dim + d, total[i]);
      }
    }
  }
}

#if defined(__AVX512BF16__)
// Prefill tiles over a bf16 pool on a CPU with AVX512_BF16: `vdpbf16ps` multiplies pairs of
// bf16 and accumulates in fp32, twice the work of an fp32 FMA per instruction. K is packed as
// [dim / 2][16 keys] pairs of dims, V as [8 key pairs][dim] pairs of keys; queries stay exact
// bf16 (the scale is applied to the fp32 scores) and the probabilities are rounded to bf16 for
// P x V, as GPU flash attention does.
void attend_packed_bf16(Rows& rows, const uint32_t* query_pairs, const Chunk<c10::BFloat16>& chunk,
                        int64_t context_len, int64_t window, float scale, uint32_t* key_pairs,
                        uint32_t* value_pairs) {
  const int64_t dim = rows.dim, pairs = dim / 2;
  for (int64_t j = 0; j < kLanes; ++j) {
    const auto* source = reinterpret_cast<const uint32_t*>(chunk.key[j < chunk.count ? j : 0]);
    for (int64_t p = 0; p < pairs; ++p) key_pairs[p * kLanes + j] = j < chunk.count ? source[p] : 0;
  }
  for (int64_t pair = 0; pair < kLanes / 2; ++pair) {
    const int64_t first = 2 * pair, second = 2 * pair + 1;
    const auto* a = reinterpret_cast<const uint16_t*>(chunk.value[first < chunk.count ? first : 0]);
    const auto* b = reinterpret_cast<const uint16_t*>(chunk.value[second < chunk.count ? second : 0]);
    for (int64_t d = 0; d < dim; ++d) {
      const uint32_t low = first < chunk.count ? a[d] : 0, high = second < chunk.count ? b[d] : 0;
      value_pairs[pair * dim + d] = low | (high << 16);
    }
  }
  for (int64_t first = 0; first < rows.count; first += 4) {
    const int64_t n = std::min<int64_t>(4, rows.count - first);
    __m512 dots[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                      _mm512_setzero_ps()};
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(key_pairs + p * kLanes);
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t row = first + (i < n ? i : 0);
        const __m512bh q = (__m512bh)_mm512_set1_epi32(query_pairs[row * pairs + p]);
        dots[i] = _mm512_dpbf16_ps(dots[i], q, k);
      }
    }
    uint32_t probability_pairs[4][kLanes / 2];
    bool any[4] = {false, false, false, false};
    for (int64_t i = 0; i < n; ++i) {
      vfloat scores;
      std::memcpy(&scores, &dots[i], sizeof(scores));
      scores *= scale;
      any[i] = rows.position[first + i] >= chunk.start &&
               softmax_chunk(rows, first + i, scores, chunk.start, context_len, window);
      if (!any[i]) scores = splat(0.0f);
      __m512 wide;
      std::memcpy(&wide, &scores, sizeof(wide));
      const __m256bh narrow = _mm512_cvtneps_pbh(wide);
      std::memcpy(probability_pairs[i], &narrow, sizeof(narrow));
    }
    for (int64_t i = n; i < 4; ++i) std::memcpy(probability_pairs[i], probability_pairs[0], 32);
    for (int64_t d = 0; d < dim; d += kLanes) {
      __m512 total[4];
      for (int64_t i = 0; i < 4; ++i) {
        total[i] = _mm512_loadu_ps(rows.acc.data() + (first + (i < n ? i : 0)) * dim + d);
      }
      for (int64_t pair = 0; pair < kLanes / 2; ++pair) {
        const __m512bh v = (__m512bh)_mm512_loadu_si512(value_pairs + pair * dim + d);
        for (int64_t i = 0; i < 4; ++i) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(probability_pairs[i][pair]);
          total[i] = _mm512_dpbf16_ps(total[i], p, v);
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        if (any[i]) _mm512_storeu_ps(rows.acc.data() + (first + i) * dim + d, total[i]);
      }
    }
  }
}
// Short rows (decode, short tiles) over a bf16 pool on a CPU with AVX512_BF16 where head_dim
// is not a multiple of 32 (attend_decode_segment takes the others): attend_direct with
// vdpbf16ps for both products (q.k over pairs of dims, p.v over pairs of keys).
void attend_direct_bf16(Rows& rows, const uint32_t* query_pairs,
                        const Chunk<c10::BFloat16>& chunk, int64_t context_len, int64_t window,
                        float scale) {
  const int64_t dim = rows.dim, count = rows.count, pairs = dim / 2;
  __m512 partial[kPackRows][kLanes];
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t j = 0; j < kLanes; ++j) partial[r][j] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < chunk.count; ++j) {
    const auto* key = reinterpret_cast<const uint32_t*>(chunk.key[j]);
    for (int64_t p = 0; p < pairs; p += kLanes) {
      // A head of 16 or 48 dims ends half-way through a vector of 16 pairs.
      const __mmask16 lanes = pairs - p >= kLanes ? 0xFFFF : (1u << (pairs - p)) - 1;
      const __m512bh k = (__m512bh)_mm512_maskz_loadu_epi32(lanes, key + p);
      for (int64_t r = 0; r < count; ++r) {
        const __m512bh q = (__m512bh)_mm512_maskz_loadu_epi32(lanes, query_pairs + r * pairs + p);
        partial[r][j] = _mm512_dpbf16_ps(partial[r][j], q, k);
      }
    }
  }
  uint32_t probability_pairs[kPackRows][kLanes / 2];
  bool any = false;
  for (int64_t r = 0; r < count; ++r) {
    vfloat parts[kLanes];
    std::memcpy(parts, partial[r], sizeof(parts));
    vfloat scores = transpose_sum(parts) * scale;
    const bool seen = rows.position[r] >= chunk.start &&
                      softmax_chunk(rows, r, scores, chunk.start, context_len, window);
    if (!seen) scores = splat(0.0f);
    any = any || seen;
    __m512 wide;
    std::memcpy(&wide, &scores, sizeof(wide));
    const __m256bh narrow = _mm512_cvtneps_pbh(wide);
    std::memcpy(probability_pairs[r], &narrow, sizeof(narrow));
  }
  if (!any) return;
  const int64_t key_pairs = (chunk.count + 1) / 2;
  for (int64_t d = 0; d < dim; d += kLanes) {
    __m512 total[kPackRows];
    for (int64_t r = 0; r < count; ++r) total[r] = _mm512_loadu_ps(rows.acc.data() + r * dim + d);
    for (int64_t pair = 0; pair < key_pairs; ++pair) {
      const int64_t first = 2 * pair, second = 2 * pair + 1;
      const __m512i low = _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk.value[first] + d)));
      __m512i high = _mm512_setzero_si512();
      if (second < chunk.count) {
        high = _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk.value[second] + d)));
      }
      const __m512bh v = (__m512bh)_mm512_or_si512(low, _mm512_slli_epi32(high, 16));
      for (int64_t r = 0; r < count; ++r) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(probability_pairs[r][pair]);
        total[r] = _mm512_dpbf16_ps(total[r], p, v);
      }
    }
    for (int64_t r = 0; r < count; ++r) _mm512_storeu_ps(rows.acc.data() + r * dim + d, total[r]);
  }
}

// Decode rows (fewer than kPackRows, R of them: the query heads of a KV head) over a bf16 pool,
// head_dim a multiple of 32, for one segment of up to kSegmentKeys keys (`count` chunks; the
// chunks after them, up to `available`, are prefetched too). Three passes:
//   1. Scores of every chunk: each key's dot products folded into 16-lane scores as they come
//      (transpose_sum's tree, one level per pair of keys), masked where a row cannot see a key.
//   2. One online-softmax update per row for the whole segment: one max, one sum and one
//      rescale of the accumulators, where updating every 16 keys made each chunk wait on the
//      last (measured slower).
//   3. P x V, V rows of two keys paired with two unpacks for vdpbf16ps, every row's
//      accumulators for 32 dims in registers across the segment.
// The accumulators hold dims in decode_slot order; attend_item puts them back.
template <int R>
void attend_decode_segment(Rows& rows, const uint32_t* query_pairs,
                           const Chunk<c10::BFloat16>* chunks, int64_t count,
                           int64_t available, int64_t context_len, int64_t window, float scale) {
  const int64_t dim = rows.dim, pairs = dim / 2;
  alignas(64) float scores[R][kSegmentKeys];
  alignas(64) uint32_t probability_pairs[R][kSegmentKeys / 2];
  vfloat best[R];
  for (int r = 0; r < R; ++r) best[r] = splat(kMasked);
  int64_t seen_last = -1, seen_first = 0;  // keys every row sees: [seen_first, seen_last]
  for (int r = 0; r < R; ++r) {
    const int64_t position = rows.position[r];
    seen_last = r == 0 ? std::min(position, context_len - 1)
                       : std::min(seen_last, std::min(position, context_len - 1));
    const int64_t first = window > 0 ? position - window + 1 : 0;
    seen_first = r == 0 ? first : std::max(seen_first, first);
  }
  const vfloat lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t c = 0; c < count; ++c) {
    const Chunk<c10::BFloat16>& chunk = chunks[c];
    for (int64_t ahead = kAhead; ahead >= 1; --ahead) {  // usually in other blocks
      if (c + ahead < available) prefetch(chunks[c + ahead], dim * 2);
    }
    vfloat pending[4][R], node_scores[R];
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) {
      vfloat dots[R];
      for (int r = 0; r < R; ++r) dots[r] = splat(0.0f);
      if (j < chunk.count) {
        const auto* key = reinterpret_cast<const uint32_t*>(chunk.key[j]);
        for (int64_t p = 0; p < pairs; p += kLanes) {
          const __m512bh k = (__m512bh)_mm512_loadu_si512(key + p);
          for (int r = 0; r < R; ++r) {
            const __m512bh q = (__m512bh)_mm512_loadu_si512(query_pairs + r * pairs + p);
            dots[r] = (vfloat)_mm512_dpbf16_ps((__m512)dots[r], q, k);
          }
        }
      }
      // Key j completes the tree's nodes whose span ends at j.
      for (int r = 0; r < R; ++r) {
        vfloat node = dots[r];
        int level = 0;
        for (; level < 4 && (j >> level) & 1; ++level) node = fold(pending[level][r], node, level);
        if (level < 4) {
          pending[level][r] = node;
        } else {
          node_scores[r] = node;
        }
      }
    }
    const bool whole = chunk.start >= seen_first && chunk.start + kLanes - 1 <= seen_last;
    for (int r = 0; r < R; ++r) {
      vfloat x = node_scores[r] * scale;
      if (!whole) {
        const int64_t position = rows.position[r];
        const vfloat key_position = lane + static_cast<float>(chunk.start);
        const float last = static_cast<float>(std::min(position, context_len - 1));
        const float first = window > 0 ? static_cast<float>(position - window + 1) : -1.0f;
        const auto visible = (key_position <= last) & (key_position >= first);
        x = visible ? x : splat(kMasked);
      }
      store(scores[r] + c * kLanes, x);
      best[r] = best[r] > x ? best[r] : x;
    }
  }
  bool any = false;
  for (int r = 0; r < R; ++r) {
    const float segment_max = lanes_max(best[r]);
    if (segment_max <= kMasked) {
      std::memset(probability_pairs[r], 0, count * kLanes * 2);
      continue;
    }
    any = true;
    const float new_max = std::max(rows.max[r], segment_max);
    const float correction = new_max == rows.max[r] ? 1.0f : std::exp(rows.max[r] - new_max);
    rows.max[r] = new_max;
    const float shift = new_max * kLog2e;
    vfloat total = splat(0.0f);
    for (int64_t c = 0; c < count; ++c) {
      const vfloat p = vexp2_softmax(load(scores[r] + c * kLanes) * kLog2e - shift);
      total += p;
      store_bf16(reinterpret_cast<uint16_t*>(probability_pairs[r] + c * kLanes / 2), p);
    }
    rows.sum[r] = rows.sum[r] * correction + lanes_sum(total);
    if (correction != 1.0f) {
      float* acc = rows.acc.data() + r * dim;
      for (int64_t d = 0; d < dim; d += kLanes) store(acc + d, load(acc + d) * correction);
    }
  }
  if (!any) return;
  for (int64_t block = 0; block < dim; block += 32) {
    __m512 low[R], high[R];
    for (int r = 0; r < R; ++r) {
      low[r] = _mm512_loadu_ps(rows.acc.data() + r * dim + block);
      high[r] = _mm512_loadu_ps(rows.acc.data() + r * dim + block + kLanes);
    }
    for (int64_t c = 0; c < count; ++c) {
      const Chunk<c10::BFloat16>& chunk = chunks[c];
      const int64_t key_pairs = (chunk.count + 1) / 2;
      for (int64_t pair = 0; pair < key_pairs; ++pair) {
        const int64_t first = 2 * pair, second = first + 1;
        const __m512i a = _mm512_loadu_si512(chunk.value[first] + block);
        const __m512i b = second < chunk.count ? _mm512_loadu_si512(chunk.value[second] + block)
                                               : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int r = 0; r < R; ++r) {
          const __m512bh p =
              (__m512bh)_mm512_set1_epi32(probability_pairs[r][c * kLanes / 2 + pair]);
          low[r] = _mm512_dpbf16_ps(low[r], p, lo);
          high[r] = _mm512_dpbf16_ps(high[r], p, hi);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(rows.acc.data() + r * dim + block, low[r]);
      _mm512_storeu_ps(rows.acc.data() + r * dim + block + kLanes, high[r]);
    }
  }
}

// attend_decode_segment for `rows.count` (1 to kPackRows - 1) rows.
void attend_decode_segment_rows(Rows& rows, const uint32_t* query_pairs,
                                const Chunk<c10::BFloat16>* chunks, int64_t count,
                                int64_t available, int64_t context_len, int64_t window,
                                float scale) {
  switch (rows.count) {
#define PREFIXGATE_SEGMENT_ROWS(n)                                                             \
  case n:                                                                                      \
    attend_decode_segment<n>(rows, query_pairs, chunks, count, available, context_len, window, \
                             scale);                                                           \
    return;
    PREFIXGATE_SEGMENT_ROWS(1)
    PREFIXGATE_SEGMENT_ROWS(2)
    PREFIXGATE_SEGMENT_ROWS(3)
    PREFIXGATE_SEGMENT_ROWS(4)
    PREFIXGATE_SEGMENT_ROWS(5)
    PREFIXGATE_SEGMENT_ROWS(6)
    PREFIXGATE_SEGMENT_ROWS(7)
#undef PREFIXGATE_SEGMENT_ROWS
    default:
      TORCH_CHECK(false, "decode rows must be fewer than ", kPackRows);
  }
}

constexpr bool kNativeBf16 = true;
#else
constexpr bool kNativeBf16 = false;
#endif

// Where dim d of a 32-dim block sits in the decode path's accumulators: V rows of two keys are
// interleaved with unpacklo/hi_epi16, which work within 128-bit lanes, so the "lo" product
// holds dims 0-3, 8-11, 16-19, 24-27 and the "hi" product the others.
inline int64_t decode_slot(int64_t d) {
  const int64_t block = d / 32, within = d % 32, lane = within / 8, i = within % 8;
  return block * 32 + (i < 4 ? 4 * lane + i : 16 + 4 * lane + i - 4);
}

// One row's accumulators from dims in order into the decode layout (`to_layout`), or back.
inline void reorder_decode_slots(float* acc, int64_t dim, bool to_layout) {
  alignas(64) float copy[kMaxHeadDim];
  std::memcpy(copy, acc, dim * sizeof(float));
  for (int64_t d = 0; d < dim; ++d) {
    if (to_layout) {
      acc[decode_slot(d)] = copy[d];
    } else {
      acc[d] = copy[decode_slot(d)];
    }
  }
}

// Keys [from, to) of KV head `kv_head`, read through `block_table`, into `rows`: chunks of
// kLanes keys, the next kAhead prefetched (they usually sit in other blocks, anywhere in the
// pool, so decode is not a chain of cache misses); decode rows in the decode layout take them
// a segment of kSegmentKeys at a time. Keys at or past `context_len` are unseen.
template <typename scalar_t, bool dot_bf16>
void attend_keys(const Geometry& g, Rows& rows, const uint32_t* query_pairs,
                 const scalar_t* key_cache, const scalar_t* value_cache,
                 const int32_t* block_table, int64_t kv_head, int64_t from, int64_t to,
                 int64_t context_len, bool decode_layout) {
  const int64_t dim = g.head_dim, kv_offset = kv_head * dim;
  alignas(64) float key_t[kMaxHeadDim * kLanes];
  alignas(64) float value[kLanes * kMaxHeadDim];
  const bool packed = rows.count >= kPackRows;
  const auto locate = [&](Chunk<scalar_t>& chunk, int64_t start) {
    chunk.start = start;
    chunk.count = std::min<int64_t>(kLanes, context_len - start);
    int64_t block_index = start / g.block_size, slot = start % g.block_size;
    for (int64_t j = 0; j < chunk.count; ++j) {
      const int64_t offset = block_table[block_index] * g.kv_stride_block +
                             slot * g.kv_stride_token + kv_offset;
      chunk.key[j] = key_cache + offset;
      chunk.value[j] = value_cache + offset;
      if (++slot == g.block_size) {
        slot = 0;
        ++block_index;
      }
    }
  };
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(scalar_t));
  if constexpr (dot_bf16) {
    if (decode_layout) {  // segments of keys, each chunk located once
      constexpr int64_t kSegmentChunks = kSegmentKeys / kLanes;
      Chunk<scalar_t> segment[kSegmentChunks + kAhead];  // and the next segment's first ones
      for (int64_t start = from; start < to; start += kSegmentKeys) {
        const int64_t count = std::min(kSegmentChunks, (to - start + kLanes - 1) / kLanes);
        for (int64_t c = 0; c < count; ++c) locate(segment[c], start + c * kLanes);
        if (start == from) {
          for (int64_t c = 0; c < std::min(count, kAhead); ++c) prefetch(segment[c], row_bytes);
        }
        int64_t next = 0;  // chunks of the next segment located for the prefetches
        for (; next < kAhead && start + kSegmentKeys + next * kLanes < to; ++next) {
          locate(segment[count + next], start + kSegmentKeys + next * kLanes);
        }
        attend_decode_segment_rows(rows, query_pairs, segment, count, count + next,
                                   context_len, g.window, g.scale);
      }
      return;
    }
  }
  // Chunk i sits in ring[i % kRing] from when it is first prefetched until it is attended.
  constexpr int64_t kRing = kAhead + 1;
  Chunk<scalar_t> ring[kRing];
  for (int64_t i = 0; i < kAhead && from + i * kLanes < to; ++i) {
    locate(ring[i], from + i * kLanes);
    prefetch(ring[i], row_bytes);
  }
  for (int64_t i = 0, start = from; start < to; ++i, start += kLanes) {
    const Chunk<scalar_t>& chunk = ring[i % kRing];
    if (start + kAhead * kLanes < to) locate(ring[(i + kAhead) % kRing], start + kAhead * kLanes);
    for (int64_t distance = kAhead; distance >= 1; --distance) {
      if (start + distance * kLanes >= to) continue;
      prefetch(ring[(i + distance) % kRing], row_bytes);
    }
    if constexpr (dot_bf16) {
      if (packed) {
        attend_packed_bf16(rows, query_pairs, chunk, context_len, g.window, g.scale,
                           reinterpret_cast<uint32_t*>(key_t), reinterpret_cast<uint32_t*>(value));
      } else {
        attend_direct_bf16(rows, query_pairs, chunk, context_len, g.window, g.scale);
      }
      continue;
    }
    if (packed) {
      attend_packed(rows, chunk, context_len, g.window, key_t, value);
    } else {
      attend_direct(rows, chunk, context_len, g.window);
    }
  }
}

// Decode sequences of one share group (one tenant) whose block tables begin with the same
// blocks (a prefix cached once that all of them read, a shared system prompt say) attend over
// it together, as matrix products: the prefix's K/V are packed once per step for the whole
// group, all members' query heads are the rows of one product per 256 keys (the vector decode
// loop computes each member alone), and its keys are split into pieces that the threads share.
// Each piece leaves, per row, its partial softmax state (max, sum, unnormalized output); a
// member's own work item merges the pieces' states and goes on over the keys after the prefix.
// The math is the same online softmax, in another order. Only blocks that are the same memory
// in every member's table are shared, so a row never reads a key its own table does not hold.
constexpr int64_t kSharedMinKeys = 64;     // a shorter common prefix is read per sequence
constexpr int64_t kSharedPieceKeys = kMatrixKeyTile;  // keys per work item of a shared prefix

struct SharedGroup {
  std::vector<int32_t> members;  // decode sequences (one query token each)
  int64_t keys = 0;              // positions [0, keys) are shared; a multiple of kLanes
  int64_t pieces = 0;
  int64_t rows = 0;              // members x query heads of a KV head
  int64_t state = 0;             // where its partial states begin in SharedPrefixes::state
};

struct SharedPrefixes {
  std::vector<SharedGroup> groups;
  std::vector<int32_t> group_of, member_of;  // per sequence; -1: none
  // Per group, KV head and piece: max[rows], sum[rows], then acc[rows][dim]; every word is
  // written by its piece before a member reads it. In the calling thread's kept buffer, or
  // where that would be too large to keep, in `owned`.
  float* state = nullptr;
  std::unique_ptr<float[]> owned;

  float* piece_state(const SharedGroup& group, int64_t kv_head, int64_t piece, int64_t dim) {
    return state + group.state + (kv_head * group.pieces + piece) * group.rows * (dim + 2);
  }
};

// `share_groups` says which sequences may be grouped: only those of one group (the engine
// gives each tenant its own), never one of group -1; without it, none is. Grouping changes
// the order of a member's arithmetic, so in bf16 a member's output can depend on who else is
// in its group this step: with groups per tenant, never on another tenant's requests. Prompt
// chunks (`prompts`) are not decoding and never grouped.
SharedPrefixes find_shared_prefixes(const Geometry& g, bool matrix, int64_t sequences,
                                    int64_t kv_heads, const int32_t* starts,
                                    const int32_t* contexts, const int32_t* tables,
                                    const int32_t* share_groups, const int32_t* prompts) {
  SharedPrefixes shared;
  shared.group_of.assign(sequences, -1);
  shared.member_of.assign(sequences, -1);
  // Without the matrix path a member reads the prefix itself: the vector kernel's shared tiles
  // measured slower than its own decode loop over keys the cache already held. A window would
  // make each member see another range.
  if (!matrix || g.window > 0 || share_groups == nullptr) return shared;
  std::vector<std::array<int32_t, 3>> decoding;  // (share group, first block, sequence)
  for (int32_t s = 0; s < sequences; ++s) {
    const int32_t share = share_groups[s];
    const bool prompt = prompts != nullptr && prompts[s] != 0;
    if (share >= 0 && !prompt && starts[s + 1] - starts[s] == 1 && contexts[s] > kSharedMinKeys) {
      decoding.push_back({share, tables[s * g.table_stride], s});
    }
  }
  std::sort(decoding.begin(), decoding.end());
  const auto together = [&](size_t a, size_t b) {
    return decoding[a][0] == decoding[b][0] && decoding[a][1] == decoding[b][1];
  };
  int64_t state = 0;
  for (size_t first = 0; first < decoding.size();) {
    size_t end = first + 1;
    while (end < decoding.size() && together(first, end)) ++end;
    if (end - first >= 2) {
      SharedGroup group;
      const int32_t* leader = tables + decoding[first][2] * g.table_stride;
      // Keys every member sees before its own query position, in blocks common to all.
      int64_t keys = contexts[decoding[first][2]] - 1;
      for (size_t i = first; i < end; ++i) {
        const int32_t s = decoding[i][2];
        const int32_t* table = tables + s * g.table_stride;
        int64_t common = 0;
        while (common * g.block_size < keys && table[common] == leader[common]) ++common;
        keys = std::min<int64_t>({keys, common * g.block_size, contexts[s] - 1});
        group.members.push_back(s);
      }
      keys -= keys % kLanes;
      if (keys >= kSharedMinKeys) {
        group.keys = keys;
        group.pieces = (keys + kSharedPieceKeys - 1) / kSharedPieceKeys;
        group.rows = static_cast<int64_t>(group.members.size()) * g.group;
        group.state = state;
        state += kv_heads * group.pieces * group.rows * (g.head_dim + 2);
        for (size_t m = 0; m < group.members.size(); ++m) {
          shared.group_of[group.members[m]] = static_cast<int32_t>(shared.groups.size());
          shared.member_of[group.members[m]] = static_cast<int32_t>(m);
        }
        shared.groups.push_back(std::move(group));
      }
    }
    first = end;
  }
  // Kept by the calling thread from call to call, up to kKeptStateFloats (4 MB): zeroing a new
  // vector of the decodes' states at each call kept the other threads waiting.
  constexpr int64_t kKeptStateFloats = int64_t{1} << 20;
  thread_local std::vector<float> kept;
  if (state > kKeptStateFloats) {
    shared.owned.reset(new float[state]);
    shared.state = shared.owned.get();
  } else {
    if (static_cast<int64_t>(kept.size()) < state) kept.resize(state);
    shared.state = kept.data();
  }
  return shared;
}

// One piece of a group's shared prefix for one KV head, every member's query heads as rows, as
// matrix products.
void attend_shared_piece(const Geometry& g, SharedPrefixes& shared, const WorkItem& item,
                         const c10::BFloat16* query, const c10::BFloat16* key_cache,
                         const c10::BFloat16* value_cache, const int32_t* tables,
                         const int32_t* starts, Fetch fetch) {
  const SharedGroup& group = shared.groups[item.sequence];
  std::vector<const c10::BFloat16*> queries(group.rows);
  for (int64_t r = 0; r < group.rows; ++r) {
    const int64_t head = item.kv_head * g.group + r % g.group;
    queries[r] = query + starts[group.members[r / g.group]] * g.q_stride_token +
                 head * g.q_stride_head;
  }
  const int64_t first = item.first_token * kSharedPieceKeys;
  attend_shared_tile(g, tables + group.members[0] * g.table_stride, first,
                     std::min(group.keys, first + kSharedPieceKeys), item.kv_head, queries,
                     key_cache, value_cache,
                     shared.piece_state(group, item.kv_head, item.first_token, g.head_dim), fetch);
}

// A member's rows start from the merged states of its group's pieces (`decode_layout`: the
// accumulators in decode_slot order).
void start_from_shared(Rows& rows, SharedPrefixes& shared, const SharedGroup& group,
                       int64_t member, int64_t kv_head, bool decode_layout) {
  const int64_t dim = rows.dim;
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t row = member * rows.count + r;  // the member's row in the group's pieces
    float best = kMasked;
    for (int64_t p = 0; p < group.pieces; ++p) {
      best = std::max(best, shared.piece_state(group, kv_head, p, dim)[row]);
    }
    float sum = 0.0f;
    float* acc = rows.acc.data() + r * dim;
    for (int64_t p = 0; p < group.pieces; ++p) {
      const float* state = shared.piece_state(group, kv_head, p, dim);
      if (state[row] <= kMasked) continue;
      const float weight = std::exp(state[row] - best);
      sum += weight * state[group.rows + row];
      const float* piece_acc = state + 2 * group.rows + row * dim;
      for (int64_t d = 0; d < dim; d += kLanes) {
        store(acc + d, load(acc + d) + load(piece_acc + d) * weight);
      }
    }
    if (decode_layout) reorder_decode_slots(acc, dim, true);
    rows.max[r] = best;
    rows.sum[r] = sum;
  }
}

// One KV head of an item (`item.kv_head` is ignored: items of every head take them one after
// another).
template <typename scalar_t>
void attend_item(const Geometry& g, const WorkItem& item, int64_t kv_head,
                 const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
                 const int32_t* block_table, int64_t query_start, int64_t query_len,
                 int64_t context_len, SharedPrefixes& shared, scalar_t* out) {
  const int64_t dim = g.head_dim, group = g.group;
  Rows rows(item.tokens * group, dim);
  const int64_t first_position = context_len - query_len + item.first_token;
  // bf16 on a CPU with AVX512_BF16 multiplies the queries as they came, in pairs of bf16;
  // everything else takes them as fp32 with the scale folded in.
  constexpr bool dot_bf16 = kNativeBf16 && std::is_same_v<scalar_t, c10::BFloat16>;
  std::vector<uint32_t> query_pairs(dot_bf16 ? rows.count * dim / 2 : 0);
  // Row r is token r / group of the tile, head kv_head * group + r % group.
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t token = query_start + item.first_token + r / group;
    const int64_t head = kv_head * group + r % group;
    const scalar_t* source = query + token * g.q_stride_token + head * g.q_stride_head;
    if (dot_bf16) {
      std::memcpy(query_pairs.data() + r * dim / 2, source, dim * sizeof(scalar_t));
    } else {
      for (int64_t d = 0; d < dim; ++d) rows.q[r * dim + d] = to_float(source[d]) * g.scale;
    }
    rows.position[r] = first_position + r / group;
  }
  const int64_t last_position = first_position + item.tokens - 1;
  int64_t lowest = 0;
  if (g.window > 0) lowest = std::max<int64_t>(0, first_position - g.window + 1);
  // Short rows over bf16 with head_dim a multiple of 32 take attend_decode_segment, whose
  // accumulators hold the dims in decode_slot order.
  const bool decode_layout = dot_bf16 && rows.count < kPackRows && dim % 32 == 0;
  int64_t from = lowest - lowest % kLanes;
  const int32_t grouped = shared.group_of[item.sequence];
  if (grouped >= 0) {
    const SharedGroup& members = shared.groups[grouped];
    start_from_shared(rows, shared, members, shared.member_of[item.sequence], kv_head,
                      decode_layout);
    from = members.keys;
  }
  attend_keys<scalar_t, dot_bf16>(g, rows, query_pairs.data(), key_cache, value_cache,
                                  block_table, kv_head, from, last_position + 1,
                                  context_len, decode_layout);

  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t token = query_start + item.first_token + r / group;
    const int64_t head = kv_head * group + r % group;
    scalar_t* target = out + (token * g.heads + head) * dim;
    const float inverse = rows.sum[r] > 0.0f ? 1.0f / rows.sum[r] : 0.0f;
    float* acc = rows.acc.data() + r * dim;
    if (decode_layout) reorder_decode_slots(acc, dim, false);
    // bf16 rounds as the matrix path's outputs do (with AVX512_BF16 `vcvtneps2bf16`, which
    // flushes an fp32 subnormal to zero where a scalar conversion kept it).
    for (int64_t d = 0; d < dim; d += kLanes) store(target + d, load(acc + d) * inverse);
  }
}

// The K and V blocks that a lane's bf16 decode items (every_head_items) read after their shared
// prefixes (ungrouped: all of theirs), in the order they read them.
std::vector<const char*> own_blocks(const Geometry& g, const SharedPrefixes& shared,
                                    const std::vector<WorkItem>& items, const c10::BFloat16* k,
                                    const c10::BFloat16* v, const int32_t* tables,
                                    const int32_t* contexts) {
  std::vector<const char*> blocks;
  for (const WorkItem& item : items) {
    if (item.kv_head != kEveryHead) continue;
    const int32_t s = item.sequence, grouped = shared.group_of[s];
    const int64_t from = grouped >= 0 ? shared.groups[grouped].keys : 0;
    const int32_t* table = tables + s * g.table_stride;
    for (int64_t b = from / g.block_size; b * g.block_size < contexts[s]; ++b) {
      blocks.push_back(reinterpret_cast<const char*>(k + table[b] * g.kv_stride_block));
      blocks.push_back(reinterpret_cast<const char*>(v + table[b] * g.kv_stride_block));
    }
  }
  return blocks;
}

template <typename scalar_t>
void run_items(const Geometry& g, SharedPrefixes& shared,
               const std::vector<std::vector<WorkItem>>& shared_lanes,
               const std::vector<std::vector<WorkItem>>& lanes, const at::Tensor& query,
               const at::Tensor& key_cache, const at::Tensor& value_cache, const int32_t* tables,
               const int32_t* starts, const int32_t* contexts, const at::Tensor& out) {
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_cache.data_ptr<scalar_t>();
  const scalar_t* v = value_cache.data_ptr<scalar_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t kv_heads = g.heads / g.group;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {  // only bf16 pools share prefixes
    if (!shared.groups.empty()) {  // the shared prefixes' pieces first: members start from them
      const bool fetches = products_fetch(amx_products());
      at::parallel_for(0, static_cast<int64_t>(shared_lanes.size()), 1,
                       [&](int64_t begin, int64_t end) {
        for (int64_t lane = begin; lane < end; ++lane) {
          // While the pieces' products run, the K/V blocks that the lane's decodes read next
          // come in from memory (own_blocks), spread over the products: otherwise the pieces
          // compute with memory idle, then the decodes wait on memory with little to compute.
          // What leaves L2 before they read it stays in L3. Fetching all of those blocks
          // stalled the pieces on memory, so kFetchPerPair (bf16_product.h) caps it at 2 lines
          // a pair: in SmolLM2's shape (48 query rows a KV head, head_dim 64) about half of the
          // blocks, which measured faster than none (docs/performance.md).
          // The fetch helps only where lane i of both phases runs on one core: balance() deals
          // each phase at most one lane a thread, and at::parallel_for (OpenMP's static split)
          // gives thread i lane i of both wherever both have a lane for every thread.
          const std::vector<const char*> blocks =
              fetches && lane < static_cast<int64_t>(lanes.size())
                  ? own_blocks(g, shared, lanes[lane], k, v, tables, contexts)
                  : std::vector<const char*>();
          FetchQueue queue{blocks.data(), static_cast<int64_t>(blocks.size()),
                           (g.block_size * g.kv_stride_token * 2 + 63) / 64};  // bf16
          const int64_t products = 2 * static_cast<int64_t>(shared_lanes[lane].size());
          const Fetch fetch{&queue, (queue.left() + products - 1) / products};
          for (const WorkItem& item : shared_lanes[lane]) {
            attend_shared_piece(g, shared, item, q, k, v, tables, starts, fetch);
          }
        }
      });
    }
  }
  at::parallel_for(0, static_cast<int64_t>(lanes.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t lane = begin; lane < end; ++lane) {
      for (const WorkItem& item : lanes[lane]) {
        const int32_t s = item.sequence;
        const bool every_head = item.kv_head == kEveryHead;
        const int64_t first = every_head ? 0 : item.kv_head;
        const int64_t last = every_head ? kv_heads - 1 : item.kv_head;
        for (int64_t h = first; h <= last; ++h) {
          attend_item<scalar_t>(g, item, h, q, k, v, tables + s * g.table_stride, starts[s],
                                starts[s + 1] - starts[s], contexts[s], shared, o);
        }
      }
    }
  });
}

}  // namespace

// out [tokens, heads, dim] (contiguous); query [tokens, heads, dim] (dim contiguous, any other
// strides); key_cache / value_cache [blocks, block_size, kv_heads, dim] (one layer, each block
// contiguous); all four of one dtype, fp32 or bf16. block_tables [sequences, max_blocks],
// query_starts [sequences + 1] and context_lens [sequences] are contiguous int32; window 0 is none.
void paged_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_starts, const at::Tensor& context_lens, double scale,
                     int64_t window, const std::optional<at::Tensor>& share_groups,
                     const std::optional<at::Tensor>& prompt_chunks) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "query and out are [tokens, heads, dim]");
  TORCH_CHECK(out.is_contiguous() && query.stride(2) == 1,
              "out must be contiguous and query's last dimension too");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "key_cache and value_cache are [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(key_cache.stride(3) == 1 && key_cache.stride(2) == key_cache.size(3) &&
                  key_cache.stride(1) == key_cache.size(2) * key_cache.size(3) &&
                  value_cache.strides() == key_cache.strides(),
              "each block of the cache must be contiguous");
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == dtype && query.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "query, out, K and V must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  query_starts.scalar_type() == at::kInt && query_starts.is_contiguous() &&
                  context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(),
              "block_tables, query_starts and context_lens are contiguous int32");
  const int64_t heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(2), block_size = key_cache.size(1);
  TORCH_CHECK(key_cache.size(3) == dim, "query and cache head_dim differ");
  TORCH_CHECK(dim % kLanes == 0 && dim <= kMaxHeadDim, "head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup, "unsupported GQA ratio");
  TORCH_CHECK(window >= 0, "window must not be negative");
  const int64_t sequences = context_lens.size(0);
  TORCH_CHECK(query_starts.size(0) == sequences + 1 && block_tables.size(0) == sequences,
              "one block table and context length per sequence");
  TORCH_CHECK(!share_groups.has_value() ||
                  (share_groups->scalar_type() == at::kInt && share_groups->is_contiguous() &&
                   share_groups->dim() == 1 && share_groups->size(0) == sequences),
              "share_groups is one contiguous int32 per sequence");
  TORCH_CHECK(!prompt_chunks.has_value() ||
                  (prompt_chunks->scalar_type() == at::kInt && prompt_chunks->is_contiguous() &&
                   prompt_chunks->dim() == 1 && prompt_chunks->size(0) == sequences),
              "prompt_chunks is one contiguous int32 per sequence");

  const Geometry g{heads, heads / kv_heads, dim, block_size, query.stride(0), query.stride(1),
                   key_cache.stride(0), key_cache.stride(1), block_tables.stride(0),
                   static_cast<float>(scale), window};
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* contexts = context_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t num_blocks = key_cache.size(0);
  TORCH_CHECK(sequences == 0 || starts[0] == 0, "query_starts must begin at 0");
  // Over a bf16 pool where the CPU has the units, prompt chunks (`prompt_chunks`, any length)
  // and any chunk of kMatrixMinTokens or more run as matrix products; everything else (decode,
  // fp32) as vector work items. A prompt's rows so round the same whether its beginning came
  // from the cache (a short extend) or not (one long prefill).
  const bool matrix = dtype == at::kBFloat16 && matrix_units_on();
  const int32_t* prompts = prompt_chunks.has_value() ? prompt_chunks->data_ptr<int32_t>() : nullptr;
  std::vector<SequenceSpan> matrix_spans;
  std::vector<WorkItem> items;
  // Decode rows in the decode layout (bf16 with vdpbf16ps, head_dim a multiple of 32) take every
  // KV head of their sequence in one item, one head after another on one thread, where the batch
  // has enough decoding sequences for the threads. Each head prefetches its own rows as items of
  // one head do (perhaps what helps: the lines the hardware fetches beside them hold the
  // sequence's other heads, which the same core reads next); it measured faster than items of
  // one head. Prefetching the whole token rows of every head in the first head's pass measured
  // faster on an Intel Xeon with AMX but slower on a Zen 5 EPYC, and was taken out (why, not
  // found: whole rows four chunks ahead are 48 KB in flight a thread, three times what items
  // of one head ask for, and prefetcht1 fills L2, not L1). With fewer decodes
  // than two a thread, or one decode longer than a thread's share of them all, items of one head
  // keep every thread busy (one decode's three heads on two threads).
  const bool every_head_possible = kNativeBf16 && dtype == at::kBFloat16 && dim % 32 == 0 &&
                                   heads / kv_heads < kPackRows;
  const auto decode_keys = [&](int32_t s) {  // what a decode's item reads
    return window > 0 ? std::min<int64_t>(contexts[s], window + 1) : int64_t{contexts[s]};
  };
  int64_t decoding = 0, all_keys = 0, most_keys = 0;
  for (int32_t s = 0; s < sequences; ++s) {
    if (starts[s + 1] - starts[s] == 1 && (prompts == nullptr || prompts[s] == 0)) {
      ++decoding;
      all_keys += decode_keys(s);
      most_keys = std::max(most_keys, decode_keys(s));
    }
  }
  const int64_t threads = at::get_num_threads();
  const bool every_head_items =
      every_head_possible && decoding >= 2 * threads && most_keys * threads <= all_keys;
  for (int32_t s = 0; s < sequences; ++s) {
    const int64_t query_len = starts[s + 1] - starts[s];
    TORCH_CHECK(query_len >= 0 && query_len <= contexts[s] && starts[s + 1] <= query.size(0),
                "a sequence's queries must fit its context and the batch");
    const int64_t used_blocks = (contexts[s] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= block_tables.size(1), "block table shorter than the context");
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int32_t block = tables[s * g.table_stride + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
    if (matrix && (query_len >= kMatrixMinTokens || (prompts != nullptr && prompts[s] != 0))) {
      matrix_spans.push_back({starts[s], query_len, contexts[s], tables + s * g.table_stride});
      continue;
    }
    if (every_head_items && query_len == 1) {
      items.push_back({s, kEveryHead, 0, 1, kv_heads * decode_keys(s) * (g.group + 4)});
      continue;
    }
    for (int64_t first = 0; first < query_len; first += kTileTokens) {
      const int64_t tokens = std::min(kTileTokens, query_len - first);
      int64_t keys = contexts[s] - query_len + first + tokens;
      if (window > 0) keys = std::min(keys, window + tokens);
      for (int32_t h = 0; h < kv_heads; ++h) {
        items.push_back({s, h, static_cast<int32_t>(first), static_cast<int32_t>(tokens),
                         keys * (tokens * g.group + 4)});
      }
    }
  }
  TORCH_CHECK(starts[sequences] == query.size(0), "the sequences' queries must cover the batch");
  const int32_t* groups = share_groups.has_value() ? share_groups->data_ptr<int32_t>() : nullptr;
  SharedPrefixes shared =
      find_shared_prefixes(g, matrix, sequences, kv_heads, starts, contexts, tables, groups, prompts);
  std::vector<WorkItem> pieces;
  for (int32_t index = 0; index < static_cast<int32_t>(shared.groups.size()); ++index) {
    const SharedGroup& group = shared.groups[index];
    for (int32_t h = 0; h < kv_heads; ++h) {
      for (int32_t p = 0; p < group.pieces; ++p) {
        const int64_t keys = std::min(kSharedPieceKeys, group.keys - p * kSharedPieceKeys);
        pieces.push_back({index, h, p, 0, keys * (group.rows + 4)});
      }
    }
  }
  for (WorkItem& item : items) {  // a member's own item reads only the keys after the prefix
    const int32_t grouped = shared.group_of[item.sequence];
    if (grouped >= 0) {
      const int64_t keys = contexts[item.sequence] - shared.groups[grouped].keys;
      item.cost = keys * (g.group + 4) * (item.kv_head == kEveryHead ? kv_heads : 1);
    }
  }
  const auto shared_lanes = balance(std::move(pieces), at::get_num_threads());
  const auto lanes = balance(std::move(items), at::get_num_threads());
  AT_DISPATCH_SWITCH(dtype, "paged_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      run_items<scalar_t>(g, shared, shared_lanes, lanes, query, key_cache, value_cache, tables,
                          starts, contexts, out);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      run_items<scalar_t>(g, shared, shared_lanes, lanes, query, key_cache, value_cache, tables,
                          starts, contexts, out);
    }));
  if (!matrix_spans.empty()) {
    attend_matrix(g, matrix_spans, query.data_ptr<c10::BFloat16>(),
                  key_cache.data_ptr<c10::BFloat16>(), value_cache.data_ptr<c10::BFloat16>(),
                  out.data_ptr<c10::BFloat16>());
  }
}

// Switches the matrix path on or off, and where `amx` is given AMX products (tests of the other
// paths; see matrix_units); returns which products it runs on: "amx", "vdpbf16ps", "fma" (AVX2)
// or "off".
std::string use_matrix_units(bool enable, std::optional<bool> amx) {
  return matrix_units(enable, amx);
}

TORCH_LIBRARY(prefixgate, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_starts, Tensor context_lens, float scale, "
      "int window, Tensor? share_groups=None, Tensor? prompt_chunks=None) -> ()");
  m.def("use_matrix_units(bool enable, bool? amx=None) -> str", &use_matrix_units);
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) { m.impl("paged_attention", &paged_attention); }
