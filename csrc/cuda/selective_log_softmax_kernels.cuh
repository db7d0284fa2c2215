// CUDA kernels of the selective log-softmax op (forward, backward, in-place
// backward): device code only. The host plan (selective_log_softmax_plan.cuh)
// launches them; the stable-ABI glue (selective_log_softmax.cu) registers the
// op for the CUDA dispatch key. The math (online state, merge, finalize,
// gradient, label classification) is csrc/common/online_softmax.h, the row and
// label indexing csrc/common/layout.h: nothing of either is written here but
// how a thread streams its elements into a state (RunningSums: the sums in base
// 2 against a running max, re-based as merge() does).
//
// Work decomposition, forward and backward alike:
//   segment = a fixed run of kSegmentBytes of one row (the last one shorter):
//             the cut depends on V and the dtype only, never on N.
//   task    = one segment of one row; a block runs one task at a time and loops
//             over tasks (grid-stride), so any N fits in the grid. The block size
//             too depends on V and the dtype only.
//   slot    = W = 16 / sizeof(scalar_t) consecutive elements of a segment. Slot s
//             of a segment belongs to thread s % threads and is processed in chunks
//             of kUnroll slots; the last V % W elements of the segment go one per
//             thread. This assignment is by element index: a row's reduction is
//             the same whatever its address. A slot is moved with one 16-byte
//             vector when its segment is 16-byte aligned, else element by element.
// Forward: each task reduces its segment to one online state (each thread's
// RunningSums, then warp and block, merge() in a fixed tree) and writes it to a
// workspace; a second kernel, one thread per row, merges the row's states in
// segment order and finishes the row. So a row's results are bitwise the same
// whatever N, the other rows, the grid size or the row's alignment.
// Backward: each task writes grad_off_label, p (a + b (u + entropy)) (its base-2
// form for 16-bit gradients), over its segment (read first: the in-place variant
// is safe), then rewrites the label positions in it with grad_at_label (repeated
// labels summed).
//
// Out-of-range labels (neither ignore_index nor in [0, vocab_size)) are never used
// as an index. The forward checks them on the device, as PyTorch's own nll_loss
// does: a device-side assert, no host synchronization (see docs/cuda.md).
#pragma once

#include "../common/label_message.h"
#include "../common/layout.h"
#include "../common/online_softmax.h"

