// The math of selective log-softmax and entropy, written once for every backend.
//
// For one row of logits x (length V), temperature T and labels y_1..y_k:
//   shift   = max_v x_v                      (in logit units; 0 when every x is -inf)
//   t_v     = (x_v - shift) / T              (<= 0: the exponent against the shift)
//   log_sum = log sum_v exp(t_v)
//   u_v     = t_v - log_sum = log p_v
//   logp_j  = u_{y_j}
//   entropy = -sum_v p_v u_v = log_sum - sum_v p_v t_v
// and the gradient of  sum_j g_j logp_j + g_H entropy  with respect to x_v:
//   d_v = [sum_{j: y_j = v} g_j - G p_v - g_H p_v (u_v + entropy)] / T,   G = sum_j g_j
// (u_v + entropy = z_v - E_p[z] with z = x / T, here without the cancellation
// of two large numbers).
//
// Precision: every quantity is a difference against the row's own shift, never
// against a rounded lse = shift / T + log_sum (whose fp32 ulp is 1e-3 at 1e4):
// the forward keeps shift and log_sum apart and the backward recomputes
// u = (x - shift) / T - log_sum with one rounding after the subtraction. x - shift
// cannot overflow for finite rows, so finfo.min masks at any temperature and
// logits near a dtype's limits stay finite.
//
// The functions are templates over the value type so that the same lines serve
// a scalar (float, double), a SIMD register (the CPU kernel's Vec8f) and a CUDA
// thread. A vector type provides +, -, * and the free functions exp_(V),
// max_(V, V) (NaN-propagating in its second argument) and fma_(V, V, V).
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

// Running statistics of a stream of logits x against its running max:
//   max  = max x,
//   rest = sum exp(t) over every element but one that holds the max (so that
//          sum exp(t) = 1 + rest; log_sum = log1p(rest) keeps a confident row's
//          1 - p_max = rest / (1 + rest) exact where 1 + rest rounds to 1),
//   zsum = sum t exp(t)   (the max's term is 0),   t = (x - max) / T.
// The empty state (no element, or only -inf) is {-inf, -1, 0}: a sum of 0.
template <typename acc_t>
struct OnlineSoftmax {
  acc_t max;
  acc_t rest;
  acc_t zsum;
};

// Per-row results from a complete state (the forward's outputs besides logp).
template <typename acc_t>
struct RowStats {
  acc_t shift;    // max x (0 for a row of only -inf)
  acc_t log_sum;  // log sum exp((x - shift) / T)
  acc_t entropy;  // log_sum - E_p[t]
};

// Per-row constants of the backward (see row_grad() below).
template <typename acc_t>
struct RowGrad {
  acc_t neg_shift;
  acc_t neg_log_sum;
  acc_t inv_temperature;
  acc_t entropy;
  acc_t a;  // -G / T
  acc_t b;  // -g_H / T
  acc_t u_floor;
};

inline namespace TWINKLE_MEM_ISA {

// Scalar primitives; vector types provide their own overloads.
TM_HOST_DEVICE float exp_(float v) { return ::expf(v); }
TM_HOST_DEVICE double exp_(double v) { return ::exp(v); }
TM_HOST_DEVICE float exp2_(float v) { return ::exp2f(v); }
TM_HOST_DEVICE double exp2_(double v) { return ::exp2(v); }
TM_HOST_DEVICE float expm1_(float v) { return ::expm1f(v); }
TM_HOST_DEVICE double expm1_(double v) { return ::expm1(v); }
TM_HOST_DEVICE float log1p_(float v) { return ::log1pf(v); }
TM_HOST_DEVICE double log1p_(double v) { return ::log1p(v); }
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
  return {-std::numeric_limits<acc_t>::infinity(), acc_t(-1), acc_t(0)};
}

// A block's state from its max and the sums of exp(t) and t exp(t) over all
// its elements except one that holds the max (a kernel leaves that one out,
// e.g. by treating it as -inf), t taken against finite_shift(max).
// A block whose max is -inf has no max element: it is empty, its sums are
// exp(-inf) = 0 ... unless it holds a NaN that the max did not see. A max can
// miss one: x86 MAXPS keeps a NaN of its second operand only (a running max
// drops it at the next element), the CPU's integer keys of 16-bit logits put a
// NaN with the sign set below -inf, and a vector unit's reduction (AscendC's
// ReduceMax) may skip it. Its exp(NaN - 0) still reaches the sum: a NaN sum
// makes the block NaN, never empty (a NaN among -inf gives NaN, as torch does).
template <typename acc_t>
TM_HOST_DEVICE OnlineSoftmax<acc_t> block_state(acc_t max, acc_t sum_but_max, acc_t zsum) {
  if (!(max == -std::numeric_limits<acc_t>::infinity())) return {max, sum_but_max, zsum};
  if (sum_but_max == sum_but_max) return empty_state<acc_t>();
  return {sum_but_max, sum_but_max, sum_but_max};  // NaN
}

