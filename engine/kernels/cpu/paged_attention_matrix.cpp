// Paged attention for prefill and extend over a bf16 pool, as matrix products on oneDNN's bf16
// micro-kernels (torch's `cpublas::brgemm`: AMX tiles where the CPU has them) or, on a CPU
// without AMX, on bf16_product.h's own loops (vdpbf16ps with AVX512_BF16, fp32 FMA with AVX2),
// the way torch's own flash attention runs on the CPU, but reading K/V through the block
// tables.
//
// Two phases per call:
//   1. Pack: each sequence's K and V, per KV head, are read once through its block table into
//      tiles of kKeyTile keys in the layouts the products take (VNNI: pairs of bf16 side by
//      side). K is transposed ([dim / 2][keys] pairs of dims) for S = Q K^T, V interleaved
//      ([keys / 2][dim] pairs of keys) for O = P V. One read of each context per layer, against
//      query_len reads of it by the products.
//   2. Attend: work items of (sequence, KV head, up to kRowTarget query rows) run a flash
//      attention over the key tiles a row can see: S = Q K^T in fp32, an online softmax per row
//      (one max and one sum per row and tile), P rounded to bf16 (as GPU flash attention does),
//      and O += P V in fp32; the output is O / sum. On the causal diagonal a tile is cut after
//      the last key the item's rows can see (rounded up to kKeyStep): the cut keys are masked
//      for every row, so the result is the same, with about a tenth less attention work in a
//      1,536-token prefill. An item's rows are padded to a multiple of 16 (zero queries,
//      results dropped), so that few shapes of micro-kernel are ever compiled.
//
// attend_shared_tile runs step 2 for one tile of keys that several decoding sequences' tables
// share, with all their query heads as rows, and returns the rows' softmax state instead of
// an output (paged_attention.cpp merges it into each sequence's own work item).
//
// Rows of an item are token-major: row r is query token r / group, head kv_head * group +
// r % group, so the heads of a KV head share each packed tile (grouped-query attention).

#include "paged_attention_matrix.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "bf16_product.h"
#include "cpu_vector.h"
#include "work_items.h"

namespace prefixgate {
namespace {

constexpr int64_t kKeyTile = kMatrixKeyTile;
// Query rows (tokens x group) per work item, at most: each of an item's products then spans
// more rows for the same key tile. 192 measured faster than 96, and 288 no better.
constexpr int64_t kRowTarget = 192;
// A tile's products and softmax stop at a multiple of this: 8 widths a tile, so few shapes of
// micro-kernel (torch compiles one per shape and thread and keeps it).
constexpr int64_t kKeyStep = 32;

std::atomic<bool> enabled{true};

// Where one sequence's packed tiles are: tiles [first_tile, first_tile + tiles) of its context,
// per KV head `head` at packed + (head * tiles + t) * tile_words.
struct Packed {
  const SequenceSpan* span;
  int64_t first_tile, tiles;
  uint32_t* packed;
};

#if !defined(__AVX512BW__)
const uint16_t* row(const c10::BFloat16* cache, const Geometry& g, const int32_t* table,
                    int64_t position, int64_t head) {
  const int64_t block = table[position / g.block_size];
  return reinterpret_cast<const uint16_t*>(cache + block * g.kv_stride_block +
                                           (position % g.block_size) * g.kv_stride_token +
                                           head * g.head_dim);
}
#endif

#if defined(__AVX512BW__)
// Sixteen vectors of sixteen 32-bit words, transposed: word j of vector i becomes word i of
// vector j.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int k = 0; k < 4; ++k) {
      t[i + k] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0x88);
      t[i + k + 4] = _mm512_shuffle_i32x4(r[i + k], r[i + k + 4], 0xdd);
    }
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
  }
}
#endif