// The one hook for the CPU emulation of these kernels (standins/cuda/):
// it defines TWINKLE_MEM_CUDA_EMULATION and includes its stand-in of the CUDA
// device API (fake_cuda.h) before this file, in place of these headers.
#ifndef TWINKLE_MEM_CUDA_EMULATION
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <torch/headeronly/macros/Macros.h>  // CUDA_KERNEL_ASSERT_MSG
#endif

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace twinkle_mem {
namespace cuda {

constexpr int kMaxThreads = 64;              // threads per block of a task (a multiple of 32)
constexpr int kRowThreads = 256;             // threads per block of finish_rows_kernel (one per row)
constexpr int kUnroll = 4;                   // slots per thread per chunk of the forward: 64 bytes in flight
constexpr int kGradUnroll = 8;               // slots per thread per step of the backward: 128 bytes in flight
constexpr int64_t kSegmentBytes = 64 << 10;  // logits per task: 32768 bf16, 16384 fp32

// ------------------------------------------------------------ element types
template <typename scalar_t>
struct Elem {
  using acc_t = float;
  static constexpr int W = 16 / sizeof(scalar_t);  // elements per slot (one 16-byte vector)
};
template <>
struct Elem<double> {
  using acc_t = double;
  static constexpr int W = 2;
};
template <typename scalar_t>
using acc_of = typename Elem<scalar_t>::acc_t;

// A state in double, for the few merges that finish a row.
template <typename acc_t>
__host__ __device__ __forceinline__ OnlineSoftmax<double> widen(const OnlineSoftmax<acc_t>& s) {
  return {static_cast<double>(s.max), static_cast<double>(s.rest), static_cast<double>(s.zsum)};
}

__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename scalar_t>
__device__ __forceinline__ scalar_t from_acc(acc_of<scalar_t> v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <>
__device__ __forceinline__ double from_acc<double>(double v) { return v; }

// 16 bytes of scalar_t <-> W accumulator values.
template <typename scalar_t>
__device__ __forceinline__ void unpack(const uint4& raw, acc_of<scalar_t> (&v)[Elem<scalar_t>::W]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (std::is_same_v<scalar_t, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // a bf16 is the high half of an fp32
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else if constexpr (std::is_same_v<scalar_t, __half>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
      v[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  } else if constexpr (std::is_same_v<scalar_t, float>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(w[i]);
  } else {
    v[0] = __hiloint2double(static_cast<int>(w[1]), static_cast<int>(w[0]));
    v[1] = __hiloint2double(static_cast<int>(w[3]), static_cast<int>(w[2]));
  }
}

template <typename scalar_t>
__device__ __forceinline__ uint4 pack(const acc_of<scalar_t> (&v)[Elem<scalar_t>::W]) {
  uint32_t w[4];
  if constexpr (std::is_same_v<scalar_t, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);  // .x is the low half
      w[i] = static_cast<uint32_t>(__bfloat16_as_ushort(h.x)) |
             (static_cast<uint32_t>(__bfloat16_as_ushort(h.y)) << 16);
    }
  } else if constexpr (std::is_same_v<scalar_t, __half>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 h = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
      w[i] = static_cast<uint32_t>(__half_as_ushort(h.x)) | (static_cast<uint32_t>(__half_as_ushort(h.y)) << 16);
    }
  } else if constexpr (std::is_same_v<scalar_t, float>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(v[i]);
  } else {
    w[0] = static_cast<uint32_t>(__double2loint(v[0]));
    w[1] = static_cast<uint32_t>(__double2hiint(v[0]));
    w[2] = static_cast<uint32_t>(__double2loint(v[1]));
    w[3] = static_cast<uint32_t>(__double2hiint(v[1]));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// A slot of -inf: what the forward reads in place of a slot past the end.
template <typename scalar_t>
__device__ __forceinline__ uint4 neg_inf_slot() {
  if constexpr (std::is_same_v<scalar_t, __nv_bfloat16>) {
    return make_uint4(0xff80ff80u, 0xff80ff80u, 0xff80ff80u, 0xff80ff80u);
  } else if constexpr (std::is_same_v<scalar_t, __half>) {
    return make_uint4(0xfc00fc00u, 0xfc00fc00u, 0xfc00fc00u, 0xfc00fc00u);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    return make_uint4(0xff800000u, 0xff800000u, 0xff800000u, 0xff800000u);
  } else {
    return make_uint4(0u, 0xfff00000u, 0u, 0xfff00000u);
  }
}

// Moving a slot: one 16-byte vector (kVector, the address 16-byte aligned), or
// W element loads/stores of the same bits (any element-aligned address).
// Streaming cache hints: each logit is touched once per pass.
template <int kBytes>
struct Bits;
template <>
struct Bits<2> { using type = unsigned short; };
template <>
struct Bits<4> { using type = unsigned int; };
template <>
struct Bits<8> { using type = unsigned long long; };

template <typename scalar_t, bool kVector>
__device__ __forceinline__ uint4 load_slot(const scalar_t* p) {
  if constexpr (kVector) {
    return __ldcs(reinterpret_cast<const uint4*>(p));
  } else {
    using bits_t = typename Bits<sizeof(scalar_t)>::type;
    bits_t b[Elem<scalar_t>::W];
#pragma unroll
    for (int k = 0; k < Elem<scalar_t>::W; ++k) b[k] = __ldcs(reinterpret_cast<const bits_t*>(p) + k);
    uint4 raw;
    memcpy(&raw, b, sizeof(raw));
    return raw;
  }
}

template <typename scalar_t, bool kVector>
__device__ __forceinline__ void store_slot(scalar_t* p, const uint4& raw) {
  if constexpr (kVector) {
    __stcs(reinterpret_cast<uint4*>(p), raw);
  } else {
    using bits_t = typename Bits<sizeof(scalar_t)>::type;
    bits_t b[Elem<scalar_t>::W];
    memcpy(b, &raw, sizeof(raw));
#pragma unroll
    for (int k = 0; k < Elem<scalar_t>::W; ++k) __stcs(reinterpret_cast<bits_t*>(p) + k, b[k]);
  }
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Max that propagates NaN (a chunk holding a NaN then has a NaN state, even
// when all its other elements are -inf).
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? a + b : fmaxf(a, b);
#endif
}
__device__ __forceinline__ double max_nan(double a, double b) { return (a != a || b != b) ? a + b : fmax(a, b); }

// 2^y in one MUFU.EX2 (ex2.approx.ftz: within 2 ulp, the error CUDA gives for
// exp2f, which is this instruction plus the scaling that keeps its subnormal
// results; here they are flushed to 0). Off the device (the CPU emulation) the
// host's exp2f times 1 + 2^-22, 2 to 4 ulp too large, flushed alike: the
// emulated kernels carry at least the device's worst error, not libm's.
__device__ __forceinline__ float ex2_approx_ftz(float y) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
#else
  const float r = ::exp2f(y) * (1.0f + 0x1p-22f);
  return r < std::numeric_limits<float>::min() ? 0.0f : r;
#endif
}

// 2^y, y <= 0, as the kernels take it. 16-bit logits: from y / 2, one
// MUFU.EX2 squared, two instructions where exp2f takes five. The square keeps a
// subnormal 2^y (y >= -149: y / 2 >= -75 is far from MUFU.EX2's flushed range),
// so a confident row's rest and a gradient of e^-100 keep theirs; its error is
// twice MUFU.EX2's, 4.5 ulp: within the 1e-6 bound of logp and far below the
// ulp of a 16-bit gradient. Wider logits: exp2_ (exp2f, 2 ulp), as fp32
// gradients need. The kernels carry their exponents in units of `unit` (their
// scales multiplied by it: exact) and call exp2(y * unit).
template <typename scalar_t>
struct Exp2 {
  using acc_t = acc_of<scalar_t>;
  static constexpr bool kFromHalf = sizeof(scalar_t) == 2;
  static constexpr acc_t unit = kFromHalf ? acc_t(0.5) : acc_t(1);
  __device__ __forceinline__ acc_t operator()(acc_t y_in_units) const {
    if constexpr (kFromHalf) {
      const float h = ex2_approx_ftz(y_in_units);
      return h * h;
    } else {
      return exp2_(y_in_units);
    }
  }
};

// -------------------------------------------------------------------- labels
// online_softmax.h's row_skipped, by the whole block (layout.h's Labels): the
// threads share out the labels. Block-uniform: every thread calls it.
template <typename label_t>
__device__ __forceinline__ bool block_row_skipped(const Labels<label_t>& labels, int64_t row, int64_t ignore_index) {
  if (labels.k() == 0) return false;
  int kept = 0;
  for (int64_t j = threadIdx.x; j < labels.k(); j += blockDim.x) kept |= !is_ignored(labels(row, j), ignore_index);
  return !__syncthreads_or(kept);
}

// ---------------------------------------------------------------- reductions
template <typename acc_t>
__device__ __forceinline__ OnlineSoftmax<acc_t> warp_merge(OnlineSoftmax<acc_t> s, acc_t inv_T) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const OnlineSoftmax<acc_t> other{__shfl_down_sync(0xffffffffu, s.max, offset),
                                     __shfl_down_sync(0xffffffffu, s.rest, offset),
                                     __shfl_down_sync(0xffffffffu, s.zsum, offset)};
    s = merge(s, other, inv_T);  // lane i merges lane i + offset: lane 0 ends with lanes 0..31 in a fixed tree
  }
  return s;
}

// The block's state, valid in thread 0. `smem` holds kMaxThreads / 32 states.
template <typename acc_t>
__device__ __forceinline__ OnlineSoftmax<acc_t> block_merge(OnlineSoftmax<acc_t> s, OnlineSoftmax<acc_t>* smem,
                                                            acc_t inv_T) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  s = warp_merge(s, inv_T);
  if (lane == 0) smem[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < static_cast<int>(blockDim.x / 32) ? smem[lane] : empty_state<acc_t>();
    s = warp_merge(s, inv_T);
  }
  __syncthreads();  // smem is reused by the block's next task
  return s;
}

// Sum over the block in a fixed tree, valid in every thread.
template <typename acc_t>
__device__ __forceinline__ acc_t block_sum(acc_t v, acc_t* smem) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  acc_t total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += smem[w];
  __syncthreads();
  return total;
}

