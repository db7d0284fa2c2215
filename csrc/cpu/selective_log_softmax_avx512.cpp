// The CPU kernel's row loops compiled for AVX-512 F/BW/VL/DQ (16 fp32 lanes),
// two paths (isa.h): avx512, and avx512_bf16, the same but for one function,
// the bf16 gradient's store, which rounds with AVX-512 BF16's VCVTNE2PS2BF16.
// Everything in this file is compiled for AVX-512 + BF16, so the host code calls
// a path only after the CPU reports its instruction sets: no BF16 instruction is
// written outside the avx512_bf16 path's store (the compiler emits none of its
// own: it has no __bf16 arithmetic here; tests/backends/cpu/test_cpu_paths.py checks the
// library's code). The shared math is instantiated in its own inline namespace
// (TWINKLE_MEM_ISA).
//
// The lane arithmetic is the AVX2 path's, twice as wide: the same exp (the
// scaling by 2^n is one VSCALEFPS, the same single rounding as AVX2's two
// multiplies), the same formulas; only the summation order of the forward
// differs (16 lanes per vector), so the two paths' statistics may differ in
// their last bits (docs/numerics.md).
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the unused merge source
// of their masked builtins, which -Wmaybe-uninitialized reports at every use (GCC bug
// 105593, fixed in 13): silenced in this file only.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define TWINKLE_MEM_ISA avx512
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"

namespace twinkle_mem {
namespace cpu {
namespace avx512 {

#define TWINKLE_MEM_ROW_KERNELS_ISA avx512  // the row loops, once, in this namespace
#include "x86_common.h"

struct Vec16f {
  __m512 v;
  Vec16f() = default;
  Vec16f(__m512 x) : v(x) {}
  Vec16f(float s) : v(_mm512_set1_ps(s)) {}
};
inline Vec16f operator+(Vec16f a, Vec16f b) { return _mm512_add_ps(a.v, b.v); }
inline Vec16f operator-(Vec16f a, Vec16f b) { return _mm512_sub_ps(a.v, b.v); }
inline Vec16f operator*(Vec16f a, Vec16f b) { return _mm512_mul_ps(a.v, b.v); }
// VMAXPS returns its second operand when either is NaN: b's NaNs pass through.
inline Vec16f max_(Vec16f a, Vec16f b) { return _mm512_max_ps(a.v, b.v); }
inline Vec16f fma_(Vec16f a, Vec16f b, Vec16f c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }
using twinkle_mem::exp_;
using twinkle_mem::fma_;
using twinkle_mem::max_;

// exp(x) for x <= 0 (and -inf, NaN): the AVX2 path's exp (its comment has the
// polynomial's fit and accuracy), lane for lane the same bits. x = n ln2 + r,
// |r| <= ln2/2, n rounded as there, e^r by the same degree-6 polynomial;
// VSCALEFPS multiplies by 2^n with one rounding, as AVX2's 2^(n + 64) then 2^-64
// does: results below fp32's normal range come out as correctly rounded
// subnormals. Below -110 the result is 0; NaN stays NaN.
constexpr float kRoundToInt = 12582912.0f;  // 1.5 * 2^23: x + it - it rounds x to an integer, ties to even
inline Vec16f exp_(Vec16f x) {
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-110.0f), x.v);  // NaN passes through
  // The product rounded on its own (the _round form keeps GCC from fusing it into the add: an FMA
  // would round x log2(e) + 1.5 2^23 once and pick another n at near-ties than the AVX2 path).
  const __m512 y = _mm512_mul_round_ps(xc, _mm512_set1_ps(1.44269504088896341f), _MM_FROUND_CUR_DIRECTION);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(y, _mm512_set1_ps(kRoundToInt)), _mm512_set1_ps(kRoundToInt));
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182464599609375f), xc);
  __m512 p = _mm512_set1_ps(0.001383816939778626f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.00837482325732708f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.041668202728033066f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.16666419804096222f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.49999991059303284f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 2^y for y <= 0, -inf (0) and NaN: the AVX2 path's exp2_ (its comment says how), lane for lane the
// same bits. VREDUCEPS gives r = y - round(y) in [-1/2, 1/2], exactly (it rounds its subtraction in the
// mode it rounds y in, so rounding down would round r down too: 1 + y for y in (-1/2, 0) is not always
// an fp32, and AVX2's y - floor(y) rounds to nearest); VSCALEFPS multiplies by 2^(y - r) (one rounding,
// subnormals kept). For y = -inf, VREDUCEPS gives 0 and VSCALEFPS of -inf gives 0: the sums need no
// clamp here (kExp2TakesNegInf; the op tests' logp-only calls on -inf logits take this path).
constexpr bool kExp2TakesNegInf = true;
template <int kTerms>
inline Vec16f exp2_(Vec16f y, const float (&poly)[kTerms]) {
  const __m512 r = _mm512_reduce_ps(y.v, _MM_FROUND_TO_NEAREST_INT);
  __m512 p = _mm512_set1_ps(poly[kTerms - 1]);
  for (int k = kTerms - 2; k >= 0; --k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(poly[k]));
  return _mm512_scalef_ps(p, _mm512_sub_ps(y.v, r));
}

inline Vec16f exp2_for_sums(Vec16f y) { return exp2_(y, kExp2Poly5); }
inline Vec16f exp2_for_grads(Vec16f y) { return exp2_(y, kExp2Poly4); }

template <typename Vec>
struct VecTraits;
template <>
struct VecTraits<Vec16f> {
  using acc_t = float;
  static constexpr int64_t W = 16;
};

inline Vec16f load_vec(const float* p) { return _mm512_loadu_ps(p); }
inline Vec16f load_vec(const bf16_bits* p) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
inline Vec16f load_vec(const fp16_bits* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store_vec(float* p, Vec16f v) { _mm512_storeu_ps(p, v.v); }
// fp32 -> bf16 rounding to nearest even, in the high 16 bits of each lane
// (subnormals kept); NaN becomes the quiet NaN 0x7FC0, as on the AVX2 path.
inline __m512i bf16_round_high(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}
inline void store_vec(bf16_bits* p, Vec16f v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_high(v.v), 16)));
}
inline void store_vec(fp16_bits* p, Vec16f v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT));
}