// The key tile of `span` from position `first`, KV head `head`, into `key_tile`: K as
// [dim / 2][kKeyTile] pairs of dims, then V as [kKeyTile / 2][dim] pairs of keys; keys past the
// context are zero. With AVX-512, 16 keys at a time: their K rows transposed as 16 x 16 words,
// their V rows interleaved by pairs, and the next 16 keys' rows prefetched meanwhile (they sit in
// another block, anywhere in the pool).
void pack_tile(const Geometry& g, const SequenceSpan& span, int64_t head, int64_t first,
               const c10::BFloat16* key_cache, const c10::BFloat16* value_cache,
               uint32_t* key_tile) {
  const int64_t dim = g.head_dim, pairs = dim / 2, context = span.context_len;
  uint32_t* value_tile = key_tile + pairs * kKeyTile;
#if defined(__AVX512BW__)
  alignas(64) static const uint16_t zeros[256] = {};  // dim <= 256
  const uint16_t* keys[kKeyTile];
  const uint16_t* values[kKeyTile];
  int64_t block_index = first / g.block_size, slot = first % g.block_size;
  for (int64_t j = 0; j < kKeyTile; ++j) {
    if (first + j < context) {
      const int64_t offset =
          span.table[block_index] * g.kv_stride_block + slot * g.kv_stride_token +
          head * dim;
      keys[j] = reinterpret_cast<const uint16_t*>(key_cache + offset);
      values[j] = reinterpret_cast<const uint16_t*>(value_cache + offset);
    } else {
      keys[j] = values[j] = zeros;
    }
    if (++slot == g.block_size) {
      slot = 0;
      ++block_index;
    }
  }
  const auto prefetch = [&](int64_t group) {
    for (int64_t j = group * kLanes; j < (group + 1) * kLanes; ++j) {
      for (int64_t byte = 0; byte < dim * 2; byte += 64) {
        prefetch_l2(reinterpret_cast<const char*>(keys[j]) + byte);
        prefetch_l2(reinterpret_cast<const char*>(values[j]) + byte);
      }
    }
  };
  __m512i interleave_low, interleave_high;  // word i: (a[i], b[i]), for i in 0-15 and 16-31
  {
    alignas(64) uint16_t low[32], high[32];
    for (int i = 0; i < 32; ++i) {
      low[i] = static_cast<uint16_t>(i % 2 ? 32 + i / 2 : i / 2);
      high[i] = static_cast<uint16_t>(low[i] + 16);
    }
    interleave_low = _mm512_load_si512(low);
    interleave_high = _mm512_load_si512(high);
  }
  const int64_t groups = kKeyTile / kLanes;
  prefetch(0);
  for (int64_t group = 0; group < groups; ++group) {
    if (group + 1 < groups) prefetch(group + 1);
    const int64_t j0 = group * kLanes;
    for (int64_t q0 = 0; q0 < pairs; q0 += kLanes) {
      const int64_t lanes = std::min<int64_t>(kLanes, pairs - q0);
      const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = _mm512_maskz_loadu_epi32(mask, reinterpret_cast<const uint32_t*>(keys[j0 + i]) + q0);
      }
      transpose16(r);
      for (int64_t q = 0; q < lanes; ++q) {
        _mm512_storeu_si512(key_tile + (q0 + q) * kKeyTile + j0, r[q]);
      }
    }
    for (int64_t k = j0 / 2; k < (j0 + kLanes) / 2; ++k) {
      const uint16_t* a = values[2 * k];
      const uint16_t* b = values[2 * k + 1];
      for (int64_t d = 0; d < dim; d += 32) {  // dim is a multiple of 16
        const __mmask32 mask = dim - d >= 32 ? 0xFFFFFFFFu : 0xFFFFu;
        const __m512i va = _mm512_maskz_loadu_epi16(mask, a + d);
        const __m512i vb = _mm512_maskz_loadu_epi16(mask, b + d);
        _mm512_storeu_si512(value_tile + k * dim + d,
                            _mm512_permutex2var_epi16(va, interleave_low, vb));
        if (dim - d >= 32) {
          _mm512_storeu_si512(value_tile + k * dim + d + 16,
                              _mm512_permutex2var_epi16(va, interleave_high, vb));
        }
      }
    }
  }