// ------------------------------------------------------------------ forward
template <typename scalar_t, typename label_t>
struct ForwardArgs {
  using acc_t = acc_of<scalar_t>;
  const scalar_t* logits;
  RowIndex row_at;
  int64_t rows;
  int64_t vocab;  // V, this shard's width
  int64_t segments;
  int64_t segment_len;
  Labels<label_t> labels;
  acc_t inv_T;
  acc_t scale;  // Base2::scale(inv_T): log2(e) / T
  int64_t ignore_index;
  int64_t vocab_start;
  int64_t vocab_size;
  acc_t* logp;     // [rows * k]
  acc_t* entropy;  // [rows], null unless with_entropy
  acc_t* shift;    // [rows]
  acc_t* log_sum;  // [rows]
  OnlineSoftmax<acc_t>* partial;  // [rows * segments]
};

// Max of a chunk of raw slots (packed bf16x2 / half2 max for 16-bit types).
template <typename scalar_t, int U>
__device__ __forceinline__ acc_of<scalar_t> chunk_max(const uint4 (&raw)[U]) {
  if constexpr (std::is_same_v<scalar_t, __nv_bfloat16> || std::is_same_v<scalar_t, __half>) {
    using pair_t = std::conditional_t<std::is_same_v<scalar_t, __half>, __half2, __nv_bfloat162>;
    auto as_pair = [](uint32_t w) {
      pair_t p;
      memcpy(&p, &w, sizeof(p));
      return p;
    };
    pair_t m = as_pair(raw[0].x);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u > 0) m = __hmax2_nan(m, as_pair(raw[u].x));
      m = __hmax2_nan(m, as_pair(raw[u].y));
      m = __hmax2_nan(m, as_pair(raw[u].z));
      m = __hmax2_nan(m, as_pair(raw[u].w));
    }
    return max_nan(to_acc(m.x), to_acc(m.y));
  } else {
    using acc_t = acc_of<scalar_t>;
    constexpr int W = Elem<scalar_t>::W;
    acc_t x[W];
    acc_t m = -std::numeric_limits<acc_t>::infinity();
#pragma unroll
    for (int u = 0; u < U; ++u) {
      unpack<scalar_t>(raw[u], x);
#pragma unroll
      for (int k = 0; k < W; ++k) m = max_nan(m, x[k]);
    }
    return m;
  }
}

