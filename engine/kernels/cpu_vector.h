// Vector helpers shared by the CPU kernels: 16-lane fp32 vectors (GCC/Clang vector extensions:
// AVX-512 where the CPU has it, narrower registers elsewhere), loads from fp32 and bf16,
// horizontal sums and maxima, a fast exp, bf16 rounding and SiLU.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace prefixgate {

constexpr int64_t kLanes = 16;     // floats per vector
constexpr float kMasked = -1e30f;  // finite, so no infinity arithmetic is ever needed

typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));
typedef uint16_t vhalf __attribute__((vector_size(32)));

inline vfloat splat(float value) { return vfloat{} + value; }

inline vfloat load(const float* source) {
  vfloat out;
  std::memcpy(&out, source, sizeof(out));
  return out;
}

// 16 bf16 -> fp32. With AVX-512 one widening `vpmovzxwd` and a shift: GCC tunes Sapphire Rapids
// for 256-bit vectors and compiles the generic conversion as two halves and an insert.
inline vfloat load(const c10::BFloat16* source) {
#if defined(__AVX512F__)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source));
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
#else
  vhalf bits;
  std::memcpy(&bits, source, sizeof(bits));
  const vint wide = __builtin_convertvector(bits, vint) << 16;
  return (vfloat)wide;  // a same-size vector cast: the bits, reinterpreted
#endif
}

inline void store(float* target, vfloat value) { std::memcpy(target, &value, sizeof(value)); }

inline float lanes_sum(vfloat v) {
#if defined(__AVX512F__)
  __m512 wide;
  std::memcpy(&wide, &v, sizeof(wide));
  return _mm512_reduce_add_ps(wide);
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
#else
  float best = v[0];
  for (int64_t i = 1; i < kLanes; ++i) best = std::max(best, v[i]);
  return best;
#endif
}

// 2^y for y <= 0 (2^-126 below -126): an integer power, built in the exponent bits, times a
// degree-6 Taylor polynomial of 2^f on [-0.5, 0.5] (relative error below 2e-7).
inline vfloat vexp2(vfloat y) {
  y = y < -126.0f ? splat(-126.0f) : y;
  const vfloat n = (y + 12582912.0f) - 12582912.0f;  // round to nearest
  const vfloat f = y - n;
  vfloat p = splat(1.5403530e-4f);
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  return p * (vfloat)bits;
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
  return y < -150.0f ? splat(0.0f) : vexp2(y);
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
  vint bits = (vint)value;
  const vint rounded = (vint)((vuint)bits + (((vuint)bits >> 16) & 1u) + 0x7FFFu);
  bits = value != value ? vint{} + 0x7FC00000 : rounded;
  const vhalf narrow = __builtin_convertvector(bits >> 16, vhalf);
  std::memcpy(target, &narrow, sizeof(narrow));
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
// AVX512_BF16 in registers (convert, widen, shift): through memory, rotary_ over 1,536 rows
// took 0.200 ms instead of 0.154.
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
// 11% faster than vexp here); one division: sigmoid is e / (1 + e) below zero, 1 / (1 + e)
// from zero up.
inline vfloat silu(vfloat x) {
  const vfloat magnitude = x < 0.0f ? -x : x;
  const vfloat e = vexp2_scaled(magnitude * -kLog2e);
  const vfloat sigmoid = (x < 0.0f ? e : splat(1.0f)) / (1.0f + e);
  return x * sigmoid;
}

}  // namespace prefixgate