#else
  for (int64_t j = 0; j < kKeyTile; ++j) {
    const int64_t position = first + j;
    if (position >= context) {
      for (int64_t q = 0; q < pairs; ++q) key_tile[q * kKeyTile + j] = 0;
      continue;
    }
    uint32_t words[128];  // dim <= 256
    std::memcpy(words, row(key_cache, g, span.table, position, head), dim * 2);
    for (int64_t q = 0; q < pairs; ++q) key_tile[q * kKeyTile + j] = words[q];
  }
  for (int64_t k = 0; k < kKeyTile / 2; ++k) {
    const int64_t low = first + 2 * k, high = low + 1;
    uint32_t* target = value_tile + k * dim;
    if (low >= context) {
      std::memset(target, 0, dim * 4);
      continue;
    }
    const uint16_t* a = row(value_cache, g, span.table, low, head);
    const uint16_t* b = high < context ? row(value_cache, g, span.table, high, head) : nullptr;
    for (int64_t d = 0; d < dim; ++d) {
      target[d] = static_cast<uint32_t>(a[d]) | (b ? static_cast<uint32_t>(b[d]) << 16 : 0u);
    }
  }
#endif
}

// Scratch of one item, reused across the items a thread runs.
struct Scratch {
  bool on_amx = false;  // which products it runs: decided once per kernel call
  std::vector<uint16_t> q, probabilities;
  std::vector<float> scores, acc, max, sum;
  std::vector<int64_t> position;
  void resize(int64_t rows, int64_t dim) {
    q.resize(rows * dim);
    probabilities.resize(rows * kKeyTile);
    scores.resize(rows * kKeyTile);
    acc.assign(rows * dim, 0.0f);
    max.assign(rows, kMasked);
    sum.assign(rows, 0.0f);
    position.resize(rows);
  }
};

// The keys of the tile from `first_key` that rows up to `last_position` can see, rounded up to
// kKeyStep: on the causal diagonal the rest of the tile is masked for every row, so its
// products and softmax are skipped (they would add exact zeros).
int64_t visible_keys(int64_t first_key, int64_t last_position) {
  const int64_t keys = std::min<int64_t>(kKeyTile, last_position + 1 - first_key);
  return (keys + kKeyStep - 1) / kKeyStep * kKeyStep;
}