// The shift that exponentials of a block are taken against: its max, or 0 when
// the block holds only -inf (exp(-inf - 0) = 0, while exp(-inf - -inf) = NaN).
// NaN logits stay NaN through exp whatever the shift.
template <typename acc_t>
TM_HOST_DEVICE acc_t finite_shift(acc_t max) {
  return max == -std::numeric_limits<acc_t>::infinity() ? acc_t(0) : max;
}

// t = (x - shift) / T: the exponent of one element against a shift. The
// subtraction is exact or nearly so for the elements that carry weight
// (Sterbenz), the product rounds once: t is accurate relative to itself.
template <typename V>
TM_HOST_DEVICE V scaled_gap(V x, V neg_shift, V inv_temperature) { return (x + neg_shift) * inv_temperature; }

// zsum plus one element's contribution t e (one FMA). A -inf logit has e = 0;
// clamping its t to the lowest finite value keeps t e at 0, not NaN.
template <typename V, typename acc_t>
TM_HOST_DEVICE V add_entropy_term(V zsum, V t, V e) {
  return fma_(max_(V(lowest_finite<acc_t>()), t), e, zsum);
}

// Combine two states; exact for any split of a row (the order fixes rounding).
// The state with the larger max keeps its max element (a on ties); the other's
// whole sum (1 + rest) joins the rest, scaled by exp(gap), gap = (max' - max) / T.
// A state far below the other (a block of finfo.min masks) has weight
// exp(gap) = 0; its gap is clamped so that gap * sum stays finite and the
// weighted term is 0, not -inf * 0 = NaN.
template <typename acc_t>
TM_HOST_DEVICE OnlineSoftmax<acc_t> merge(const OnlineSoftmax<acc_t>& a, const OnlineSoftmax<acc_t>& b,
                                          acc_t inv_temperature) {
  if (b.rest == acc_t(-1)) return a;  // b saw only -inf: nothing to add
  if (a.rest == acc_t(-1)) return b;
  const bool a_top = !(b.max > a.max);  // NaN maxes reach the sums through the gap either way
  const OnlineSoftmax<acc_t>& top = a_top ? a : b;
  const OnlineSoftmax<acc_t>& low = a_top ? b : a;
  const acc_t kFarBelow = acc_t(-1e30);  // exp() of it is 0; times any sum (< 2^63) still finite
  const acc_t gap = max_(kFarBelow, (low.max - top.max) * inv_temperature);  // <= 0
  const acc_t scale = exp_(gap);
  const acc_t weight = fma_(low.rest, scale, scale);  // (1 + low.rest) exp(gap)
  // low's terms re-based to top's max: t + gap, so sum (t + gap) e exp(gap) = zsum exp(gap) + gap weight.
  return {top.max, top.rest + weight, top.zsum + fma_(gap, weight, low.zsum * scale)};
}

template <typename acc_t>
TM_HOST_DEVICE RowStats<acc_t> finalize(const OnlineSoftmax<acc_t>& s) {
  const acc_t log_sum = log1p_(s.rest);
  const acc_t mean_t = s.zsum / (acc_t(1) + s.rest);  // E_p[t] <= 0
  return {finite_shift(s.max), log_sum, log_sum - mean_t};
}

// The (shift, log_sum) a forward returns, from a row's finished statistics in a
// wider type: shift moved to the row's log-normalizer in logit units
// (shift + T log_sum, rounded to out_t), log_sum the small remainder against it.
// Any shift is exact for the math; this one keeps the rounding of log_sum, which
// every u = (x - shift) / T - log_sum of the row would share, out of the backward:
// each u then carries only its own rounding. A row without a finite normalizer
// (only -inf, or NaN) keeps its own.
template <typename out_t, typename wide_t>
TM_HOST_DEVICE void output_shift(const RowStats<wide_t>& s, wide_t inv_temperature, out_t& shift, out_t& log_sum) {
  const wide_t lse_x = s.shift + s.log_sum / inv_temperature;
  const out_t rebased = static_cast<out_t>(lse_x);
  if (!(lse_x - lse_x == wide_t(0)) || !(rebased - rebased == out_t(0))) {  // not finite
    shift = static_cast<out_t>(s.shift);
    log_sum = static_cast<out_t>(s.log_sum);
    return;
  }
  shift = rebased;
  log_sum = static_cast<out_t>(fma_(s.shift - static_cast<wide_t>(rebased), inv_temperature, s.log_sum));
}

