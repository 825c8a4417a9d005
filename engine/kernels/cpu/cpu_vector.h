// Vector helpers shared by the CPU kernels: 16-lane fp32 vectors, loads from fp32 and bf16,
// horizontal sums and maxima, a fast exp, bf16 rounding and SiLU.
//
// With AVX-512 a vfloat is one register, a GCC/Clang vector extension type. Without it GCC has
// no 16-lane registers and compiles such a type badly: arithmetic splits into 8-lane halves but
// goes through the stack, and a comparison or a `?:` runs lane by lane (about 100 instructions
// for one compare-and-select, 300 for softmax_chunk's mask, counted in the assembly on an AVX2
// CPU). There a vfloat is a pair of 8-lane vectors with the same operators, each one
// instruction a half. Kernels write selects as `where(mask, a, b)`, which both forms have.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace prefixgate {

constexpr int64_t kLanes = 16;     // floats per vector
constexpr float kMasked = -1e30f;  // finite, so no infinity arithmetic is ever needed

// The cache line at `address`, into L2 ahead of use. An asm statement: GCC deletes a loop whose
// body only calls __builtin_prefetch (a C++ loop without side effects may be removed), and so
// every prefetch loop of these kernels was once missing from the binary. Into L2
// (prefetcht1), not L1: prefetcht1 made decode attention from memory much faster, and
// prefetcht0 measured the same as no prefetch at all (L1's few miss buffers fill). The address
// goes in a register, not as a memory operand: with one, GCC stored every accumulator of a
// product's loop to the stack before each prefetch in it (bf16_product.h's products slowed).
inline void prefetch_l2(const void* address) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 (%0)" : : "r"(address));
#elif defined(__aarch64__)
  asm volatile("prfm pldl2keep, [%0]" : : "r"(address));
#else
  __builtin_prefetch(address, 0, 2);
#endif
}

// Memory that products bring into L2 while they run (bf16_product.h), so that a core's reads
// from memory overlap its arithmetic instead of following it: `count` regions of
// `region_lines` cache lines each, from `starts`, fetched in order, a few lines at a time.
struct FetchQueue {
  const char* const* starts = nullptr;
  int64_t count = 0, region_lines = 0;
  int64_t region = 0, line = 0;  // the next line to fetch

  int64_t left() const { return (count - region) * region_lines - line; }
  void next() {
    if (region == count) return;
    prefetch_l2(starts[region] + line * 64);
    if (++line == region_lines) {
      line = 0;
      ++region;
    }
  }
};

// How many of a queue's lines one product fetches at most, spread over its pairs of depth
// (bf16_product.h caps each block's share; only its vdpbf16ps loops fetch at all).
struct Fetch {
  FetchQueue* queue = nullptr;
  int64_t lines = 0;

  // Part `k` of `parts` (blocks of a product, in order): the lines shared out evenly.
  Fetch share(int64_t k, int64_t parts) const {
    return {queue, lines * (k + 1) / parts - lines * k / parts};
  }
};

#if defined(__AVX512F__)
#define PREFIXGATE_VECTOR_REGISTERS 1  // a vfloat is one register: __m512 casts work

typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint16_t vhalf __attribute__((vector_size(32)));
typedef vint vmask;  // a comparison's result: all ones where it holds