// A thread's share of a segment, summed as it streams in against the largest
// element so far, in base 2 (online_softmax.h's Base2):
//   y      = (x - max) log2(e) / T, so that exp(t) = 2^y;
//   below  = sum 2^y over the elements below max;
//   at_max = how many elements equal max (2^0 = 1 each, counted apart from the
//            sum: a confident row's rest, all but one max, stays exact);
//   zsum   = sum y 2^y (base 2; an element at the max adds 0).
// state() is the online state of the elements seen (online_softmax.h's
// block_state: rest = below + at_max - 1). Each 2^y keeps its subnormal values
// (no -ftz, docs/cuda.md): they are terms of a confident row's rest.
template <typename scalar_t>
struct RunningSums {
  using acc_t = acc_of<scalar_t>;
  acc_t max = -std::numeric_limits<acc_t>::infinity();
  acc_t below = 0;
  acc_t at_max = 0;
  acc_t zsum = 0;

  // Re-bases the sums to new_max >= max. A larger one (not NaN): every element
  // so far is below it now, its weight 2^gap with gap = (max - new_max) log2(e) / T,
  // and its y moves by gap (merge()'s algebra). A max far below (-inf, finfo.min
  // at a low temperature) has weight 0; its gap is clamped so that
  // gap (below + at_max) stays finite, as in merge(). Branch-free (gap 0, weight
  // 1 where the max stays): a branch diverges in most warps at most chunks anyway.
  __device__ __forceinline__ void rebase(acc_t new_max, acc_t scale) {
    const bool raised = new_max > max;
    const acc_t gap = raised ? max_(acc_t(-1e30), (max - new_max) * scale) : acc_t(0);
    const acc_t weight = exp2_(gap);
    const acc_t all = below + at_max;
    zsum = weight * fma_(gap, all, zsum);
    below = raised ? all * weight : below;
    at_max = raised ? acc_t(0) : at_max;
    max = new_max;
  }

