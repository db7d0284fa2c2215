// The math of selective log-softmax and entropy, written once for every backend.
//
// For one row of logits x (length V), temperature T and label y, with z = x / T:
//   lse     = log sum_v exp(z_v)
//   logp    = z_y - lse
//   entropy = -sum_v p_v log p_v = lse - E_p[z],   p = exp(z - lse)
// and the gradient of  g_logp * logp + g_H * entropy  with respect to x:
//   d_v = [g_logp * (onehot_v - p_v) - g_H * p_v * (z_v - E_p[z])] / T
//
// The functions below are templates over the value type V so that the same
// lines serve a scalar (float, double), a SIMD register (the CPU kernel's
// Vec8f) and a CUDA thread. V needs +, -, *, and the free functions
// exp_(V), max_(V, V) (NaN-propagating in its second argument) and log_(V).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define TM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TM_HOST_DEVICE inline __attribute__((always_inline))
#endif

// The functions live in an inline namespace named after the instruction set
// the including file is compiled for (the CPU kernel compiles them once
// portable and once for AVX2), so each compilation keeps its own symbols.
#ifndef TWINKLE_MEM_ISA
#define TWINKLE_MEM_ISA generic
#endif

namespace twinkle_mem {

// Running statistics of a stream of scaled logits z:
//   max  = max z,   sum = sum exp(z - max),   zsum = sum (z - max) exp(z - max).
// zsum is kept relative to max (a refinement of "sum z exp z"): then
// entropy = log(sum) - zsum / sum never subtracts two large numbers.
// The empty state (no element, or only -inf) is {-inf, 0, 0}.
template <typename acc_t>
struct OnlineSoftmax {
  acc_t max;
  acc_t sum;
  acc_t zsum;
};

// Per-row results from a complete state.
template <typename acc_t>
struct RowStats {
  acc_t lse;      // log sum exp z
  acc_t mean;     // E_p[z]
  acc_t entropy;  // lse - E_p[z]
};

inline namespace TWINKLE_MEM_ISA {

// Scalar primitives; vector types provide their own overloads.
TM_HOST_DEVICE float exp_(float v) { return ::expf(v); }
TM_HOST_DEVICE double exp_(double v) { return ::exp(v); }
TM_HOST_DEVICE float log_(float v) { return ::logf(v); }
TM_HOST_DEVICE double log_(double v) { return ::log(v); }
// Returns b when either is NaN, like x86 MAXPS with b second: NaN inputs stay NaN.
TM_HOST_DEVICE float max_(float a, float b) { return a > b ? a : b; }
TM_HOST_DEVICE double max_(double a, double b) { return a > b ? a : b; }
// a * b + c. Written plainly: nvcc contracts it into one FMA (-fmad=true), and
// the host's scalar path may run where there is no FMA unit (std::fma is then
// a library call). The AVX2 vector overload is an explicit FMA.
TM_HOST_DEVICE float fma_(float a, float b, float c) { return a * b + c; }
TM_HOST_DEVICE double fma_(double a, double b, double c) { return a * b + c; }

template <typename acc_t>
TM_HOST_DEVICE acc_t lowest_finite() { return -std::numeric_limits<acc_t>::max(); }

template <typename acc_t>
TM_HOST_DEVICE OnlineSoftmax<acc_t> empty_state() {
  return {-std::numeric_limits<acc_t>::infinity(), acc_t(0), acc_t(0)};
}

// The shift that exponentials of a block are taken against: its max, or 0 when
// the block holds only -inf (exp(-inf - 0) = 0, while exp(-inf - -inf) = NaN).
// NaN logits stay NaN through exp whatever the shift.
template <typename acc_t>
TM_HOST_DEVICE acc_t finite_shift(acc_t max) {
  return max == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : max;
}

// Every per-element term takes t = x / T - shift, the exponent of the element
// against a shift (a block's max for the state, lse for the gradient): one FMA
// of the raw logit. e = exp(t) is the element's weight.
template <typename V>
TM_HOST_DEVICE V shifted(V x, V inv_temperature, V neg_shift) { return fma_(x, inv_temperature, neg_shift); }

// zsum plus one element's contribution t e (one FMA). A -inf logit has e = 0;
// clamping its t to the lowest finite value keeps t e at 0, not NaN.
template <typename V, typename acc_t>
TM_HOST_DEVICE V add_entropy_term(V zsum, V t, V e) {
  return fma_(max_(V(lowest_finite<acc_t>()), t), e, zsum);
}

// Combine two states; exact for any split of a row (the order fixes rounding).
template <typename acc_t>
TM_HOST_DEVICE OnlineSoftmax<acc_t> merge(const OnlineSoftmax<acc_t>& a,
                                          const OnlineSoftmax<acc_t>& b) {
  if (b.sum == acc_t(0)) return a;  // b saw only -inf: nothing to add
  if (a.sum == acc_t(0)) return b;
  const acc_t max = a.max > b.max ? a.max : b.max;
  const acc_t da = a.max - max, db = b.max - max;  // both <= 0
  const acc_t ea = exp_(da), eb = exp_(db);
  return {max, a.sum * ea + b.sum * eb,
          (a.zsum + da * a.sum) * ea + (b.zsum + db * b.sum) * eb};
}

template <typename acc_t>
TM_HOST_DEVICE RowStats<acc_t> finalize(const OnlineSoftmax<acc_t>& s) {
  const acc_t log_sum = log_(s.sum);
  const acc_t rel_mean = s.zsum / s.sum;  // E_p[z] - max, <= 0
  return {s.max + log_sum, s.max + rel_mean, log_sum - rel_mean};
}

// Gradient of g_logp * logp + g_H * entropy with respect to one logit x,
// given z = x / T, onehot (1 for the label, else 0) and the saved lse, mean.
template <typename V, typename acc_t>
TM_HOST_DEVICE V grad_logit(V z, V onehot, V lse, V mean, V g_logp, V g_entropy,
                            V inv_temperature) {
  const V p = exp_(z - lse);
  const V z_finite = max_(V(lowest_finite<acc_t>()), z);
  return inv_temperature * (g_logp * (onehot - p) - g_entropy * p * (z_finite - mean));
}

// Off the label (onehot = 0) grad_logit reads, in the raw logit x,
//   p * (a + b x),   p = exp(x / T - lse),
//   a = (g_entropy * mean - g_logp) / T,   b = -g_entropy / T^2:
// two FMAs per element besides the exp. In the linear term x is clamped from
// below at x_floor = (lse - exp_underflow) T, where p is already 0 in acc_t, so
// that b x stays finite at x = -inf: p * finite = 0, where 0 * inf is NaN.
template <typename acc_t>
struct OffLabelGrad {
  acc_t a;
  acc_t b;
  acc_t x_floor;
  acc_t neg_lse;
};

template <typename acc_t>
TM_HOST_DEVICE acc_t exp_underflow() { return sizeof(acc_t) == 4 ? acc_t(88) : acc_t(746); }

template <typename acc_t>
TM_HOST_DEVICE OffLabelGrad<acc_t> off_label_grad(acc_t lse, acc_t mean, acc_t g_logp, acc_t g_entropy,
                                                  acc_t inv_temperature) {
  return {(g_entropy * mean - g_logp) * inv_temperature, -g_entropy * inv_temperature * inv_temperature,
          (lse - exp_underflow<acc_t>()) / inv_temperature, -lse};
}

template <typename V>
TM_HOST_DEVICE V grad_off_label(V x, V inv_temperature, V neg_lse, V a, V b, V x_floor) {
  return exp_(shifted(x, inv_temperature, neg_lse)) * fma_(b, max_(x_floor, x), a);
}

// Label classification shared by every kernel.
// A row is ignored when its label equals ignore_index; otherwise its target
// lies on this vocab shard when vocab_start <= label < vocab_start + V.
TM_HOST_DEVICE bool is_ignored(int64_t label, int64_t ignore_index) {
  return label == ignore_index;
}
TM_HOST_DEVICE int64_t local_target(int64_t label, int64_t vocab_start, int64_t V) {
  const int64_t local = label - vocab_start;
  return (local >= 0 && local < V) ? local : -1;
}

}  // namespace TWINKLE_MEM_ISA
}  // namespace twinkle_mem
