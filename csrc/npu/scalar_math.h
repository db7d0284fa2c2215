// Scalar helpers of the AscendC kernel that the AI core's scalar unit has no
// instruction for: bit casts, 16-bit floats from their bits, expm1 near 0 and
// log1p from ln. Header-only and free of any include, so that the kernel, the
// stand-in and tests/backends/npu/npu_tiling_test.cpp (which measures their accuracy
// against the C library) compile the same lines.
#pragma once

#include "tiling.h"  // TM_NPU_INLINE

namespace twinkle_mem {
namespace npu {

typedef unsigned int u32;
typedef unsigned short u16;

union F32Bits {
  float f;
  u32 u;
};
TM_NPU_INLINE float float_from_bits(u32 u) {
  F32Bits b;
  b.u = u;
  return b.f;
}
TM_NPU_INLINE u32 bits_of_float(float f) {
  F32Bits b;
  b.f = f;
  return b.u;
}
TM_NPU_INLINE float neg_inf() { return float_from_bits(0xff800000u); }
TM_NPU_INLINE float pos_inf() { return float_from_bits(0x7f800000u); }
TM_NPU_INLINE float quiet_nan() { return float_from_bits(0x7fc00000u); }

// Exact conversions of a 16-bit logit read as bits (the scalar unit's own
// bf16 / fp16 conversions differ between CANN releases; these do not).
TM_NPU_INLINE float bf16_bits_to_float(u16 h) { return float_from_bits(static_cast<u32>(h) << 16); }
TM_NPU_INLINE float fp16_bits_to_float(u16 h) {
  const u32 sign = static_cast<u32>(h & 0x8000u) << 16;
  const u32 exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1fu) return float_from_bits(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in fp32
    const float v = static_cast<float>(mant) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return float_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

// expm1(u) for |u| < 0.5: the Taylor series to u^8 / 8! in Horner form. Its
// truncation is below 1.1e-8 relative (0.5^8 / 9!) and its rounding a few
// ulp (tests/backends/npu/npu_tiling_test.cpp measures <= 2 ulp against expm1). The kernel
// uses p - 1 with p = exp(u) from the vector unit for |u| >= 0.5, where the
// subtraction loses at most 1.5 ulp (p <= 0.61).
constexpr float kExpm1SeriesBound = 0.5f;
TM_NPU_INLINE float expm1_series(float u) {
  float s = 1.0f + u * 0.125f;          // 1 + u/8
  s = 1.0f + u * 0.14285714285714285f * s;  // 1 + u/7 (...)
  s = 1.0f + u * 0.16666666666666666f * s;  // 1 + u/6 (...)
  s = 1.0f + u * 0.2f * s;
  s = 1.0f + u * 0.25f * s;
  s = 1.0f + u * 0.33333333333333333f * s;
  s = 1.0f + u * 0.5f * s;
  return u * s;
}

// log1p(r) for the row's rest r >= 0 (or -1 for a row of only -inf), with
// ln(w), w = 1 + r rounded, from the caller (a 1-element vector Ln on the AI core):
//   r < 2^-7: the series r - r^2/2 + ... - r^6/6 (truncation below 1e-13
//             relative): a confident row's rest of 1e-10 keeps log_sum = 1e-10,
//             whatever the accuracy of Ln near 1;
//   else:     ln(w) + c / w with c = r - (w - 1), the rounding error of w (exact):
//             log1p(r) = ln(w) + ln(1 + c / w), |c / w| <= 2^-24, so the result
//             is as accurate as ln(w) plus one rounding.
//   r = -1:   -inf (a row of only -inf), without ln: the vector unit is never
//             asked for Ln(0), whose result on the AI core is not documented.
// log1p_needs_ln(r) says whether the caller must compute ln(w).
constexpr float kLog1pSeriesBound = 0.0078125f;  // 2^-7
TM_NPU_INLINE bool log1p_needs_ln(float r) { return !(r >= 0.0f && r < kLog1pSeriesBound) && r != -1.0f; }
TM_NPU_INLINE float log1p_from_ln(float r, float ln_w) {
  if (r == -1.0f) return neg_inf();
  if (r >= 0.0f && r < kLog1pSeriesBound) {
    float s = -r * (1.0f / 6.0f);
    s = r * (0.2f + s);
    s = r * (-0.25f + s);
    s = r * (0.33333333333333333f + s);
    s = r * (-0.5f + s);
    return r + r * s;
  }
  const float w = 1.0f + r;
  if (!(w < pos_inf()) || !(r > 0.0f)) return ln_w;  // inf, NaN (or r < 0, never a row's)
  const float c = r - (w - 1.0f);                     // exact: w - 1 and r are within a factor 2
  return ln_w + c / w;
}

}  // namespace npu
}  // namespace twinkle_mem
