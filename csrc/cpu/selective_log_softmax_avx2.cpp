// The CPU kernel's row loops compiled for AVX2 + FMA + F16C (8 fp32 lanes).
// Everything in this file is compiled for that instruction set, so the host
// code calls it only after the CPU reports AVX2, FMA and F16C (isa.h); the
// shared math is instantiated in its own inline namespace (TWINKLE_MEM_ISA)
// to keep it apart from the other builds of the same templates.
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#define TWINKLE_MEM_ISA avx2
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"

namespace twinkle_mem {
namespace cpu {
namespace avx2 {

#define TWINKLE_MEM_ROW_KERNELS_ISA avx2  // the row loops, once, in this namespace
#include "x86_common.h"

struct Vec8f {
  __m256 v;
  Vec8f() = default;
  Vec8f(__m256 x) : v(x) {}
  Vec8f(float s) : v(_mm256_set1_ps(s)) {}
};
inline Vec8f operator+(Vec8f a, Vec8f b) { return _mm256_add_ps(a.v, b.v); }
inline Vec8f operator-(Vec8f a, Vec8f b) { return _mm256_sub_ps(a.v, b.v); }
inline Vec8f operator*(Vec8f a, Vec8f b) { return _mm256_mul_ps(a.v, b.v); }
// MAXPS returns its second operand when either is NaN: b's NaNs pass through.
inline Vec8f max_(Vec8f a, Vec8f b) { return _mm256_max_ps(a.v, b.v); }
inline Vec8f fma_(Vec8f a, Vec8f b, Vec8f c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
using twinkle_mem::exp_;
using twinkle_mem::fma_;
using twinkle_mem::max_;

// exp(x) for the x <= 0 (and -inf, NaN) this kernel feeds it: x = n ln2 + r,
// |r| <= ln2/2, e^r by a degree-6 polynomial, times 2^n. The coefficients were
// fitted here to e^r on [-ln2/2, ln2/2] (weighted least squares, rounded to
// fp32): max relative error 7.1e-8 evaluated in fp32, about one fp32 rounding,
// as accurate as the degree-7 Taylor polynomial with one FMA less. n is
// x log2(e) (rounded to fp32) rounded to the nearest integer, ties to even, by
// adding and subtracting 1.5 2^23 (exactly what ROUNDPS gives for |n| < 2^22,
// in two single-uop adds instead of its two uops); the sum's low bits are n as
// an integer. 2^n is applied as 2^(n + 64) built in the exponent bits, then 2^-64:
// results below fp32's normal range come out as correctly rounded subnormals (a
// bf16 or fp32 gradient of e^-100 is one), not flushed to 0. Below -110 the
// result is 0; NaN stays NaN.
constexpr float kRoundToInt = 12582912.0f;  // 1.5 * 2^23
inline Vec8f exp_(Vec8f x) {
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-110.0f), x.v);  // NaN passes through
  const __m256 shifted = _mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                       _mm256_set1_ps(kRoundToInt));
  const __m256 n = _mm256_sub_ps(shifted, _mm256_set1_ps(kRoundToInt));
  // r = x - n ln2 in one FMA: fp32 ln2 is off by 1.9e-9, so r is off by
  // |n| 1.9e-9 <= 5.5e-8 for the x >= -20 that carry any weight.
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147182464599609375f), xc);
  __m256 p = _mm256_set1_ps(0.001383816939778626f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.00837482325732708f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.041668202728033066f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.16666419804096222f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.49999991059303284f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // (n + 127 + 64) << 23 from the bits of shifted (those of 1.5 2^23, plus n); garbage for NaN, which p carries.
  const __m256i biased = _mm256_add_epi32(_mm256_castps_si256(shifted), _mm256_set1_epi32(127 + 64 - 0x4B400000));
  const __m256i two_n64 = _mm256_slli_epi32(biased, 23);
  return _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n64)), _mm256_set1_ps(0x1p-64f));
}

// 2^y for the y in [-160, 0] (and NaN) the forward's sums and 16-bit gradients feed them: y = n + r,
// n = y rounded to the nearest integer as exp_ rounds it (ties to even; VREDUCEPS on AVX-512 gives the
// same r), 2^r on [-1/2, 1/2] by one of x86_common.h's polynomials, times 2^n as exp_ applies it
// (subnormals kept; 0 below -150). No reduction by ln2: the callers work in base 2 (row_kernels.h).
// y must not be -inf (r would be NaN): the callers clamp it (kExp2TakesNegInf).
constexpr bool kExp2TakesNegInf = false;
template <int kTerms>
inline Vec8f exp2_(Vec8f y, const float (&poly)[kTerms]) {
  const __m256 shifted = _mm256_add_ps(y.v, _mm256_set1_ps(kRoundToInt));
  const __m256 r = _mm256_sub_ps(y.v, _mm256_sub_ps(shifted, _mm256_set1_ps(kRoundToInt)));
  __m256 p = _mm256_set1_ps(poly[kTerms - 1]);
  for (int k = kTerms - 2; k >= 0; --k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(poly[k]));
  const __m256i biased = _mm256_add_epi32(_mm256_castps_si256(shifted), _mm256_set1_epi32(127 + 64 - 0x4B400000));
  const __m256i two_n64 = _mm256_slli_epi32(biased, 23);
  return _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n64)), _mm256_set1_ps(0x1p-64f));
}