// log p of one logit: (x - shift) / T - log_sum.
template <typename acc_t>
TM_HOST_DEVICE acc_t log_prob(acc_t x, acc_t shift, acc_t log_sum, acc_t inv_temperature) {
  return fma_(x - shift, inv_temperature, -log_sum);
}

// ----------------------------------------------------------------- backward
// Per row: with u = log p, p = exp(u) and w = u + entropy (= z - E_p[z], formed
// from two small numbers: no cancellation of x / T against a large mean), every
// logit's gradient is
//   p (a + b w)                                   off the labels,
//   p (a_here + b w) - (g_here / T) expm1(u)      at a position holding labels whose
//                                                 upstream gradients sum to g_here,
// a = -G / T, a_here = -g_other / T with g_other = G - g_here (exactly 0 for a
// single label), b = -g_H / T. The label form writes g_here (1 - p) as
// -g_here expm1(u): exact where p is close to 1 (a confident model's label),
// where 1 - p would cancel. In the linear term u is clamped from below at
// u_floor, where p is already 0 in acc_t, so that b w stays finite at x = -inf:
// p * finite = 0, where 0 * inf is NaN.
template <typename acc_t>
TM_HOST_DEVICE acc_t exp_underflow() { return sizeof(acc_t) == 4 ? acc_t(-150) : acc_t(-1100); }

// g_total = the sum of the row's non-ignored upstream logp gradients (labels on
// other vocab shards included: their logp depends on this shard through log_sum).
template <typename acc_t>
TM_HOST_DEVICE RowGrad<acc_t> row_grad(acc_t shift, acc_t log_sum, acc_t entropy, acc_t g_total, acc_t g_entropy,
                                       acc_t inv_temperature) {
  return {-shift, -log_sum, inv_temperature, entropy, -g_total * inv_temperature, -g_entropy * inv_temperature,
          exp_underflow<acc_t>()};
}

// u = log p = (x - shift) / T - log_sum, one rounding after the subtraction.
template <typename V>
TM_HOST_DEVICE V log_p(V x, V neg_shift, V inv_temperature, V neg_log_sum) {
  return fma_(x + neg_shift, inv_temperature, neg_log_sum);
}

template <typename V>
TM_HOST_DEVICE V grad_off_label(V x, V neg_shift, V inv_temperature, V neg_log_sum, V entropy, V a, V b,
                                V u_floor) {
  const V u = log_p(x, neg_shift, inv_temperature, neg_log_sum);
  return exp_(u) * fma_(b, max_(u_floor, u) + entropy, a);
}

template <typename acc_t>
TM_HOST_DEVICE acc_t grad_off_label(acc_t x, const RowGrad<acc_t>& g) {
  return grad_off_label(x, g.neg_shift, g.inv_temperature, g.neg_log_sum, g.entropy, g.a, g.b, g.u_floor);
}

// The gradient at a position holding labels whose upstream gradients sum to
// g_here; g_other is the rest of the row's total (G - g_here; 0 for one label).
template <typename acc_t>
TM_HOST_DEVICE acc_t grad_at_label(acc_t x, const RowGrad<acc_t>& g, acc_t g_here, acc_t g_other) {
  const acc_t u = log_p(x, g.neg_shift, g.inv_temperature, g.neg_log_sum);
  const acc_t g_here_scaled = g_here * g.inv_temperature;
  return fma_(exp_(u), fma_(g.b, max_(g.u_floor, u) + g.entropy, -g_other * g.inv_temperature),
              -g_here_scaled * expm1_(u));
}