// 32 elements at once: the 16-bit results of two vectors in one 512-bit store.
inline void store_pair(float* p, Vec16f a, Vec16f b) {
  _mm512_storeu_ps(p, a.v);
  _mm512_storeu_ps(p + 16, b.v);
}
inline void store_pair(bf16_bits* p, Vec16f a, Vec16f b) {
  // The high halves of a's and b's lanes, in element order: words 1, 3, ..., 31 of a, then of b.
  const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                             27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512i packed = _mm512_permutex2var_epi16(bf16_round_high(a.v), odd_words, bf16_round_high(b.v));
  _mm512_storeu_si512(p, packed);
}
// The avx512_bf16 path's bf16 logits: loaded as bf16_bits, stored with VCVTNE2PS2BF16 (one instruction for 32
// elements, rounding to nearest even as bf16_round_high). It treats fp32 subnormals as 0 (whatever MXCSR
// says); a gradient below fp32's normal range (e^-100 of a peaked row) is one, so pairs holding any take the
// integer rounding: the same bits as the avx512 path's, but for a NaN's payload.
struct bf16_native_bits { uint16_t bits; };
inline Vec16f load_vec(const bf16_native_bits* p) { return load_vec(reinterpret_cast<const bf16_bits*>(p)); }
inline float load_scalar(const bf16_native_bits* p) { return load_scalar(reinterpret_cast<const bf16_bits*>(p)); }
inline void store_vec(bf16_native_bits* p, Vec16f v) { store_vec(reinterpret_cast<bf16_bits*>(p), v); }
inline void store_scalar(bf16_native_bits* p, float v) { store_scalar(reinterpret_cast<bf16_bits*>(p), v); }
inline void store_pair(bf16_native_bits* p, Vec16f a, Vec16f b) {
  constexpr int kSubnormal = 0x20;  // VFPCLASSPS category
  // (KORTESTW of the two masks: the test in one instruction, not two moves to general registers and an OR)
  if (__builtin_expect(!_mm512_kortestz(_mm512_fpclass_ps_mask(a.v, kSubnormal), _mm512_fpclass_ps_mask(b.v, kSubnormal)), 0)) {
    return store_pair(reinterpret_cast<bf16_bits*>(p), a, b);
  }
  _mm512_storeu_si512(p, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b.v, a.v)));  // a in the low half
}
inline void store_pair(fp16_bits* p, Vec16f a, Vec16f b) {
  const __m256i lo = _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT);
  const __m256i hi = _mm512_cvtps_ph(b.v, _MM_FROUND_TO_NEAREST_INT);
  _mm512_storeu_si512(p, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

// The horizontal sum: the halves folded to 8 lanes, then as on the AVX2 path.
inline float hsum(Vec16f v) {
  return fold8<FoldAdd>(_mm256_add_ps(_mm512_castps512_ps256(v.v), _mm512_extractf32x8_ps(v.v, 1)));
}

inline int64_t count_equal(Vec16f x, Vec16f value) { return __builtin_popcount(_mm512_cmp_ps_mask(x.v, value.v, _CMP_EQ_OQ)); }

// 32 logits as two vectors, for the forward's second sweep (from L1). bf16: the odd elements are the
// high halves of the 32-bit words as they are, the even ones the low halves shifted up: one
// instruction per vector, against two for load_vec's zero extension and shift.
inline void load_pair(const bf16_bits* p, Vec16f& odd, Vec16f& even) {
  const __m512i words = _mm512_loadu_si512(p);
  odd = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(int(0xFFFF0000u))));
  even = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}