// The first `keys` scores of N rows from `first` -> bf16 probabilities, with each row's running
// max and sum updated and its accumulator rescaled; keys outside [lowest, position] are masked.
// The rows are independent: taken N at a time, one row's reductions (a max and a sum across
// lanes, each a chain of shuffles) overlap another's. Two at a time measured faster than one,
// four no better.
template <int N>
void softmax_rows(Scratch& s, int64_t first, int64_t dim, int64_t first_key, int64_t keys,
                  float scale, int64_t window) {
  const vfloat lane = lane_index();
  vfloat chunks[N][kKeyTile / kLanes];
  vfloat best_low[N], best_high[N];
  static_assert(kKeyStep % (2 * kLanes) == 0, "keys come in pairs of vectors");
  for (int i = 0; i < N; ++i) {
    const int64_t position = s.position[first + i];
    const int64_t lowest = window > 0 ? position - window + 1 : 0;
    const bool whole = first_key >= lowest && first_key + keys - 1 <= position;
    const float* scores = s.scores.data() + (first + i) * kKeyTile;
    const auto scaled = [&](int64_t c) {
      vfloat x = load(scores + c * kLanes) * scale;
      if (!whole) {
        const vfloat key = lane + static_cast<float>(first_key + c * kLanes);
        const vmask visible = (key <= static_cast<float>(position)) &
                              (key >= static_cast<float>(lowest));
        x = where(visible, x, splat(kMasked));
      }
      chunks[i][c] = x;
      return x;
    };
    // Two running maxima: one would chain every vector's max to the last (4 cycles each).
    best_low[i] = splat(kMasked);
    best_high[i] = splat(kMasked);
    for (int64_t c = 0; c < keys / kLanes; c += 2) {
      const vfloat low = scaled(c), high = scaled(c + 1);
      best_low[i] = where(best_low[i] > low, best_low[i], low);
      best_high[i] = where(best_high[i] > high, best_high[i], high);
    }
  }
  float shift[N], correction[N];
  bool seen[N];
  for (int i = 0; i < N; ++i) {
    const int64_t r = first + i;
    const vfloat best = where(best_low[i] > best_high[i], best_low[i], best_high[i]);
    const float tile_max = lanes_max(best);
    seen[i] = tile_max > kMasked;
    if (!seen[i]) {
      std::memset(s.probabilities.data() + r * kKeyTile, 0, keys * 2);
      continue;
    }
    const float new_max = std::max(s.max[r], tile_max);
    correction[i] = new_max == s.max[r] ? 1.0f : std::exp(s.max[r] - new_max);
    s.max[r] = new_max;
    if (correction[i] != 1.0f) {
      float* acc = s.acc.data() + r * dim;
      for (int64_t d = 0; d < dim; d += kLanes) store(acc + d, load(acc + d) * correction[i]);
    }
    shift[i] = new_max * kLog2e;  // exp(x - max) as 2^(x log2 e - max log2 e), one FMA
  }
  for (int i = 0; i < N; ++i) {
    if (!seen[i]) continue;
    uint16_t* probabilities = s.probabilities.data() + (first + i) * kKeyTile;
    vfloat total_low = splat(0.0f), total_high = splat(0.0f);  // two chains of additions
    for (int64_t c = 0; c < keys / kLanes; c += 2) {  // keys: a multiple of kKeyStep
      const vfloat low = vexp2_softmax(chunks[i][c] * kLog2e - shift[i]);  // masked: exactly 0
      const vfloat high = vexp2_softmax(chunks[i][c + 1] * kLog2e - shift[i]);
      total_low += low;
      total_high += high;
      store_bf16_pair(probabilities + c * kLanes, low, high);
    }
    s.sum[first + i] = s.sum[first + i] * correction[i] + lanes_sum(total_low + total_high);
  }
}

// The `rows` rows of `s` over the first `keys` keys of one packed key tile whose first key is
// `first_key`: S = Q K^T, the online softmax, O += P V.
void attend_tile(const Geometry& g, Scratch& s, int64_t rows, int64_t first_key, int64_t keys,
                 const uint32_t* key_tile, Fetch fetch = {}) {
  const int64_t dim = g.head_dim;
  const uint32_t* value_tile = key_tile + dim / 2 * kKeyTile;
  bf16_product(s.on_amx, rows, keys, dim, dim, kKeyTile, kKeyTile, false, s.q.data(), key_tile,
               s.scores.data(), fetch);
  TORCH_CHECK(rows % 2 == 0, "rows are padded to a multiple of 16");
  for (int64_t r = 0; r < rows; r += 2) {
    softmax_rows<2>(s, r, dim, first_key, keys, g.scale, g.window);
  }
  bf16_product(s.on_amx, rows, dim, keys, kKeyTile, dim, dim, true, s.probabilities.data(),
               value_tile, s.acc.data(), fetch);
}