// ----------------------------------------------------------- base 2
// exp(t) = 2^y with y = t log2(e): an exponential in base 2 needs no reduction
// by ln2, so a kernel folds log2(e) into its scale 1 / T and pays one exp2 per
// element. scale(): the acc_t 1 / T times log2(e) in double, rounded to acc_t
// (within two roundings of the true scale: 1.2e-7 relative in fp32, so y is
// as accurate relative to itself as t). y_floor(): where 2^y is 0 in acc_t.
struct Base2 {
  static constexpr double kLog2e = 1.4426950408889634;
  static constexpr double kLn2 = 0.6931471805599453;
  template <typename acc_t>
  static TM_HOST_DEVICE acc_t scale(acc_t inv_temperature) {
    return static_cast<acc_t>(static_cast<double>(inv_temperature) * kLog2e);
  }
  template <typename acc_t>
  static TM_HOST_DEVICE acc_t y_floor() { return sizeof(acc_t) == 4 ? acc_t(-160) : acc_t(-1100); }
};

// The off-label gradient p (a + b w) of a row in base 2, for 16-bit gradients:
// p = 2^y, y = (x - shift) log2(e) / T - log_sum log2(e), w = u + entropy with
// u = y ln2; y clamped from below at Base2::y_floor() (a -inf logit: p = 0 and
// w finite, as u_floor does). Its p is within ~1e-6 relative (log_sum log2(e)
// rounded to acc_t), far below a bf16 or fp16 ulp; an fp32 gradient keeps
// grad_off_label(), whose 2 ulp this form would not hold. (The CPU kernel's
// 16-bit paths compute the same form with their own exp2.)
// The exponent may be carried in units of `unit` (a power of two: exact), for
// an exp2 that takes y * unit (the CUDA kernels' 2^(y / 2), squared).
template <typename acc_t>
struct RowGradBase2 {
  acc_t neg_shift;
  acc_t scale;    // log2(e) / T * unit
  acc_t offset;   // -log_sum log2(e) * unit
  acc_t ln2;      // ln 2 / unit
  acc_t entropy;
  acc_t a;
  acc_t b;
  acc_t y_floor;  // Base2::y_floor() * unit
};

template <typename acc_t>
TM_HOST_DEVICE RowGradBase2<acc_t> row_grad_base2(const RowGrad<acc_t>& g, acc_t unit = acc_t(1)) {
  return {g.neg_shift,
          Base2::scale(g.inv_temperature) * unit,
          static_cast<acc_t>(static_cast<double>(g.neg_log_sum) * Base2::kLog2e) * unit,
          static_cast<acc_t>(Base2::kLn2) / unit,
          g.entropy,
          g.a,
          g.b,
          Base2::y_floor<acc_t>() * unit};
}

// exp2(y * unit) = 2^y.
template <typename acc_t, typename Exp2>
TM_HOST_DEVICE acc_t grad_off_label_base2(acc_t x, const RowGradBase2<acc_t>& g, Exp2&& exp2) {
  const acc_t y = max_(g.y_floor, fma_(x + g.neg_shift, g.scale, g.offset));  // y * unit
  return exp2(y) * fma_(g.b, fma_(y, g.ln2, g.entropy), g.a);
}

// Label classification shared by every kernel.
// An entry is ignored when its label equals ignore_index; otherwise its target
// lies on this vocab shard when vocab_start <= label < vocab_start + V.
TM_HOST_DEVICE bool is_ignored(int64_t label, int64_t ignore_index) {
  return label == ignore_index;
}
TM_HOST_DEVICE int64_t local_target(int64_t label, int64_t vocab_start, int64_t V) {
  const int64_t local = label - vocab_start;
  return (local >= 0 && local < V) ? local : -1;
}

// In range: ignore_index, or within [0, vocab_size). An out-of-range label is an
// error; each backend reports it (op_checks.h's fail_label_out_of_range on the
// host, a device-side assert on CUDA).
TM_HOST_DEVICE bool label_in_range(int64_t label, int64_t ignore_index, int64_t vocab_size) {
  return label == ignore_index || (label >= 0 && label < vocab_size);
}

// A row is skipped (every output 0, gradient 0, logits unread) when it has
// labels and all of them are ignore_index. L: layout.h's Labels.
template <typename L>
TM_HOST_DEVICE bool row_skipped(const L& labels, int64_t row, int64_t ignore_index) {
  if (labels.k() == 0) return false;
  for (int64_t j = 0; j < labels.k(); ++j) {
    if (!is_ignored(labels(row, j), ignore_index)) return false;
  }
  return true;
}

}  // namespace TWINKLE_MEM_ISA
}  // namespace twinkle_mem