// And back (the backward's stores), as on the AVX2 path: the odd elements' bf16 are the high halves of their
// rounded lanes, the even ones' are moved down into the low halves; one blend of 16-bit words puts the 32 in
// place. (The avx512_bf16 path's bf16_native_bits take load_vec and store_pair, in order: VCVTNE2PS2BF16.)
inline void store_loaded_pair(bf16_bits* p, Vec16f odd, Vec16f even) {
  const __m512i low = _mm512_srli_epi32(bf16_round_high(even.v), 16);
  _mm512_storeu_si512(p, _mm512_mask_blend_epi16(0xAAAAAAAAu, low, bf16_round_high(odd.v)));
}

// The running max of the forward's first sweep, a vector pair (32 elements) at a time. 16-bit floats: on
// order-preserving integer keys, the bits with the magnitude flipped where the sign is set (x86_common.h), 32 per
// vector and 3 instructions, without converting to fp32.
template <typename T16>
inline __m512i max_start(const T16*) { return _mm512_set1_epi16(INT16_MIN); }
template <typename T16>
inline __m512i max_add_pair(__m512i keys, const T16* p) {
  const __m512i bits = _mm512_loadu_si512(p);
  // bits ^ ((bits >> 15) & 0x7FFF): the ternary-logic table of a ^ (b & c)
  return _mm512_max_epi16(keys, _mm512_ternarylogic_epi32(bits, _mm512_srai_epi16(bits, 15), _mm512_set1_epi16(0x7FFF), 0x78));
}
template <typename T16>
inline float max_result(__m512i keys, const T16*) {
  const __m256i half = _mm256_max_epi16(_mm512_castsi512_si256(keys), _mm512_extracti64x4_epi64(keys, 1));
  return value_of_key<T16>(max_key8(_mm_max_epi16(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1))));
}
inline Vec16f max_start(const float*) { return Vec16f(-std::numeric_limits<float>::infinity()); }
inline Vec16f max_add_pair(Vec16f v_max, const float* p) { return max_(max_(v_max, load_vec(p)), load_vec(p + 16)); }
inline float max_result(Vec16f v_max, const float*) {
  return fold8<FoldMax>(_mm256_max_ps(_mm512_castps512_ps256(v_max.v), _mm512_extractf32x8_ps(v_max.v, 1)));
}

// sum + e in the lanes where x != max (NaN included): one masked add.
inline Vec16f add_below(Vec16f sum, Vec16f e, Vec16f x, Vec16f max) {
  return _mm512_mask_add_ps(sum.v, _mm512_cmp_ps_mask(x.v, max.v, _CMP_NEQ_UQ), sum.v, e.v);
}

using RowVec = Vec16f;
using bf16_t = bf16_bits;
using fp16_t = fp16_bits;
#include "row_kernels.h"

}  // namespace avx512

const RowKernels avx512_row_kernels = avx512::kRowKernels;

// The avx512_bf16 path: avx512's entry points, but the bf16 gradient's store.
constexpr RowKernels avx512_bf16_kernels() {
  RowKernels k = avx512::kRowKernels;
  k.name = "avx512_bf16";
  k.grad_bf16 = [](const uint16_t* x, uint16_t* d, int64_t n, const RowGrad<float>& g) {
    avx512::segment_grad<avx512::Vec16f>(reinterpret_cast<const avx512::bf16_native_bits*>(x),
                                         reinterpret_cast<avx512::bf16_native_bits*>(d), n, g);
  };
  return k;
}
const RowKernels avx512_bf16_row_kernels = avx512_bf16_kernels();

}  // namespace cpu
}  // namespace twinkle_mem
#endif