  // Adds `count` values whose max (NaN if any is NaN) is values_max: for_each(f)
  // calls f(x) on each. They are summed against the new max first, then added
  // once to the running sums (two levels: fewer roundings than one running sum).
  // Branch-free: below_max is 1 for an element below the max (or NaN), 0 at it;
  // the sum takes e times it, and the elements at the max are those not counted.
  // The exponent is carried in Exp2's units (y / 2 for 16-bit logits), zsum's
  // factor with it: scaled back once per call.
  template <bool kEntropy, typename ForEach>
  __device__ __forceinline__ void add(acc_t values_max, int count, acc_t scale, ForEach&& for_each) {
    constexpr Exp2<scalar_t> exp2;
    rebase(max_nan(max, values_max), scale);
    const acc_t neg_shift = -finite_shift(max);
    const acc_t scale_in_units = scale * exp2.unit;
    acc_t chunk_below = 0, chunk_below_count = 0, chunk_zsum = 0;
    for_each([&](acc_t x) {
      const acc_t y = scaled_gap(x, neg_shift, scale_in_units);  // y * unit
      const acc_t e = exp2(y);
      const acc_t below_max = y == acc_t(0) ? acc_t(0) : acc_t(1);
      chunk_below = fma_(e, below_max, chunk_below);
      chunk_below_count += below_max;
      if constexpr (kEntropy) chunk_zsum = add_entropy_term<acc_t, acc_t>(chunk_zsum, y, e);
    });
    below += chunk_below;
    at_max += acc_t(count) - chunk_below_count;
    if constexpr (kEntropy) zsum += chunk_zsum / exp2.unit;
  }

  __device__ __forceinline__ OnlineSoftmax<acc_t> state() const {
    return block_state(max, below + (at_max - acc_t(1)), zsum * static_cast<acc_t>(Base2::kLn2));
  }
};

// This thread's share of the online state of x[0, n): its slots in chunks of
// kUnroll (loaded first, then summed), the chunk's max from the raw slots.
template <typename scalar_t, bool kEntropy, bool kVector>
__device__ __forceinline__ OnlineSoftmax<acc_of<scalar_t>> thread_state(const scalar_t* __restrict__ x, int64_t n,
                                                                         acc_of<scalar_t> scale) {
  using acc_t = acc_of<scalar_t>;
  constexpr int W = Elem<scalar_t>::W;
  const int tid = threadIdx.x, threads = blockDim.x;
  const int64_t slots = n / W;
  RunningSums<scalar_t> sums;
  if (slots * W + tid < n) {  // one tail element
    const acc_t v = to_acc(x[slots * W + tid]);
    sums.template add<kEntropy>(v, 1, scale, [&](auto&& f) { f(v); });
  }
  auto add_chunk = [&](const uint4(&raw)[kUnroll]) {
    sums.template add<kEntropy>(chunk_max<scalar_t>(raw), kUnroll * W, scale, [&](auto&& f) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        acc_t v[W];
        unpack<scalar_t>(raw[u], v);
#pragma unroll
        for (int k = 0; k < W; ++k) f(v[k]);
      }
    });
  };
  const int64_t step = static_cast<int64_t>(kUnroll) * threads;
  int64_t base = tid;
  for (; base + (kUnroll - 1) * threads < slots; base += step) {  // full chunks: no bounds checks
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = load_slot<scalar_t, kVector>(x + (base + u * threads) * W);
    add_chunk(raw);
  }
  if (base < slots) {  // the last, partial chunk: slots past the end read as -inf
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t s = base + u * threads;
      raw[u] = s < slots ? load_slot<scalar_t, kVector>(x + s * W) : neg_inf_slot<scalar_t>();
    }
    add_chunk(raw);
  }
  return sums.state();
}

