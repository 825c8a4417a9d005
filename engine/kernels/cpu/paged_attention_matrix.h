// The matrix-unit path of the CPU paged attention (paged_attention_matrix.cpp), for prefill and
// extend over a bf16 pool: what paged_attention.cpp hands it.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu_vector.h"

namespace prefixgate {

struct Geometry {
  int64_t heads, group, head_dim, block_size;
  int64_t q_stride_token, q_stride_head;     // query [tokens, heads, dim]
  int64_t kv_stride_block, kv_stride_token;  // cache [blocks, slots, kv_heads, dim]
  int64_t table_stride;
  float scale;
  int64_t window;  // 0: none
};

// One sequence of the batch: its queries are rows [query_start, query_start + query_len) and the
// last query_len positions of its context_len.
struct SequenceSpan {
  int64_t query_start, query_len, context_len;
  const int32_t* table;
};

// From this many query tokens on, a sequence's attention runs as matrix products (a prompt
// chunk does at any length: paged_attention.cpp).
constexpr int64_t kMatrixMinTokens = 16;
// Keys per product (a multiple of 32).
constexpr int64_t kMatrixKeyTile = 256;

// Whether the matrix path runs on this CPU (oneDNN's bf16 micro-kernels, which need AMX, with
// oneDNN switched on in torch; or bf16_product.h's own loops where the kernels were built with
// AVX512_BF16, or with AVX2 and FMA) and is switched on (`enable` false switches it off, for
// tests of the vector path; `allow_amx` false takes the own loops on a CPU with AMX too, in the
// linear layers as well, for their tests; without it that stays as it was). Returns which
// products the path runs now: "amx", "vdpbf16ps", "fma" or "off".
std::string matrix_units(bool enable, std::optional<bool> allow_amx);
bool matrix_units_on();

// Attention of `sequences` (prompt chunks, and others of at least kMatrixMinTokens queries)
// over bf16 K/V read
// through their block tables; writes their rows of `out` [tokens, heads, dim].
void attend_matrix(const Geometry& g, const std::vector<SequenceSpan>& sequences,
                   const c10::BFloat16* query, const c10::BFloat16* key_cache,
                   const c10::BFloat16* value_cache, c10::BFloat16* out);

// Keys [first, end) of one KV head, read through `table` (first a multiple of kMatrixKeyTile,
// at most one tile of keys), for query rows that all see all of them (decode rows of sequences
// that share those blocks): writes each row's softmax state over these keys to `state` as
// max[rows] (base e), sum[rows], then the unnormalized output [rows][head_dim]. Its two products
// fetch at most `fetch.lines` lines each.
void attend_shared_tile(const Geometry& g, const int32_t* table, int64_t first, int64_t end,
                        int64_t kv_head, const std::vector<const c10::BFloat16*>& queries,
                        const c10::BFloat16* key_cache, const c10::BFloat16* value_cache,
                        float* state, Fetch fetch);

}  // namespace prefixgate