inline vfloat splat(float value) { return vfloat{} + value; }
inline vint splat_int(int32_t value) { return vint{} + value; }
inline vfloat where(vmask mask, vfloat yes, vfloat no) { return mask ? yes : no; }
inline vint where(vmask mask, vint yes, vint no) { return mask ? yes : no; }
inline vint bits_of(vfloat value) { return (vint)value; }  // the same bits, as integers
inline vfloat float_of_bits(vint bits) { return (vfloat)bits; }
inline vint to_int(vfloat value) { return __builtin_convertvector(value, vint); }  // truncates
inline vfloat lane_index() {  // 0, 1, ..., 15
  return vfloat{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
}

// 16 bf16 bits -> their fp32 bits (shifted up); 16 fp32 bits' upper halves -> 16 bf16 bits.
inline vint widen_bf16(const uint16_t* source) {
  vhalf bits;
  std::memcpy(&bits, source, sizeof(bits));
  return __builtin_convertvector(bits, vint) << 16;
}
inline void narrow_bf16(uint16_t* target, vint bits) {
  const vhalf narrow = __builtin_convertvector(bits >> 16, vhalf);
  std::memcpy(target, &narrow, sizeof(narrow));
}

#else
typedef float vfloat8 __attribute__((vector_size(32)));
typedef int32_t vint8 __attribute__((vector_size(32)));
typedef uint16_t vhalf8 __attribute__((vector_size(16)));

struct vfloat {
  vfloat8 low, high;
  float operator[](int64_t i) const { return i < 8 ? low[i] : high[i - 8]; }
};
struct vint {
  vint8 low, high;
  int32_t operator[](int64_t i) const { return i < 8 ? low[i] : high[i - 8]; }
};
typedef vint vmask;

#define PREFIXGATE_HALVES_OP(T, S, op)                                                   \
  inline T operator op(T a, T b) { return {a.low op b.low, a.high op b.high}; }        \
  inline T operator op(T a, S b) { return {a.low op b, a.high op b}; }                 \
  inline T operator op(S a, T b) { return {a op b.low, a op b.high}; }                 \
  inline T& operator op##=(T& a, T b) { return a = a op b; }                           \
  inline T& operator op##=(T& a, S b) { return a = a op b; }
PREFIXGATE_HALVES_OP(vfloat, float, +)
PREFIXGATE_HALVES_OP(vfloat, float, -)
PREFIXGATE_HALVES_OP(vfloat, float, *)
PREFIXGATE_HALVES_OP(vfloat, float, /)
PREFIXGATE_HALVES_OP(vint, int32_t, +)
PREFIXGATE_HALVES_OP(vint, int32_t, -)
PREFIXGATE_HALVES_OP(vint, int32_t, &)
PREFIXGATE_HALVES_OP(vint, int32_t, |)
PREFIXGATE_HALVES_OP(vint, int32_t, <<)
PREFIXGATE_HALVES_OP(vint, int32_t, >>)
#undef PREFIXGATE_HALVES_OP

#define PREFIXGATE_HALVES_COMPARE(op)                                                  \
  inline vmask operator op(vfloat a, vfloat b) {                                       \
    return {a.low op b.low, a.high op b.high};                                         \
  }                                                                                    \
  inline vmask operator op(vfloat a, float b) { return {a.low op b, a.high op b}; }
PREFIXGATE_HALVES_COMPARE(<)
PREFIXGATE_HALVES_COMPARE(<=)
PREFIXGATE_HALVES_COMPARE(>)
PREFIXGATE_HALVES_COMPARE(>=)
PREFIXGATE_HALVES_COMPARE(!=)
#undef PREFIXGATE_HALVES_COMPARE

inline vfloat operator-(vfloat a) { return {-a.low, -a.high}; }

inline vfloat splat(float value) { return {vfloat8{} + value, vfloat8{} + value}; }
inline vint splat_int(int32_t value) { return {vint8{} + value, vint8{} + value}; }
inline vfloat where(vmask mask, vfloat yes, vfloat no) {
  return {mask.low ? yes.low : no.low, mask.high ? yes.high : no.high};
}
inline vint where(vmask mask, vint yes, vint no) {
  return {mask.low ? yes.low : no.low, mask.high ? yes.high : no.high};
}
inline vint bits_of(vfloat value) { return {(vint8)value.low, (vint8)value.high}; }
inline vfloat float_of_bits(vint bits) { return {(vfloat8)bits.low, (vfloat8)bits.high}; }
inline vint to_int(vfloat value) {
  return {__builtin_convertvector(value.low, vint8), __builtin_convertvector(value.high, vint8)};
}
inline vfloat lane_index() {
  return {vfloat8{0, 1, 2, 3, 4, 5, 6, 7}, vfloat8{8, 9, 10, 11, 12, 13, 14, 15}};
}

inline vint widen_bf16(const uint16_t* source) {
  vhalf8 low, high;
  std::memcpy(&low, source, sizeof(low));
  std::memcpy(&high, source + 8, sizeof(high));
  return vint{__builtin_convertvector(low, vint8), __builtin_convertvector(high, vint8)} << 16;
}
inline void narrow_bf16(uint16_t* target, vint bits) {
  const vhalf8 low = __builtin_convertvector(bits.low >> 16, vhalf8);
  const vhalf8 high = __builtin_convertvector(bits.high >> 16, vhalf8);
  std::memcpy(target, &low, sizeof(low));
  std::memcpy(target + 8, &high, sizeof(high));
}
#endif

// A pair of halves is loaded and stored half by half: copied whole, GCC moves it through the
// stack in 16-byte pieces, and an 8-lane load of that stalls on store forwarding.
inline vfloat load(const float* source) {
  vfloat out;
#if defined(PREFIXGATE_VECTOR_REGISTERS)
  std::memcpy(&out, source, sizeof(out));
#else
  std::memcpy(&out.low, source, sizeof(out.low));
  std::memcpy(&out.high, source + 8, sizeof(out.high));
#endif
  return out;
}

// 16 bf16 -> fp32. With AVX-512 one widening `vpmovzxwd` and a shift: GCC tunes Sapphire Rapids
// for 256-bit vectors and compiles the generic conversion as two halves and an insert.
inline vfloat load(const c10::BFloat16* source) {
#if defined(__AVX512F__)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source));
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
#else
  return float_of_bits(widen_bf16(reinterpret_cast<const uint16_t*>(source)));
#endif
}

inline void store(float* target, vfloat value) {
#if defined(PREFIXGATE_VECTOR_REGISTERS)
  std::memcpy(target, &value, sizeof(value));
#else
  std::memcpy(target, &value.low, sizeof(value.low));
  std::memcpy(target + 8, &value.high, sizeof(value.high));
#endif
}

inline float lanes_sum(vfloat v) {
#if defined(__AVX512F__)
  __m512 wide;
  std::memcpy(&wide, &v, sizeof(wide));
  return _mm512_reduce_add_ps(wide);
#elif defined(__AVX__)
  const __m256 half = _mm256_add_ps((__m256)v.low, (__m256)v.high);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
#else
  float total = 0.0f;
  for (int64_t i = 0; i < kLanes; ++i) total += v[i];
  return total;
#endif
}

inline float lanes_max(vfloat v) {
#if defined(__AVX512F__)
  __m512 wide;
  std::memcpy(&wide, &v, sizeof(wide));
  return _mm512_reduce_max_ps(wide);
#elif defined(__AVX__)
  const __m256 half = _mm256_max_ps((__m256)v.low, (__m256)v.high);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
#else
  float best = v[0];
  for (int64_t i = 1; i < kLanes; ++i) best = std::max(best, v[i]);
  return best;
#endif
}

// 2^y for y <= 0 (2^-126 below -126): an integer power, built in the exponent bits, times a
// degree-6 Taylor polynomial of 2^f on [-0.5, 0.5] (relative error below 2e-7).
inline vfloat vexp2(vfloat y) {
  y = where(y < -126.0f, splat(-126.0f), y);
  const vfloat n = (y + 12582912.0f) - 12582912.0f;  // round to nearest
  const vfloat f = y - n;
  vfloat p = splat(1.5403530e-4f);
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  return p * float_of_bits((to_int(n) + 127) << 23);
}

constexpr float kLog2e = 1.4426950408889634f;

// 2^y for y <= 0, reaching exact zero far below -126 (kMasked scores need no select): with
// AVX-512 the integer power is applied by `vscalefps` (no clamp, no exponent bits to build)
// to a degree-5 least-squares fit of 2^f on [-0.5, 0.5] (relative error about 2e-7 evaluated
// in fp32, as vexp2's): 11 operations instead of 17. Elsewhere vexp2 with a select.
inline vfloat vexp2_scaled(vfloat y) {
#if defined(__AVX512F__)
  // -inf would make f = -inf - -inf = NaN; the lowest finite float gives f = 0 and 2^y = 0.
  const __m512 wide = _mm512_max_ps((__m512)y, _mm512_set1_ps(-3.0e38f));
  const __m512 n = _mm512_roundscale_ps(wide, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vfloat f = (vfloat)_mm512_sub_ps(wide, n);
  vfloat p = splat(1.32669704e-3f);
  p = p * f + 9.67545975e-3f;
  p = p * f + 5.55074262e-2f;
  p = p * f + 2.40221218e-1f;
  p = p * f + 6.93146949e-1f;
  p = p * f + 1.00000007f;
  return (vfloat)_mm512_scalef_ps((__m512)p, n);
#else
  return where(y < -150.0f, splat(0.0f), vexp2(y));
#endif
}

// 2^y for y <= 0, for a softmax's probabilities: they are rounded to bf16 (8 significant bits:
// a rounding moves a value by up to 2^-8 of it) and summed in fp32, so a relative error of 1e-4
// is ample: 9.5e-5 at most for normal results (checked over [-149, 0] in steps of 2^-16 against
// exp2 in double), which moves one probability in 100 to the neighbouring bf16 value.
// With AVX-512 (DQ), f = y - floor(y) comes from one `vreduceps` (for y in (-0.5, 0) rounded,
// at most 2^-25 off, and to 1 above -2^-25, where the polynomial's 1.99986 is as close; 0 for
// -inf), 2^f from a degree-3 minimax fit of the relative error whose value at 0 is exactly 1,
// and `vscalefps` multiplies by 2^floor(y) itself (exactly 0 for y below -150 or -inf): 5
// instructions where vexp2_scaled takes 9 (a clamp, a rounding and a subtraction instead of
// one `vreduceps`, two more polynomial terms). A NaN stays NaN (vexp2_scaled's clamp turned
// it into 0). SiLU keeps vexp2_scaled: there bf16 results equal torch's bit for bit, which a
// cheaper exp loses (a degree-5 variant of this one gave other bits for 24 of 2.4 million SiLU
// values). Elsewhere vexp2_scaled.
inline vfloat vexp2_softmax(vfloat y) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  const vfloat f = (vfloat)_mm512_reduce_ps((__m512)y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  vfloat p = splat(7.714261e-2f);
  p = p * f + 2.2765168e-1f;
  p = p * f + 6.9507042e-1f;
  p = p * f + 1.0f;
  return (vfloat)_mm512_scalef_ps((__m512)p, (__m512)y);
#else
  return vexp2_scaled(y);
#endif
}

// exp(x) for x <= 0, as 2^(x log2 e).
inline vfloat vexp(vfloat x) { return vexp2(x * kLog2e); }

// fp32 -> bf16 bits, rounded to nearest even; NaN stays a (quiet) NaN. With AVX512_BF16 one
// instruction (`vcvtneps2bf16`, which also flushes fp32 subnormals to zero: no kernel here
// stores one that matters, and keeps a NaN's sign and payload where the fallback stores the
// canonical NaN), else eight vector operations.
inline void store_bf16(uint16_t* target, vfloat value) {
#if defined(__AVX512BF16__)
  __m512 wide;
  std::memcpy(&wide, &value, sizeof(wide));
  const __m256bh narrow = _mm512_cvtneps_pbh(wide);
  std::memcpy(target, &narrow, sizeof(narrow));
#else
  // A NaN becomes the canonical NaN first, which the rounding keeps; then adding 0x7FFF and
  // bit 16 rounds to nearest even, and no lane passes INT32_MAX.
  const vint bits = where(value != value, splat_int(0x7FC00000), bits_of(value));
  narrow_bf16(target, bits + ((bits >> 16) & 1) + 0x7FFF);
#endif
}

// Two vectors -> 32 bf16 side by side: with AVX512_BF16 one `vcvtne2ps2bf16` (the same bits as
// two store_bf16), half the conversions and stores.
inline void store_bf16_pair(uint16_t* target, vfloat low, vfloat high) {
#if defined(__AVX512BF16__)
  const __m512bh narrow = _mm512_cvtne2ps_pbh((__m512)high, (__m512)low);
  std::memcpy(target, &narrow, sizeof(narrow));
#else
  store_bf16(target, low);
  store_bf16(target + kLanes, high);
#endif
}

inline void store(c10::BFloat16* target, vfloat value) {
  store_bf16(reinterpret_cast<uint16_t*>(target), value);
}

// The value as the dtype would hold it: bf16 rounds (to nearest even), fp32 stays. With
// AVX512_BF16 in registers (convert, widen, shift), which measured faster than through memory.
inline vfloat round_to(vfloat value, float*) { return value; }
inline vfloat round_to(vfloat value, c10::BFloat16*) {
#if defined(__AVX512BF16__)
  const __m512i narrow = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)value));
  return (vfloat)_mm512_slli_epi32(narrow, 16);
#else
  uint16_t bits[kLanes];
  store_bf16(bits, value);
  return load(reinterpret_cast<const c10::BFloat16*>(bits));
#endif
}

// silu(x) = x * sigmoid(x), from e = exp(-|x|) <= 1 so that exp never overflows (vexp2_scaled:
// faster than vexp here); one division: sigmoid is e / (1 + e) below zero, 1 / (1 + e)
// from zero up.
inline vfloat silu(vfloat x) {
  const vmask negative = x < 0.0f;
  const vfloat e = vexp2_scaled(where(negative, -x, x) * -kLog2e);
  const vfloat sigmoid = where(negative, e, splat(1.0f)) / (1.0f + e);
  return x * sigmoid;
}

}  // namespace prefixgate