// One state per (row, segment) task.
template <typename scalar_t, typename label_t, bool kEntropy>
__global__ void __launch_bounds__(kMaxThreads) segment_state_kernel(const ForwardArgs<scalar_t, label_t> a) {
  using acc_t = acc_of<scalar_t>;
  __shared__ OnlineSoftmax<acc_t> smem[kMaxThreads / 32];
  const int64_t tasks = a.rows * a.segments;
  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int64_t row = task / a.segments, seg = task - row * a.segments;
    if (block_row_skipped(a.labels, row, a.ignore_index)) continue;  // the finish kernel writes its zeros
    const int64_t start = seg * a.segment_len;
    const int64_t len = min(a.segment_len, a.vocab - start);
    const scalar_t* x = a.logits + a.row_at(row) + start;
    OnlineSoftmax<acc_t> state = aligned16(x) ? thread_state<scalar_t, kEntropy, true>(x, len, a.scale)
                                              : thread_state<scalar_t, kEntropy, false>(x, len, a.scale);
    state = block_merge(state, smem, a.inv_T);
    if (threadIdx.x == 0) a.partial[task] = state;
  }
}

// A label neither ignore_index nor in [0, vocab_size): a device-side assert whose
// message is the host checks' (label_message.h), naming the label. It is written
// into global memory, not a local buffer (which would give finish_rows_kernel a
// stack frame), by the first thread to find a bad label; that thread asserts, the
// others go on (the assert ends the launch and the context anyway).
__device__ char g_label_message[Message::kCapacity];
__device__ unsigned g_label_message_taken;

__device__ __forceinline__ void assert_label_in_range(int64_t index, int64_t label, int64_t vocab_size,
                                                      int64_t ignore_index) {
  if (atomicCAS(&g_label_message_taken, 0u, 1u) != 0u) return;
  MessageWriter m{g_label_message, Message::kCapacity};
  m.add_label_out_of_range(index, label, vocab_size, ignore_index);
  CUDA_KERNEL_ASSERT_MSG(false, g_label_message);
}

// One thread per row: merge the row's segment states in order, finish the row,
// take logp at each label, check the labels.
template <typename scalar_t, typename label_t>
__global__ void __launch_bounds__(kRowThreads) finish_rows_kernel(const ForwardArgs<scalar_t, label_t> a) {
  using acc_t = acc_of<scalar_t>;
  const int64_t k = a.labels.k();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < a.rows; row += stride) {
    if (row_skipped(a.labels, row, a.ignore_index)) {
      for (int64_t j = 0; j < k; ++j) a.logp[row * k + j] = 0;
      a.shift[row] = a.log_sum[row] = 0;
      if (a.entropy != nullptr) a.entropy[row] = 0;
      continue;
    }
    // The row is finished in double (a few merges per row), rounded once, and
    // shift placed at the log-normalizer (output_shift), as the CPU kernel does.
    const OnlineSoftmax<acc_t>* partial = a.partial + row * a.segments;
    const double inv_T = static_cast<double>(a.inv_T);
    OnlineSoftmax<double> state = widen(partial[0]);
    for (int64_t seg = 1; seg < a.segments; ++seg) state = merge(state, widen(partial[seg]), inv_T);
    const RowStats<double> stats = finalize(state);
    output_shift(stats, inv_T, a.shift[row], a.log_sum[row]);
    if (a.entropy != nullptr) a.entropy[row] = static_cast<acc_t>(stats.entropy);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t y = a.labels(row, j);
      if (!label_in_range(y, a.ignore_index, a.vocab_size)) assert_label_in_range(row * k + j, y, a.vocab_size,
                                                                                 a.ignore_index);
      const int64_t target = is_ignored(y, a.ignore_index) ? -1 : local_target(y, a.vocab_start, a.vocab);
      a.logp[row * k + j] =
          target >= 0 ? static_cast<acc_t>(log_prob(static_cast<double>(to_acc(a.logits[a.row_at(row) + target])),
                                                    stats.shift, stats.log_sum, inv_T))
                      : acc_t(0);
    }
  }
}