inline Vec8f exp2_for_sums(Vec8f y) { return exp2_(y, kExp2Poly5); }
inline Vec8f exp2_for_grads(Vec8f y) { return exp2_(y, kExp2Poly4); }

template <typename Vec>
struct VecTraits;
template <>
struct VecTraits<Vec8f> {
  using acc_t = float;
  static constexpr int64_t W = 8;
};

inline Vec8f load_vec(const float* p) { return _mm256_loadu_ps(p); }
inline Vec8f load_vec(const bf16_bits* p) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
inline Vec8f load_vec(const fp16_bits* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store_vec(float* p, Vec8f v) { _mm256_storeu_ps(p, v.v); }
// fp32 -> bf16 rounding to nearest even, in the high 16 bits of each lane (subnormals kept); NaN becomes the
// quiet NaN 0x7FC0, as on the AVX-512 path.
inline __m256i bf16_round_high(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), is_nan);
}
inline void store_vec(bf16_bits* p, Vec8f v) {
  const __m256i high = _mm256_srli_epi32(bf16_round_high(v.v), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void store_vec(fp16_bits* p, Vec8f v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT));
}

// Two vectors' 16 elements, in order (16-bit ones in one 256-bit store).
inline void store_pair(float* p, Vec8f a, Vec8f b) {
  _mm256_storeu_ps(p, a.v);
  _mm256_storeu_ps(p + 8, b.v);
}
inline void store_pair(fp16_bits* p, Vec8f a, Vec8f b) {
  const __m128i lo = _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT);
  const __m128i hi = _mm256_cvtps_ph(b.v, _MM_FROUND_TO_NEAREST_INT);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_set_m128i(hi, lo));
}

inline float hsum(Vec8f v) { return fold8<FoldAdd>(v.v); }

inline int64_t count_equal(Vec8f x, Vec8f value) {
  return __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(x.v, value.v, _CMP_EQ_OQ)));
}

// 16 logits as two vectors, for the forward's second sweep (from L1); bf16 as on the AVX-512 path:
// the odd elements masked in place, the even ones shifted up.
inline void load_pair(const bf16_bits* p, Vec8f& odd, Vec8f& even) {
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  odd = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(int(0xFFFF0000u))));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

// And back (the backward's stores): the odd elements' bf16 are the high halves of their rounded lanes as they
// are, the even ones' are moved down into the low halves; one blend of 16-bit words puts the 16 in place.
inline void store_loaded_pair(bf16_bits* p, Vec8f odd, Vec8f even) {
  const __m256i low = _mm256_srli_epi32(bf16_round_high(even.v), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_blend_epi16(low, bf16_round_high(odd.v), 0b10101010));
}

// The running max of the forward's first sweep, a vector pair (16 elements) at a time; 16-bit floats on integer
// keys (x86_common.h), as on AVX-512.
template <typename T16>
inline __m256i max_start(const T16*) { return _mm256_set1_epi16(INT16_MIN); }
template <typename T16>
inline __m256i max_add_pair(__m256i keys, const T16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_max_epi16(keys, _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi16(bits, 15), _mm256_set1_epi16(0x7FFF))));
}
template <typename T16>
inline float max_result(__m256i keys, const T16*) {
  return value_of_key<T16>(max_key8(_mm_max_epi16(_mm256_castsi256_si128(keys), _mm256_extracti128_si256(keys, 1))));
}
inline Vec8f max_start(const float*) { return Vec8f(-std::numeric_limits<float>::infinity()); }
inline Vec8f max_add_pair(Vec8f v_max, const float* p) { return max_(max_(v_max, load_vec(p)), load_vec(p + 8)); }
inline float max_result(Vec8f v_max, const float*) { return fold8<FoldMax>(v_max.v); }

// sum + e in the lanes where x != max (NaN included).
inline Vec8f add_below(Vec8f sum, Vec8f e, Vec8f x, Vec8f max) {
  return _mm256_add_ps(sum.v, _mm256_and_ps(_mm256_cmp_ps(x.v, max.v, _CMP_NEQ_UQ), e.v));
}

using RowVec = Vec8f;
using bf16_t = bf16_bits;
using fp16_t = fp16_bits;
#include "row_kernels.h"

}  // namespace avx2

const RowKernels avx2_row_kernels = avx2::kRowKernels;

}  // namespace cpu
}  // namespace twinkle_mem
#endif
