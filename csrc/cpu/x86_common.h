// What the x86 paths' translation units (AVX2, AVX-512) share: the scalar
// loads and stores of bf16 / fp16 bits for the row tails (row_kernels.h's
// load_scalar / store_scalar; the rounding matches the vector stores'), and the
// horizontal fold of 8 fp32 lanes. Like row_kernels.h, included once inside each
// instruction set's namespace (no include guard, no #include: the includer has
// included <cstring> and <immintrin.h>).
#ifndef TWINKLE_MEM_ROW_KERNELS_ISA
#error "x86_common.h: include it inside a per-ISA namespace, before row_kernels.h"
#endif

// 2^r on [-1/2, 1/2]: the polynomials of each path's exp2_ (coefficients of r^0, r^1, ...), fitted
// here (least squares weighted toward the largest relative error, rounded to fp32). Max relative
// error evaluated in fp32: 2.1e-7 for the forward's sums (degree 5: the 1e-6 bounds on logp and
// entropy keep ~5x margin), 2.7e-6 for 16-bit gradients (degree 4: 1/1400 of a bf16 ulp, 1/360 of fp16's).
constexpr float kExp2Poly5[6] = {1.0000001192092896f, 0.6931469440460205f, 0.24022118747234344f,
                                 0.05550709739327431f, 0.00967555120587349f, 0.001327760168351233f};
constexpr float kExp2Poly4[5] = {0.9999992847442627f, 0.6931217908859253f, 0.24024717509746552f,
                                 0.05591795593500137f, 0.009571239352226257f};

// bf16 and fp16 are both 16-bit patterns; tags tell the loads apart.
struct bf16_bits { uint16_t bits; };
struct fp16_bits { uint16_t bits; };

inline float load_scalar(const float* p) { return *p; }
inline float load_scalar(const bf16_bits* p) {
  const uint32_t bits = uint32_t(p->bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float load_scalar(const fp16_bits* p) { return _cvtsh_ss(p->bits); }
inline void store_scalar(float* p, float v) { *p = v; }
// fp32 -> bf16 rounding to nearest even (subnormals kept); NaN becomes the quiet NaN 0x7FC0.
inline void store_scalar(bf16_bits* p, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  p->bits = v != v ? uint16_t(0x7FC0) : uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
inline void store_scalar(fp16_bits* p, float v) { p->bits = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }

// Order-preserving integer keys of 16-bit floats (bf16, fp16: sign and magnitude): the bits with the
// magnitude flipped where the sign is set, bits ^ ((bits >> 15) & 0x7FFF) as int16, order as the values
// do (-0 just below +0; a NaN with the sign clear above +inf, one with it set below -inf); the same
// expression takes a key back to its bits.
// max_key8: the largest of 8 keys, by PHMINPOSUW on their complements as unsigned words.
inline int16_t max_key8(__m128i keys) {
  const __m128i flipped = _mm_xor_si128(keys, _mm_set1_epi16(0x7FFF));  // signed max -> unsigned min
  return int16_t(_mm_cvtsi128_si32(_mm_minpos_epu16(flipped)) ^ 0x7FFF);
}
template <typename T16>
inline float value_of_key(int16_t key) {
  const T16 bits{uint16_t(key ^ ((key >> 15) & 0x7FFF))};
  return load_scalar(&bits);
}

// The max or sum of 8 lanes: halves folded, 256 -> 128 -> 64 -> 32 bits (lane 0 holds the result).
struct FoldMax {
  static __m128 op(__m128 a, __m128 b) { return _mm_max_ps(a, b); }
};
struct FoldAdd {
  static __m128 op(__m128 a, __m128 b) { return _mm_add_ps(a, b); }
};
template <typename Fold>
inline float fold8(__m256 v) {
  __m128 m = Fold::op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = Fold::op(m, _mm_movehl_ps(m, m));
  m = Fold::op(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