// ----------------------------------------------------------------- backward
template <typename scalar_t, typename label_t>
struct BackwardArgs {
  using acc_t = acc_of<scalar_t>;
  const scalar_t* logits;
  RowIndex row_at;
  scalar_t* grad;  // may equal logits (in-place backward)
  RowIndex grad_row_at;
  int64_t rows;
  int64_t vocab;
  int64_t segments;
  int64_t segment_len;
  Labels<label_t> labels;
  const acc_t* grad_logp;     // [rows * k], contiguous
  const acc_t* grad_entropy;  // [rows], null: no entropy term
  const acc_t* entropy;       // [rows], null when grad_entropy is null
  const acc_t* shift;         // [rows]
  const acc_t* log_sum;       // [rows]
  acc_t inv_T;
  int64_t ignore_index;
  int64_t vocab_start;
  acc_t* label_x;  // [rows * k]: the logits at the labels, saved before an in-place pass; null out of place
};

// d[0, n) = 0 (a skipped row: its logits are not read).
template <typename scalar_t, bool kVector>
__device__ __forceinline__ void zero_segment(scalar_t* d, int64_t n) {
  constexpr int W = Elem<scalar_t>::W;
  const int64_t slots = n / W;
  if (slots * W + threadIdx.x < n) d[slots * W + threadIdx.x] = from_acc<scalar_t>(0);
  for (int64_t s = threadIdx.x; s < slots; s += blockDim.x) store_slot<scalar_t, kVector>(d + s * W, make_uint4(0, 0, 0, 0));
}

// d[0, n) = the off-label gradient of x[0, n): in base 2 for 16-bit gradients
// (online_softmax.h's grad_off_label_base2, with Exp2's 2^(y / 2) squared), as
// the contract writes it for fp32 and fp64 ones. d may alias x: each slot is
// read and written by the same thread, read first. kGradUnroll slots are loaded
// before any is written: 128 bytes in flight per thread.
template <typename scalar_t, bool kLoadVector, bool kStoreVector>
__device__ __forceinline__ void grad_segment(const scalar_t* x, scalar_t* d, int64_t n,
                                             const RowGrad<acc_of<scalar_t>>& g) {
  using acc_t = acc_of<scalar_t>;
  constexpr int W = Elem<scalar_t>::W;
  constexpr Exp2<scalar_t> exp2;
  const RowGradBase2<acc_t> g2 = row_grad_base2(g, exp2.unit);
  auto grad = [&](acc_t v) {
    if constexpr (sizeof(scalar_t) == 2) {
      return grad_off_label_base2(v, g2, exp2);
    } else {
      return grad_off_label(v, g);
    }
  };
  const int tid = threadIdx.x, threads = blockDim.x;
  const int64_t slots = n / W;
  if (slots * W + tid < n) d[slots * W + tid] = from_acc<scalar_t>(grad(to_acc(x[slots * W + tid])));
  const int64_t step = static_cast<int64_t>(kGradUnroll) * threads;
  for (int64_t base = tid; base < slots; base += step) {
    uint4 raw[kGradUnroll];
#pragma unroll
    for (int u = 0; u < kGradUnroll; ++u) {
      const int64_t s = base + u * threads;
      if (s < slots) raw[u] = load_slot<scalar_t, kLoadVector>(x + s * W);
    }
#pragma unroll
    for (int u = 0; u < kGradUnroll; ++u) {
      const int64_t s = base + u * threads;
      if (s < slots) {
        acc_t v[W];
        unpack<scalar_t>(raw[u], v);
#pragma unroll
        for (int k = 0; k < W; ++k) v[k] = grad(v[k]);
        store_slot<scalar_t, kStoreVector>(d + s * W, pack<scalar_t>(v));
      }
    }
  }
}