void attend_item(const Geometry& g, const WorkItem& item, const Packed& p, Scratch& s,
                 const c10::BFloat16* query, c10::BFloat16* out) {
  const int64_t dim = g.head_dim, group = g.group, rows = item.tokens * group;
  const int64_t padded = (rows + 15) / 16 * 16;
  const SequenceSpan& span = *p.span;
  s.resize(padded, dim);
  const int64_t first_position = span.context_len - span.query_len + item.first_token;
  const int64_t last_position = first_position + item.tokens - 1;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = span.query_start + item.first_token + r / group;
    const int64_t head = item.kv_head * group + r % group;
    std::memcpy(s.q.data() + r * dim, query + token * g.q_stride_token + head * g.q_stride_head,
                dim * 2);
    s.position[r] = first_position + r / group;
  }
  std::fill(s.q.begin() + rows * dim, s.q.begin() + padded * dim, 0);
  std::fill(s.position.begin() + rows, s.position.begin() + padded, last_position);
  const int64_t lowest = g.window > 0 ? std::max<int64_t>(0, first_position - g.window + 1) : 0;
  const int64_t tile_words = dim * kKeyTile;
  for (int64_t tile = lowest / kKeyTile; tile * kKeyTile <= last_position; ++tile) {
    attend_tile(g, s, padded, tile * kKeyTile, visible_keys(tile * kKeyTile, last_position),
                p.packed + (item.kv_head * p.tiles + tile - p.first_tile) * tile_words);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = span.query_start + item.first_token + r / group;
    const int64_t head = item.kv_head * group + r % group;
    c10::BFloat16* target = out + (token * g.heads + head) * dim;
    const float inverse = s.sum[r] > 0.0f ? 1.0f / s.sum[r] : 0.0f;
    const float* acc = s.acc.data() + r * dim;
    for (int64_t d = 0; d < dim; d += kLanes) {
      store(target + d, load(acc + d) * inverse);
    }
  }
}

}  // namespace

void attend_shared_tile(const Geometry& g, const int32_t* table, int64_t first, int64_t end,
                        int64_t kv_head, const std::vector<const c10::BFloat16*>& queries,
                        const c10::BFloat16* key_cache, const c10::BFloat16* value_cache,
                        float* state, Fetch fetch) {
  TORCH_CHECK(first % kKeyTile == 0 && end > first && end - first <= kKeyTile,
              "a shared tile starts on a tile boundary and holds at most one tile of keys");
  const int64_t dim = g.head_dim, rows = static_cast<int64_t>(queries.size());
  const SequenceSpan span{0, 0, end, table};  // keys past `end` are packed as zeros...
  // Scratch kept by each of torch's threads: every word of the tile is written by pack_tile.
  thread_local std::vector<uint32_t> tile;
  tile.resize(dim * kKeyTile);
  pack_tile(g, span, kv_head, first, key_cache, value_cache, tile.data());
  // Products of a multiple of 16 rows (the padding: zero queries, results dropped): torch keeps
  // a compiled micro-kernel per shape and thread, never freed, so the number of shapes stays
  // small whatever the groups' sizes.
  const int64_t padded = (rows + 15) / 16 * 16;
  thread_local Scratch s;
  s.on_amx = amx_products();
  s.resize(padded, dim);
  std::fill(s.q.begin(), s.q.end(), 0);
  for (int64_t r = 0; r < padded; ++r) {
    if (r < rows) std::memcpy(s.q.data() + r * dim, queries[r], dim * 2);
    s.position[r] = end - 1;  // ...and masked: every row sees the tile's keys up to `end`
  }
  attend_tile(g, s, padded, first, visible_keys(first, end - 1), tile.data(), fetch);
  release_products(s.on_amx);
  std::copy(s.max.begin(), s.max.begin() + rows, state);
  std::copy(s.sum.begin(), s.sum.begin() + rows, state + rows);
  std::copy(s.acc.begin(), s.acc.begin() + rows * dim, state + 2 * rows);
}

std::string matrix_units(bool enable, std::optional<bool> allow_amx) {
  enabled = enable;
  if (allow_amx.has_value()) amx_allowed() = *allow_amx;
  if (!matrix_units_on()) return "off";
  return amx_products() ? "amx" : dot_products_name();
}

bool matrix_units_on() { return enabled && bf16_products_available(); }

void attend_matrix(const Geometry& g, const std::vector<SequenceSpan>& sequences,
                   const c10::BFloat16* query, const c10::BFloat16* key_cache,
                   const c10::BFloat16* value_cache, c10::BFloat16* out) {
  const int64_t kv_heads = g.heads / g.group, tile_words = g.head_dim * kKeyTile;
  // Phase 1: every sequence's tiles, from the first any of its rows can see.
  std::vector<Packed> packed;
  int64_t words = 0;
  for (const SequenceSpan& span : sequences) {
    const int64_t first_query = span.context_len - span.query_len;
    const int64_t lowest = g.window > 0 ? std::max<int64_t>(0, first_query - g.window + 1) : 0;
    const int64_t first_tile = lowest / kKeyTile;
    const int64_t tiles = (span.context_len + kKeyTile - 1) / kKeyTile - first_tile;
    packed.push_back({&span, first_tile, tiles, nullptr});
    words += kv_heads * tiles * tile_words;
  }
  // Every word is written by pack_tile: no zero-filling first.
  const std::unique_ptr<uint32_t[]> storage(new uint32_t[words]);
  std::vector<std::array<int64_t, 3>> jobs;  // (sequence, head, tile)
  words = 0;
  for (int64_t s = 0; s < static_cast<int64_t>(packed.size()); ++s) {
    packed[s].packed = storage.get() + words;
    words += kv_heads * packed[s].tiles * tile_words;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t t = 0; t < packed[s].tiles; ++t) jobs.push_back({s, h, t});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const auto [s, h, t] = jobs[j];
      const Packed& p = packed[s];
      pack_tile(g, *p.span, h, (p.first_tile + t) * kKeyTile, key_cache, value_cache,
                p.packed + (h * p.tiles + t) * tile_words);
    }
  });

  // Phase 2: items of up to kRowTarget rows, dealt so that the threads finish together. Where
  // the batch has too few rows for two items per thread, items of fewer rows (down to about a
  // quarter), so that a short prompt still spreads over the threads.
  int64_t tokens_per_item = std::max<int64_t>(1, kRowTarget / g.group);
  const auto item_count = [&](int64_t tokens) {
    int64_t count = 0;
    for (const SequenceSpan& span : sequences) count += (span.query_len + tokens - 1) / tokens;
    return count * kv_heads;
  };
  const int64_t fewest_tokens = std::max<int64_t>(1, kRowTarget / 4 / g.group);
  while (tokens_per_item / 2 >= fewest_tokens &&
         item_count(tokens_per_item) < 2 * at::get_num_threads()) {
    tokens_per_item /= 2;
  }
  std::vector<WorkItem> items;
  for (int32_t s = 0; s < static_cast<int32_t>(sequences.size()); ++s) {
    const SequenceSpan& span = sequences[s];
    for (int64_t first = 0; first < span.query_len; first += tokens_per_item) {
      const int64_t tokens = std::min(tokens_per_item, span.query_len - first);
      int64_t keys = span.context_len - span.query_len + first + tokens;
      if (g.window > 0) keys = std::min(keys, g.window + tokens);
      for (int32_t h = 0; h < kv_heads; ++h) {
        items.push_back({s, h, static_cast<int32_t>(first), static_cast<int32_t>(tokens),
                         keys * tokens * g.group});
      }
    }
  }
  const auto lanes = balance(std::move(items), at::get_num_threads());
  const bool on_amx = amx_products();
  at::parallel_for(0, static_cast<int64_t>(lanes.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    scratch.on_amx = on_amx;
    for (int64_t lane = begin; lane < end; ++lane) {
      for (const WorkItem& item : lanes[lane]) {
        attend_item(g, item, packed[item.sequence], scratch, query, out);
      }
    }
    release_products(scratch.on_amx);
  });
}

}  // namespace prefixgate