template <typename scalar_t, typename label_t>
__global__ void __launch_bounds__(kMaxThreads) backward_kernel(const BackwardArgs<scalar_t, label_t> a) {
  using acc_t = acc_of<scalar_t>;
  __shared__ acc_t smem[kMaxThreads / 32];
  const int64_t k = a.labels.k();
  const int64_t tasks = a.rows * a.segments;
  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int64_t row = task / a.segments, seg = task - row * a.segments;
    const int64_t start = seg * a.segment_len;
    const int64_t len = min(a.segment_len, a.vocab - start);
    const scalar_t* x = a.logits + a.row_at(row) + start;
    scalar_t* d = a.grad + a.grad_row_at(row) + start;
    if (block_row_skipped(a.labels, row, a.ignore_index)) {
      if (aligned16(d)) {
        zero_segment<scalar_t, true>(d, len);
      } else {
        zero_segment<scalar_t, false>(d, len);
      }
      continue;
    }
    // G: the row's non-ignored upstream logp gradients (labels on other shards included).
    acc_t g_mine = 0;
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
      if (!is_ignored(a.labels(row, j), a.ignore_index)) g_mine += a.grad_logp[row * k + j];
    }
    const acc_t g_total = block_sum(g_mine, smem);
    const bool with_entropy = a.grad_entropy != nullptr;
    const acc_t shift = a.shift[row], log_sum = a.log_sum[row];
    const acc_t entropy = with_entropy ? a.entropy[row] : acc_t(0);
    const acc_t g_entropy = with_entropy ? a.grad_entropy[row] : acc_t(0);
    const RowGrad<acc_t> rg = row_grad(shift, log_sum, entropy, g_total, g_entropy, a.inv_T);
    // Label positions in this segment: -1 when ignored or elsewhere.
    auto column = [&](int64_t y) {
      const int64_t target = is_ignored(y, a.ignore_index) ? -1 : local_target(y, a.vocab_start, a.vocab);
      return (target >= start && target < start + len) ? target - start : int64_t(-1);
    };
    if (a.label_x != nullptr) {  // in place: keep the logits at the labels before the pass overwrites them
      for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
        const int64_t col = column(a.labels(row, j));
        if (col >= 0) a.label_x[row * k + j] = to_acc(x[col]);
      }
      __syncthreads();
    }
    switch ((aligned16(x) ? 2 : 0) | (aligned16(d) ? 1 : 0)) {
      case 3: grad_segment<scalar_t, true, true>(x, d, len, rg); break;
      case 2: grad_segment<scalar_t, true, false>(x, d, len, rg); break;
      case 1: grad_segment<scalar_t, false, true>(x, d, len, rg); break;
      default: grad_segment<scalar_t, false, false>(x, d, len, rg); break;
    }
    __syncthreads();  // the label positions below are rewritten after the pass
    // The label positions in double, from the same statistics (a few per row):
    // where 1 - p and the entropy term nearly cancel, the wider evaluation is all but free.
    // (fp64 logits: that is rg itself.)
    const RowGrad<double> rg64 = [&] {
      if constexpr (std::is_same_v<acc_t, double>) {
        return rg;
      } else {
        return row_grad<double>(shift, log_sum, entropy, g_total, g_entropy, a.inv_T);
      }
    }();
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
      const int64_t y = a.labels(row, j);
      const int64_t col = column(y);
      if (col < 0) continue;
      // The first of the labels equal to y writes, with their gradients summed in label order.
      bool first = true;
      for (int64_t i = 0; i < j && first; ++i) first = a.labels(row, i) != y;
      if (!first) continue;
      acc_t g_here = 0;
      for (int64_t i = j; i < k; ++i) {
        if (a.labels(row, i) == y) g_here += a.grad_logp[row * k + i];
      }
      const double xv = a.label_x != nullptr ? a.label_x[row * k + j] : to_acc(x[col]);
      d[col] = from_acc<scalar_t>(static_cast<acc_t>(grad_at_label(xv, rg64, double(g_here), double(g_total - g_here))));
    }
  }
}

}  // namespace cuda
}  // namespace twinkle_mem
